// tokenizer_fixtures.js writes the test fixtures of package tokenizer
// (tokenizer/testdata): small BPE tokenizers in Hugging Face's
// tokenizer.json format, a text set, and the ids that the Hugging Face
// `tokenizers` library (its Node binding, the Rust code) gives for each
// text; plus a tiktoken rank file and the ids the `tiktoken` package (the
// Rust tiktoken core) gives. Run it as tokenizer/testdata/README.md says.
//
// The Node binding has no configurable trainer, so the merges are learned
// here by a plain BPE trainer over words cut by the library's own
// pre-tokenizers; the vocabulary and merges are then loaded into the
// library's BPE model, and every expected id comes from the library's
// encode.
'use strict'
const fs = require('fs')
const path = require('path')
const { Tokenizer } = require('tokenizers')
const { Tiktoken } = require('tiktoken')

const outDir = process.argv[2] || path.join(__dirname, '..', 'tokenizer', 'testdata')

// mulberry32: a small seeded generator, so that the corpus and texts are the same on every run.
function rng(seed) {
  return () => {
    seed |= 0
    seed = (seed + 0x6d2b79f5) | 0
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed)
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
}
const rand = rng(30)
const pick = (xs) => xs[Math.floor(rand() * xs.length)]

// ---- corpus ----
const prose = [
  "The quick brown fox jumps over the lazy dog. It's a sentence we've all seen; they'll see it again, won't they?",
  "In 1969, Apollo 11 landed on the Moon: 384,400 km away, after 4 days, 6 hours and 45 minutes.",
  "Mixture-of-experts models route each token to a few experts; the router's load balancing matters a lot.",
  "She said, \"Don't stop now!\" and I'd agree -- we're close. He'll finish by 3:45 p.m. (or 15:45).",
  "Café, naïve, résumé, jalapeño, Zürich, São Paulo, Kraków, Ærøskøbing and Øresund are all real words.",
  "Привет, мир! Как дела? Это тест для токенизатора. Ελληνικά: καλημέρα κόσμε. Ünïcödé everywhere.",
  "你好，世界！这是一个用于测试分词器的句子。我们喜欢机器学习和自然语言处理。",
  "日本語のテキストも含めます。東京は大きな都市です。カタカナとひらがなを混ぜる。",
  "한국어 문장도 있습니다. 서울은 아름다운 도시입니다.",
  "मशीन लर्निंग और प्राकृतिक भाषा प्रसंस्करण। नमस्ते दुनिया। العربية: مرحبا بالعالم، كيف حالك؟",
  "Emoji: 😀 😃 👍🏽 🚀🔥 ❤️ 👨‍👩‍👧‍👦 🇫🇷 ✅ — and symbols: © ® ™ € £ ¥ § ¶ • … ≤ ≥ ≠ ∞ ∑ √ π.",
  "Numbers: 0 1 12 123 1234 12345 123456 3.14159 2.71828 -42 +7 1e-9 0x1F 1,000,000 ٣٤٥ ½ ⅔ Ⅻ.",
  "Tabs\tand\ttabs\t\tdouble tab. Multiple   spaces    here.     End with spaces.   ",
  "Line one\nLine two\n\nLine four after blank\r\nWindows line\r\n\r\n  indented line\n\t\ttabbed line",
  "URLs like https://example.com/path?q=1&r=two#frag and emails like someone@example.org appear too.",
  "I'M SHOUTING. YOU'RE WRONG. THEY'VE LEFT. WE'LL SEE. HE'D KNOW. IT'S FINE. 'Quoted' words 'here'.",
]
const code = [
  "func main() {\n\tfmt.Println(\"hello, world\")\n\tfor i := 0; i < 10; i++ {\n\t\tsum += i * i\n\t}\n}\n",
  "def train(model, data, lr=3e-4):\n    for step, (x, y) in enumerate(data):\n        loss = model(x).cross_entropy(y)\n        loss.backward()\n        if step % 100 == 0:\n            print(f\"step {step}: loss={loss.item():.4f}\")\n",
  "{\"name\": \"mktrain\", \"version\": \"0.1.0\", \"vocab\": 32768, \"layers\": [1, 2, 3], \"ok\": true, \"x\": null}\n",
  "#include <stdio.h>\nint main(void) { int a[4] = {1, 2, 3, 4}; printf(\"%d\\n\", a[2]); return 0; }\n",
  "SELECT id, name FROM users WHERE age >= 18 AND name LIKE 'A%' ORDER BY id DESC LIMIT 10;\n",
  "<html><body><div class=\"main\">Hello &amp; welcome</div></body></html>\n",
  "    if x == y:\n        return x  # same\n    elif x > y:\n        return y\n    else:\n        raise ValueError('bad')\n",
  "const f = (a, b) => a ?? b; let s = `${a}-${b}`; arr.map(x => x ** 2).filter(Boolean);\n",
]
const words = ("the of and to in is was for on that with as by at from it this be are or an have not which but " +
  "model token data train loss layer expert router batch gradient tensor memory kernel shard checkpoint node " +
  "city river mountain music garden window history science people language number system world water light").split(' ')
