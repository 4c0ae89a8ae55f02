// tokenizer_bench.js times the Hugging Face tokenizers library (the Rust
// code, through its Node binding) encoding a text file document by
// document on one thread, the peer of package tokenizer's BenchmarkEncode:
//
//	go test ./tokenizer -run TestBenchText -benchtext /tmp/bench.txt
//	NODE_PATH=/tmp/tokfix/node_modules RAYON_NUM_THREADS=1 node scripts/tokenizer_bench.js /tmp/bench.txt tokenizer/testdata/gpt2.json ...
//
// Documents are split after each blank line ("\n\n"), as the Go benchmark
// does; each is encoded without special tokens, one after the other.
'use strict'
const fs = require('fs')
const { Tokenizer } = require('tokenizers')

async function main() {
  const [textFile, ...files] = process.argv.slice(2)
  const text = fs.readFileSync(textFile, 'utf8')
  const docs = text.split(/(?<=\n\n)/)
  const mb = Buffer.byteLength(text) / 1e6
  for (const file of files) {
    const tok = Tokenizer.fromFile(file)
    let best = Infinity, tokens = 0
    for (let rep = 0; rep < 3; rep++) {
      const start = process.hrtime.bigint()
      tokens = 0
      for (const d of docs) tokens += (await tok.encode(d, null, { addSpecialTokens: false })).getLength()
      best = Math.min(best, Number(process.hrtime.bigint() - start) / 1e9)
    }
    console.log(`${file}: ${(mb / best).toFixed(2)} MB/s, ${tokens} tokens, ${(Buffer.byteLength(text) / tokens).toFixed(3)} bytes/token`)
  }
}
main().catch((e) => { console.error(e); process.exit(1) })
