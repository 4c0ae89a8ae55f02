#!/usr/bin/env python3
"""The peer of `mktrain bench prepare`: the Hugging Face tokenizers library
(its Rust code, through the Python binding) encoding the same files with the
same tokenizer, one process per core, each on one thread.

    python scripts/peer/tokenize_peer.py --tokenizer tokenizer.json [--text-key text] \
        [--processes N] [--repeat R] corpus.jsonl ... > peer.json
    mktrain bench prepare --tokenizer tokenizer.json --cores N --peer-json peer.json corpus.jsonl ...

The documents are read as mktrain's data prepare reads them: one per
non-blank line of JSON Lines (.jsonl, .ndjson, .json; the string field
--text-key), one per row of Parquet (the column --text-key; needs pyarrow),
one per other file (UTF-8 text); .gz and .zst/.zstd are decompressed first
(zstd needs the zstandard package). Each document is encoded with the
post-processor's special tokens (add_special_tokens=True, as data prepare
does), one after the other, in N processes that take every N-th document
(fork, after the files are read). Only the encoding is timed: reading and
parsing the files are not, so the peer's figure is its best case. The
fastest of R passes is reported.

Prints one JSON object: library, version, processes, documents, text_bytes
(UTF-8 bytes of the documents' text), tokens (without end-of-document
tokens, which the peer does not add), seconds (the slowest process's
encoding time), mb_per_s (text_bytes / seconds / 1e6), mb_per_s_per_core
(mb_per_s / processes) and add_special_tokens.
"""
import argparse
import gzip
import io
import json
import multiprocessing
import os
import sys
import time

# One thread per process: the library would otherwise spread a batch over
# a thread pool, and the figure is per core.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tokenizers  # noqa: E402  (after the environment above)


def open_bytes(path):
    """The file's bytes, decompressed as its name says."""
    lower = path.lower()
    with open(path, "rb") as f:
        raw = f.read()
    if lower.endswith(".gz"):
        return gzip.decompress(raw), lower[:-3]
    if lower.endswith(".zst") or lower.endswith(".zstd"):
        import zstandard  # only needed for zstd files

        out = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
        return out, lower.rsplit(".", 1)[0]
    return raw, lower


def documents(path, text_key):
    """The documents of one file, as data prepare takes them."""
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        return [v for v in pq.read_table(path, columns=[text_key]).column(text_key).to_pylist() if v]
    raw, name = open_bytes(path)
    if name.endswith((".jsonl", ".ndjson", ".json")):
        docs = []
        for line in raw.splitlines():
            if line.strip():
                text = json.loads(line)[text_key]
                if text:
                    docs.append(text)
        return docs
    text = raw.decode("utf-8")
    return [text] if text else []


# The documents, read before the processes fork, which inherit them.
DOCS = []


def encode_share(args):
    """Encodes every n-th document from start; returns (seconds, tokens)."""
    tokenizer_path, start, n = args
    tok = tokenizers.Tokenizer.from_file(tokenizer_path)
    mine = DOCS[start::n]
    tokens = 0
    t0 = time.perf_counter()
    for d in mine:
        tokens += len(tok.encode(d, add_special_tokens=True).ids)
    return time.perf_counter() - t0, tokens


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--text-key", default="text")
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("files", nargs="+")
    a = p.parse_args()
    for f in a.files:
        DOCS.extend(documents(f, a.text_key))
    text_bytes = sum(len(d.encode("utf-8")) for d in DOCS)
    best = None
    ctx = multiprocessing.get_context("fork")
    for _ in range(a.repeat):
        jobs = [(a.tokenizer, i, a.processes) for i in range(a.processes)]
        if a.processes == 1:
            results = [encode_share(jobs[0])]
        else:
            with ctx.Pool(a.processes) as pool:
                results = pool.map(encode_share, jobs)
        seconds = max(s for s, _ in results)
        tokens = sum(t for _, t in results)
        if best is None or seconds < best[0]:
            best = (seconds, tokens)
    seconds, tokens = best
    mbs = text_bytes / seconds / 1e6
    json.dump({
        "library": "tokenizers", "version": tokenizers.__version__, "processes": a.processes,
        "documents": len(DOCS), "text_bytes": text_bytes, "tokens": tokens, "seconds": seconds,
        "mb_per_s": mbs, "mb_per_s_per_core": mbs / a.processes, "add_special_tokens": True,
    }, sys.stdout)
    print()


if __name__ == "__main__":
    main()