function sentence() {
  const n = 4 + Math.floor(rand() * 12)
  const ws = []
  for (let i = 0; i < n; i++) {
    let w = pick(words)
    if (rand() < 0.1) w = w[0].toUpperCase() + w.slice(1)
    if (rand() < 0.05) w = String(Math.floor(rand() * 100000))
    ws.push(w)
  }
  return ws.join(' ') + pick(['.', '.', '!', '?', ',', ';', ':'])
}
const corpusLines = []
for (let rep = 0; rep < 6; rep++) {
  corpusLines.push(...prose, ...code)
}
for (let i = 0; i < 1500; i++) corpusLines.push(sentence())
const corpus = corpusLines

// ---- texts to encode ----
const texts = [
  '', ' ', '  ', '   ', '\n', '\t', '\r\n', ' \n ', 'a', 'Hello world', 'Hello World', ' Hello world', 'Hello world ',
  '  spaces', 'spaces  ', '  both  ', "'s", "'S", "'ll", "'LL", "'ſ", "it's", "IT'S", "they'll've", "'hello",
  '0', '7', '42', '123', '1234', '12345', '1234567890', '3.14159', '-1e-9', '٣٤٥', '½', 'Ⅻ', 'x1y22z333w4444',
  'Hello<|endoftext|>world', '<|endoftext|>', '<|endoftext|><|endoftext|>', 'a <|endoftext|> b', ' <|endoftext|> ',
  '<s>', '</s>', '<s> hello </s>', '<s>hello', 'hello</s>', '[INST] What is 2+2? [/INST] 4', '[INST]x[/INST]',
  '<|begin_of_text|>Hi<|eot_id|>', '<|sep|>', 'a<|sep|>b', 'a  <|sep|>  b', '<tool>', 'x<tool>y', 'call <tool> now',
  '<unk>', 'café', 'naïve', 'e\u0301', '\u00e9', 'Zürich', '你好，世界', '日本語', '한국어', 'Привет', 'مرحبا',
  'नमस्ते', '😀', '👍🏽', '👨‍👩‍👧‍👦', '🇫🇷', 'ꙮ', '𝔘𝔫𝔦𝔠𝔬𝔡𝔢', '\u00a0', 'a\u00a0b', '\u3000x', 'ǅemal', 'ǅ',
  'tab\there', '\t\tindented', 'line\nbreak', 'line\r\nbreak', 'a\n\n\nb', '   \n   x', 'x   \n', 'trailing\n',
  'word.', '...', '!!!', '?!?', '--', '->', '=>', '/path/to/file', 'a/b/c', 'http://x.y/z?q=1',
  'func main() {\n\tfmt.Println("hi")\n}\n', 'def f(x):\n    return x  # c\n', '    four spaces', '        eight',
  'MiXeD CaSe WoRdS', 'ÀÉÎÕÜ àéîõü', 'ΑΒΓ αβγ', 'Ⅷ ⅷ', '\u0300leading mark', 'a\u0308\u0301', 'x\u200dy', '\ufeffbom',
  'The quick brown fox jumps over the lazy dog.', "She said, \"Don't stop now!\"",
]
for (const line of prose.concat(code)) texts.push(line)
// Random strings over an alphabet of the characters that matter to the split rules.
const alphabet = ["a", "b", "Z", "é", "ß", "Ǆ", "ǅ", "я", "中", "ー", "ｱ", "0", "7", "٣", "½", " ", " ", "  ", "\t", "\n", "\r",
  "\u00a0", "\u3000", "'", "'s", "'T", "'re", ".", ",", "!", "/", "-", "_", "😀", "\u0301", "\u200d", "<", ">", "|", "\\", "\"", "<|endoftext|>", "<s>",
  "\v", "\f", "\u0085", "\u2003", "\u2028", "'S", "'ſ", "'VE", "'ll", "ʰ", "Ж", "\u0308", "</s>", "[INST]", "[/INST]", "<|sep|>", "<tool>",
  "<|eot_id|>", "▁", "<0x41>", "ꙮ", "𝔘", "the", "ing", " the"]
