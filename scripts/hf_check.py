#!/usr/bin/env python3
"""Check an mktrain export against Hugging Face transformers.

Loads an exported directory (`mktrain export --format hf --dtype fp32`) with
transformers' MixtralForCausalLM in float32 on the CPU, computes the mean
next-token cross-entropy over token windows, prints one JSON object and, given
an expected loss, exits 1 when the two differ by more than --rtol (relative).

The windows are those `mktrain eval` scores: each token file (llm.c .bin
shard) in sorted path order is cut into windows of seq+1 tokens at stride seq
(window i covers tokens [i*seq, i*seq+seq]; a file's tail too short for a
window is unused; windows never span two files); the first --windows windows
are scored, inputs the first seq tokens of a window and targets the last seq.
Every target counts once in the mean, as in mktrain.

The pair of commands (from the repository root, on a machine with torch,
transformers and numpy; bin/mktrain from `make build`):

    bin/mktrain eval --checkpoint RUN --data 'DATA/val_*.bin' --batches 4 --json > eval.json
    python3 scripts/hf_check.py HF_DIR --mktrain-json eval.json

--mktrain-json reads eval's output: the loss to expect, seq, windows, and the
shard glob (when no token file is named). A whole check from nothing:

    bin/mktrain run tiny --run-dir /tmp/hfc --set train.steps=60
    bin/mktrain data prepare --out /tmp/hfc/data --val-fraction 0.5 'engine/*.go'
    bin/mktrain export --format hf --dtype fp32 /tmp/hfc /tmp/hfc/hf
    bin/mktrain eval --checkpoint /tmp/hfc --data '/tmp/hfc/data/val_*.bin' --batches 4 --json > /tmp/hfc/eval.json
    python3 scripts/hf_check.py /tmp/hfc/hf --mktrain-json /tmp/hfc/eval.json

Without --mktrain-json: name the token files (or --tokens-json FILE: a JSON
list of token lists, each scored whole, or one flat list cut into windows
like a shard) and pass --seq, --windows and --expect yourself.

Export fp32 for this check: a bf16 export rounds the weights, and its loss
differs from mktrain's by more than the tolerance.
"""

import argparse
import glob
import json
import math
import sys

import numpy as np
import torch
import transformers
from transformers import MixtralForCausalLM

# llm.c shard header: 256 little-endian int32; magic and version pick the
# token width.
SHARD_FORMATS = {20240520: (1, np.uint16), 20240801: (7, np.uint32)}


def read_shard(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    if len(header) != 256:
        sys.exit(f"{path}: shorter than the 1024-byte shard header")
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic not in SHARD_FORMATS or SHARD_FORMATS[magic][0] != version:
        sys.exit(f"{path}: magic {magic} version {version} is not an llm.c token shard")
    dtype = np.dtype(SHARD_FORMATS[magic][1]).newbyteorder("<")
    tokens = np.fromfile(path, dtype=dtype, offset=1024)
    if len(tokens) != count:
        sys.exit(f"{path}: header says {count} tokens, the file holds {len(tokens)}")
    return tokens.astype(np.int64)


def windows_of(tokens, seq):
    n = (len(tokens) - 1) // seq if len(tokens) > seq else 0
    return [tokens[i * seq : i * seq + seq + 1] for i in range(n)]


def load_windows(args):
    if args.tokens_json:
        with open(args.tokens_json) as f:
            data = json.load(f)
        if data and all(isinstance(x, int) for x in data):
            if not args.seq:
                sys.exit("--tokens-json holds one flat list: give --seq to cut it into windows")
            return windows_of(np.array(data, dtype=np.int64), args.seq)
        return [np.array(s, dtype=np.int64) for s in data]
    if not args.seq:
        sys.exit("give --seq (or --mktrain-json)")
    paths = []
    for p in args.tokens:
        matches = sorted(glob.glob(p))
        if not matches:
            sys.exit(f"{p}: no such token file")
        paths.extend(matches)
    out = []
    for p in sorted(set(paths)):
        out.extend(windows_of(read_shard(p), args.seq))
    return out


def mean_loss(model, windows, batch_size):
    total, count = 0.0, 0
    with torch.no_grad():
        i = 0
        while i < len(windows):
            # Windows of one length share a batch.
            group = [windows[i]]
            while (
                len(group) < batch_size
                and i + len(group) < len(windows)
                and len(windows[i + len(group)]) == len(group[0])
            ):
                group.append(windows[i + len(group)])
            i += len(group)
            batch = torch.tensor(np.stack(group))
            inputs, targets = batch[:, :-1], batch[:, 1:]
            logits = model(input_ids=inputs).logits.double()
            logp = torch.log_softmax(logits, dim=-1)
            total += -logp.gather(-1, targets.unsqueeze(-1)).sum().item()
            count += targets.numel()
    return total / count, count


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", help="exported Hugging Face directory")
    ap.add_argument("tokens", nargs="*", help="llm.c token shards (.bin) or globs, in mktrain's order")
    ap.add_argument("--tokens-json", help="JSON token lists instead of shards")
    ap.add_argument("--mktrain-json", help="output of `mktrain eval --json`: sets --expect, --seq, --windows and the shards")
    ap.add_argument("--seq", type=int, help="tokens per sequence (train.seq)")
    ap.add_argument("--windows", type=int, help="score the first N windows (default: all)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--expect", type=float, help="mktrain's loss on the same windows")
    ap.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance for --expect")
    args = ap.parse_args()

    if args.mktrain_json:
        with open(args.mktrain_json) as f:
            ev = json.load(f)
        args.seq = args.seq or ev["seq"]
        args.windows = args.windows or ev["windows"]
        if args.expect is None:
            args.expect = ev["loss"]
        if not args.tokens and not args.tokens_json:
            if ev["data"] == "default-corpus/val":
                sys.exit("the eval scored the embedded corpus, which has no file: rerun mktrain eval with --data SHARDS")
            args.tokens = [ev["data"]]
    if not args.tokens and not args.tokens_json:
        sys.exit("name token files, --tokens-json or --mktrain-json")

    windows = load_windows(args)
    if args.windows:
        if len(windows) < args.windows:
            sys.exit(f"the data holds {len(windows)} windows, fewer than --windows {args.windows}")
        windows = windows[: args.windows]
    if not windows:
        sys.exit("no windows to score")

    # transformers 4.56 renamed torch_dtype to dtype.
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2] if x.isdigit())
    dtype_arg = "dtype" if version >= (4, 56) else "torch_dtype"
    model = MixtralForCausalLM.from_pretrained(args.hf_dir, attn_implementation="eager", **{dtype_arg: torch.float32})
    model = model.float().eval()
    vocab = model.config.vocab_size
    for w in windows:
        if w.min() < 0 or w.max() >= vocab:
            sys.exit(f"a token is outside the model's vocabulary [0, {vocab})")

    loss, count = mean_loss(model, windows, args.batch_size)
    out = {"hf_loss": loss, "tokens": count, "windows": len(windows), "seq": args.seq}
    ok = True
    if args.expect is not None:
        rel = abs(loss - args.expect) / max(abs(args.expect), 1e-12)
        ok = rel <= args.rtol
        out.update({"expect": args.expect, "rel_diff": rel, "rtol": args.rtol, "ok": ok})
    print(json.dumps(out))
    if not math.isfinite(loss) or not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