for (let i = 0; i < 400; i++) {
  const n = 1 + Math.floor(rand() * 14)
  let s = ''
  for (let k = 0; k < n; k++) s += pick(alphabet)
  texts.push(s)
}
for (let i = 0; i < 20; i++) texts.push(sentence() + ' ' + sentence())

// ---- training ----
// trainBPE learns merges over words (arrays of symbols, with counts) until
// the vocabulary reaches size: the most frequent pair first, ties to the
// smallest pair, so the result is the same on every run.
function trainBPE(wordCounts, initial, size) {
  const vocab = new Map()
  for (const s of initial) if (!vocab.has(s)) vocab.set(s, vocab.size)
  const words = [...wordCounts.entries()].map(([w, c]) => ({ syms: w, count: c }))
  const merges = []
  while (vocab.size < size) {
    const counts = new Map()
    for (const w of words) {
      for (let i = 0; i + 1 < w.syms.length; i++) {
        const key = w.syms[i] + '\u0000' + w.syms[i + 1]
        counts.set(key, (counts.get(key) || 0) + w.count)
      }
    }
    let best = null, bestCount = 0
    for (const [k, c] of counts) {
      if (c > bestCount || (c === bestCount && best !== null && k < best)) { best = k; bestCount = c }
    }
    if (best === null) break
    const [a, b] = best.split('\u0000')
    merges.push([a, b])
    if (!vocab.has(a + b)) vocab.set(a + b, vocab.size)
    for (const w of words) {
      const out = []
      for (let i = 0; i < w.syms.length; i++) {
        if (i + 1 < w.syms.length && w.syms[i] === a && w.syms[i + 1] === b) { out.push(a + b); i++ } else out.push(w.syms[i])
      }
      w.syms = out
    }
  }
  return { vocab: Object.fromEntries(vocab), merges }
}

function countWords(preTokenize) {
  const counts = new Map()
  for (const line of corpus) {
    for (const w of preTokenize(line)) {
      const key = JSON.stringify(w)
      counts.set(key, (counts.get(key) || 0) + 1)
    }
  }
  return new Map([...counts.entries()].map(([k, c]) => [JSON.parse(k), c]))
}

const byteLevelAlphabet = (() => {
  const chars = []
  let n = 0
  for (let b = 0; b < 256; b++) {
    if ((b >= 33 && b <= 126) || (b >= 0xa1 && b <= 0xac) || b >= 0xae) chars.push(String.fromCodePoint(b))
    else chars.push(String.fromCodePoint(256 + n++))
  }
  return chars
})()

const gpt2PreTokenizer = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true }
const llama3Regex = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
const o200kRegex = "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
const llama3PreTokenizer = {
  type: 'Sequence', pretokenizers: [
    { type: 'Split', pattern: { Regex: llama3Regex }, behavior: 'Isolated', invert: false },
    { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false },
  ],
}

// preTokenizerOf loads a pre-tokenizer into the library through a skeleton tokenizer.json.
function preTokenizerOf(preTokenizer, normalizer) {
  const t = Tokenizer.fromString(JSON.stringify(tokenizerJSON({ vocab: {}, merges: [] }, { pre_tokenizer: preTokenizer, normalizer: normalizer || null })))
  const pt = t.getPreTokenizer()
  const nz = t.getNormalizer()
  return (s) => {
    if (nz) s = nz.normalizeString(s)
    if (!pt) return [s.split('')].filter((w) => w.length)
    return pt.preTokenizeString(s).map(([w]) => Array.from(w))
  }
}

function tokenizerJSON(model, parts) {
  return {
    version: '1.0', truncation: null, padding: null,
    added_tokens: parts.added_tokens || [],
    normalizer: parts.normalizer || null,
    pre_tokenizer: parts.pre_tokenizer || null,
    post_processor: parts.post_processor || null,
    decoder: parts.decoder || null,
    model: Object.assign({
      type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: false, byte_fallback: false, ignore_merges: false,
    }, model),
  }
}

function added(id, content, opts) {
  return Object.assign({ id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true }, opts || {})
}

// ---- the tokenizers ----
const fixtures = []

{ // (a) GPT-2 style byte-level.
  const m = trainBPE(countWords(preTokenizerOf(gpt2PreTokenizer)), byteLevelAlphabet, 2600)
  const n = Object.keys(m.vocab).length
  const base = {
    added_tokens: [added(n, '<|endoftext|>'), added(n + 1, '<|sep|>', { lstrip: true, rstrip: true })],
    pre_tokenizer: gpt2PreTokenizer,
    post_processor: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true },
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
  }
  fixtures.push({ name: 'gpt2', json: tokenizerJSON(m, base), model: m })
  fixtures.push({ name: 'gpt2-prefix-space', json: tokenizerJSON(m, Object.assign({}, base, { pre_tokenizer: Object.assign({}, gpt2PreTokenizer, { add_prefix_space: true }) })) })
  // The same model behind the other normalizers and Split behaviours, with
  // regexes that no hand-written matcher knows.
  const noRegexByteLevel = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }
  fixtures.push({
    name: 'custom-a', json: tokenizerJSON(m, Object.assign({}, base, {
      normalizer: { type: 'Sequence', normalizers: [{ type: 'NFKC' }, { type: 'Replace', pattern: { Regex: '\\s{3,}' }, content: '  ' }] },
      pre_tokenizer: {
        type: 'Sequence', pretokenizers: [
          { type: 'Split', pattern: { Regex: '\\p{P}+' }, behavior: 'MergedWithPrevious', invert: false },
          { type: 'Digits', individual_digits: true },
          { type: 'Split', pattern: { String: ' ' }, behavior: 'MergedWithNext', invert: false },
          noRegexByteLevel,
        ],
      },
    })),
  })
  fixtures.push({
    name: 'custom-b', json: tokenizerJSON(m, Object.assign({}, base, {
      normalizer: { type: 'Sequence', normalizers: [{ type: 'NFD' }, { type: 'Lowercase' }, { type: 'Strip', strip_left: true, strip_right: false }] },
      pre_tokenizer: {
        type: 'Sequence', pretokenizers: [
          { type: 'Split', pattern: { Regex: '[a-z]+(?=[0-9])|\\s+' }, behavior: 'Removed', invert: false },
          { type: 'Digits', individual_digits: false },
          { type: 'Split', pattern: { Regex: '[^\\p{L}]' }, behavior: 'Contiguous', invert: true },
          { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
        ],
      },
    })),
  })
}

let llama3Model
{ // (b) Llama 3 style: the cl100k regex in a Split, ByteLevel without its regex, ignore_merges, a BOS template.
  const m = trainBPE(countWords(preTokenizerOf(llama3PreTokenizer)), byteLevelAlphabet, 3000)
  llama3Model = m
  const n = Object.keys(m.vocab).length
  fixtures.push({
    name: 'llama3', json: tokenizerJSON(Object.assign({ ignore_merges: true }, m), {
      added_tokens: [added(n, '<|begin_of_text|>'), added(n + 1, '<|end_of_text|>'), added(n + 2, '<|reserved_special_token_0|>'),
        added(n + 3, '<|eot_id|>'), added(n + 4, '<tool>', { special: false, normalized: true, single_word: true })],
      pre_tokenizer: llama3PreTokenizer,
      post_processor: {
        type: 'Sequence', processors: [
          { type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true },
          {
            type: 'TemplateProcessing',
            single: [{ SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
            pair: [{ SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }, { SpecialToken: { id: '<|begin_of_text|>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
            special_tokens: { '<|begin_of_text|>': { id: '<|begin_of_text|>', ids: [n], tokens: ['<|begin_of_text|>'] } },
          },
        ],
      },
      decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    }),
  })
}

{ // (c) SentencePiece style (Llama 2, Mistral): ▁ for spaces, byte fallback, <unk> <s> </s>.
  const spWords = preTokenizerOf({ type: 'Metaspace', replacement: '▁', prepend_scheme: 'always', split: true })
  const counts = countWords(spWords)
  const charCount = new Map()
  for (const [w, c] of counts) for (const ch of w) charCount.set(ch, (charCount.get(ch) || 0) + c)
  // Characters seen fewer than 3 times are left to byte fallback.
  const chars = [...charCount.entries()].filter(([, c]) => c >= 3).map(([ch]) => ch).sort()
  const bytes = []
  for (let b = 0; b < 256; b++) bytes.push('<0x' + b.toString(16).toUpperCase().padStart(2, '0') + '>')
  const initial = ['<unk>', '<s>', '</s>', ...bytes, ...chars]
  const kept = new Set(chars)
  const trainCounts = new Map([...counts.entries()].filter(([w]) => w.every((ch) => kept.has(ch))))
  const m = trainBPE(trainCounts, initial, 2200)
  const spModel = Object.assign({ unk_token: '<unk>', fuse_unk: true, byte_fallback: true }, m)
  const specials = [added(0, '<unk>'), added(1, '<s>'), added(2, '</s>')]
  const n = Object.keys(m.vocab).length
  const inst = [added(n, '[INST]'), added(n + 1, '[/INST]', { rstrip: true })]
  // A normalized, non-special token: matched (and decoded) in its normalized form.
  const tool = [added(n + 2, '<tool>', { special: false, normalized: true })]
  const bosTemplate = {
    type: 'TemplateProcessing',
    single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
    pair: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }, { SpecialToken: { id: '<s>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
    special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] } },
  }
  const legacyDecoder = {
    type: 'Sequence', decoders: [
      { type: 'Replace', pattern: { String: '▁' }, content: ' ' }, { type: 'ByteFallback' }, { type: 'Fuse' },
      { type: 'Strip', content: ' ', start: 1, stop: 0 },
    ],
  }
  // Llama 2 (and Mistral's first tokenizer.json): a Prepend and Replace normalizer, no pre-tokenizer.
  fixtures.push({
    name: 'llama2', json: tokenizerJSON(spModel, {
      added_tokens: specials.concat(inst, tool),
      normalizer: { type: 'Sequence', normalizers: [{ type: 'Prepend', prepend: '▁' }, { type: 'Replace', pattern: { String: ' ' }, content: '▁' }] },
      post_processor: bosTemplate, decoder: legacyDecoder,
    }),
  })
  // Mistral/Mixtral as current transformers writes it: Metaspace, prepend_scheme first, no split.
  fixtures.push({
    name: 'mistral', json: tokenizerJSON(spModel, {
      added_tokens: specials.concat(inst),
      pre_tokenizer: { type: 'Metaspace', replacement: '▁', prepend_scheme: 'first', split: false },
      post_processor: bosTemplate, decoder: legacyDecoder,
    }),
  })
  // Metaspace that splits words, always prepends, and a ByteFallback-then-Metaspace decoder.
  fixtures.push({
    name: 'metaspace-split', json: tokenizerJSON(spModel, {
      added_tokens: specials,
      pre_tokenizer: { type: 'Metaspace', replacement: '▁', prepend_scheme: 'always', split: true },
      post_processor: bosTemplate,
      decoder: { type: 'Sequence', decoders: [{ type: 'ByteFallback' }, { type: 'Metaspace', replacement: '▁', prepend_scheme: 'always', split: true }] },
    }),
  })
}

function unicodeOf(s) { // byte-alphabet token -> raw bytes
  const inv = new Map(byteLevelAlphabet.map((c, b) => [c, b]))
  return Buffer.from(Array.from(s).map((c) => inv.get(c)))
}

async function main() {
  fs.mkdirSync(outDir, { recursive: true })
  fs.writeFileSync(path.join(outDir, 'texts.json'), JSON.stringify(texts, null, 1) + '\n')
  // The pre-tokenizers' own cuts (Oniguruma's regex matches for the
  // byte-level ones), which the ids alone can hide when no merge crosses a cut.
  const pretokenized = {}
  for (const f of fixtures) {
    if (!['gpt2', 'llama3', 'metaspace-split', 'mistral'].includes(f.name)) continue
    const pt = Tokenizer.fromString(JSON.stringify(f.json)).getPreTokenizer()
    pretokenized[f.name] = texts.map((t) => (t === '' ? [] : pt.preTokenizeString(t).map(([w]) => w)))
  }
  { // o200k's regex, which no fixture tokenizer.json carries: through a skeleton one.
    const pt = preTokenizerOf({ type: 'Sequence', pretokenizers: [{ type: 'Split', pattern: { Regex: o200kRegex }, behavior: 'Isolated', invert: false }, { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }] })
    pretokenized.o200k = texts.map((t) => (t === '' ? [] : pt(t).map((w) => w.join(''))))
  }
  fs.writeFileSync(path.join(outDir, 'pretokenized.json'), JSON.stringify(pretokenized) + '\n')
  for (const f of fixtures) {
    const file = path.join(outDir, f.name + '.json')
    Tokenizer.fromString(JSON.stringify(f.json)).save(file, true) // the library's own serialization
    const tok = Tokenizer.fromFile(file)
    const cases = []
    for (const text of texts) {
      const plain = await tok.encode(text, null, { addSpecialTokens: false })
      const special = await tok.encode(text, null, { addSpecialTokens: true })
      const ids = plain.getIds()
      cases.push({ ids, ids_special: special.getIds(), decoded: await tok.decode(ids, false) })
    }
    fs.writeFileSync(path.join(outDir, f.name + '.expected.json'), JSON.stringify(cases) + '\n')
    console.log(`${f.name}: vocab ${tok.getVocabSize(true)}, ${cases.length} texts`)
  }
  // (d) a tiktoken rank file from (b)'s vocabulary (rank = id), with the
  // cl100k pattern and <|endoftext|> after the last rank.
  const lines = Object.entries(llama3Model.vocab).sort((x, y) => x[1] - y[1]).map(([s, id]) => unicodeOf(s).toString('base64') + ' ' + id)
  const rankFile = lines.join('\n') + '\n'
  fs.writeFileSync(path.join(outDir, 'tiny_cl100k.tiktoken'), rankFile)
  const eot = lines.length
  const enc = new Tiktoken(rankFile, { '<|endoftext|>': eot }, llama3Regex)
  const cases = []
  for (const text of texts) {
    const ids = Array.from(enc.encode(text, 'all'))
    cases.push({ ids, decoded: Buffer.from(enc.decode(new Uint32Array(ids))).toString('utf8') })
  }
  enc.free()
  fs.writeFileSync(path.join(outDir, 'tiny_cl100k.expected.json'), JSON.stringify(cases) + '\n')
  // The same ranks with o200k's pattern.
  const enc2 = new Tiktoken(rankFile, { '<|endoftext|>': eot }, o200kRegex)
  const cases2 = texts.map((text) => ({ ids: Array.from(enc2.encode(text, 'all')) }))
  enc2.free()
  fs.writeFileSync(path.join(outDir, 'tiny_o200k.expected.json'), JSON.stringify(cases2) + '\n')
  console.log(`tiny_cl100k.tiktoken: ${lines.length} ranks, <|endoftext|> = ${eot}`)
}

main().catch((e) => { console.error(e); process.exit(1) })
