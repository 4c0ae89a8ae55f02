#!/usr/bin/env python3
"""The PyTorch peer of `mktrain bench attention`: SDPA, causal, bf16, forward
and backward, with the cuDNN and the flash backends, on the GPU machine.

`mktrain bench attention --peer PYTHON` runs this script as a child process
on the same shapes, in the same command, and reads the JSON it prints; it
also runs alone:

    /opt/torch/.venv/bin/python3 scripts/peer/attention_peer.py >attention_peer.json
    ... --shape 8,2048,16,4,64 --shape 2,8192,16,16,128 --iters 20

Shapes are B,S,H,KV,DH (batch, sequence, query heads, key/value heads, head
dim); the default is the benchmark's three: B8 S2048 H16 KV4 Dh64, B2 S8192
H16 KV16 Dh128 and B1 S32768 H32 KV8 Dh128.

What it measures, per shape and backend (torch.nn.attention.sdpa_kernel
with that backend alone, so a figure is that backend's or there is none):

  - q, k and v are bf16, stored [B, S, heads, Dh] as a model's projections
    give them (mktrain's [T, H*Dh] rows) and passed as [B, heads, S, Dh]
    views; is_causal=True.
  - GQA (KV < H): enable_gqa=True where the backend takes it; where it
    refuses, k and v are repeated to every query head once, before timing
    (repeat_interleave, as repeat_kv orders them), and the row says
    "gqa": "repeated_kv". With KV = H there is nothing to group ("none").
  - forward: one scaled_dot_product_attention call with grad enabled, as in
    training (the backend also writes the log-sum-exp the backward reads).
  - backward: torch.autograd.grad of that call's output with a random
    output gradient (dq, dk, dv returned, nothing accumulated into .grad);
    the forward before it is not timed. With repeated k and v the backward
    returns the repeated heads' gradients (the sum over each group, which
    a model would add, is not timed).
  - each call between two CUDA events, after --warmup untimed calls; the
    median of --iters. Calls rotate over enough input sets that one set's
    tensors are not in L2 when it is used again (at least twice the L2
    size between two uses of a set; the row says how many sets).
  - TFLOP/s with the causal FLOP count: forward 2*2*B*H*S*S*Dh/2, backward
    2.5x the forward (the same count mktrain uses).

It prints one JSON object on stdout, with the device's name, torch's and
CUDA's versions and a row per (shape, backend). It fails loudly: when CUDA
or a backend is not available for a shape, or a call fails, it prints the
reason on stderr, nothing on stdout, and exits 1; it never prints a figure
it did not measure.
"""
import argparse
import json
import math
import sys
import warnings

# The shapes of `mktrain bench attention` (B, S, H, KV, Dh).
DEFAULT_SHAPES = [(8, 2048, 16, 4, 64), (2, 8192, 16, 16, 128), (1, 32768, 32, 8, 128)]
BACKEND_NAMES = ("cudnn", "flash")


class PeerError(Exception):
    """A figure that cannot be measured; the message says which and why."""


def parse_shape(text):
    try:
        dims = tuple(int(f) for f in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 5 or min(dims) < 1:
        raise argparse.ArgumentTypeError("shape %r is not five positive integers B,S,H,KV,DH" % text)
    b, s, h, kv, dh = dims
    if h % kv != 0:
        raise argparse.ArgumentTypeError("shape %r: %d query heads are not a multiple of %d key/value heads" % (text, h, kv))
    return dims


def parse_backends(text):
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in BACKEND_NAMES:
            raise argparse.ArgumentTypeError("backend %r is not one of %s" % (n, ", ".join(BACKEND_NAMES)))
    if not names:
        raise argparse.ArgumentTypeError("no backend named")
    return names


def causal_flops(b, s, h, dh):
    """The forward's FLOPs: two products of B*H*S*S*Dh multiply-adds, half
    of them masked."""
    return 2 * 2 * b * h * s * s * dh / 2


def shape_name(dims):
    return "B%d S%d H%d KV%d Dh%d" % dims


def describe_refusal(err, caught):
    """The error and the warnings PyTorch gave with it (SDPA says there why
    a backend refused)."""
    reasons = [str(w.message) for w in caught]
    return "; ".join([str(err).strip()] + reasons)


class Shape:
    """One shape's inputs on the GPU, in as many sets as rotate past L2."""

    def __init__(self, torch, dims, sets, repeat_kv):
        self.dims = dims
        b, s, h, kv, dh = dims
        heads_kv = h if repeat_kv else kv
        self.sets = []
        for _ in range(sets):
            def rows(heads):
                # [B, S, heads, Dh] storage, viewed [B, heads, S, Dh].
                return torch.randn(b, s, heads, dh, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            q = rows(h)
            k, v = rows(kv), rows(kv)
            if repeat_kv:
                # Once, before timing: each key/value head serves h/kv query
                # heads in a row (repeat_kv's order).
                k = k.repeat_interleave(h // kv, dim=1)
                v = v.repeat_interleave(h // kv, dim=1)
            for t in (q, k, v):
                t.requires_grad_(True)
            dout = torch.randn(b, s, h, dh, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            self.sets.append((q, k, v, dout))
        self.heads_kv = heads_kv


def set_bytes(dims, repeat_kv):
    """The bytes one call reads and writes at least: q, k, v, the output
    and (backward) their gradients, bf16."""
    b, s, h, kv, dh = dims
    heads_kv = h if repeat_kv else kv
    return 2 * b * s * dh * (2 * h + 2 * heads_kv) * 2


def sets_for(dims, repeat_kv, l2_bytes):
    """Enough input sets that at least twice the L2 size is touched between
    two uses of one set (at most 8)."""
    return max(1, min(8, math.ceil(2 * l2_bytes / set_bytes(dims, repeat_kv))))


def median_ms(torch, calls):
    """Runs each (before, timed) pair of calls: before untimed, timed
    between two CUDA events; returns the median of the timed ones, in ms."""
    events = []
    for before, timed in calls:
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        timed()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2]


def measure(torch, F, sdpa_kernel, backend, dims, gqa, l2_bytes, warmup, iters):
    """One backend on one shape: the forward and backward medians."""
    repeat_kv = gqa == "repeated_kv"
    sets = sets_for(dims, repeat_kv, l2_bytes)
    shape = Shape(torch, dims, sets, repeat_kv)
    enable_gqa = gqa == "enable_gqa"

    def forward(i):
        q, k, v, _ = shape.sets[i % sets]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)

    held = {}

    def run_forward(i):
        def call():
            forward(i)  # the output and its graph are dropped at once
        return call

    def run_backward_prep(i):
        def call():
            held["out"] = forward(i)
        return call

    def run_backward(i):
        def call():
            q, k, v, dout = shape.sets[i % sets]
            torch.autograd.grad(held.pop("out"), (q, k, v), dout)
        return call

    with sdpa_kernel([backend]):
        # Warm-up: the backend's first calls build and cache its plans.
        for i in range(warmup):
            run_backward_prep(i)()
            run_backward(i)()
        torch.cuda.synchronize()
        fwd_ms = median_ms(torch, [(None, run_forward(i)) for i in range(iters)])
        bwd_ms = median_ms(torch, [(run_backward_prep(i), run_backward(i)) for i in range(iters)])
    del shape, held
    torch.cuda.empty_cache()
    return fwd_ms, bwd_ms, sets


def pick_gqa(torch, F, sdpa_kernel, backend, name, dims):
    """How this backend gets GQA on this shape: "none" when KV = H, else
    "enable_gqa" if it runs a call with it, else "repeated_kv" if it runs
    one with k and v repeated. Neither: PeerError with SDPA's reasons."""
    b, s, h, kv, dh = dims
    # A short probe of the same heads and head dim: the backend's
    # constraints are on those, the layout and the dtype, not on S.
    probe_dims = (1, min(s, 256), h, kv, dh)
    tries = ["none"] if h == kv else ["enable_gqa", "repeated_kv"]
    refusals = []
    for gqa in tries:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                probe = Shape(torch, probe_dims, 1, gqa == "repeated_kv")
                q, k, v, dout = probe.sets[0]
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa == "enable_gqa")
                    torch.autograd.grad(out, (q, k, v), dout)
                torch.cuda.synchronize()
                return gqa
            except RuntimeError as err:
                refusals.append("%s: %s" % (gqa, describe_refusal(err, caught)))
    raise PeerError("the %s backend of SDPA is not available for %s: %s" % (name, shape_name(dims), " | ".join(refusals)))


def main():
    ap = argparse.ArgumentParser(description="PyTorch SDPA (cuDNN, flash), causal bf16 attention, forward and backward")
    ap.add_argument("--shape", action="append", type=parse_shape, metavar="B,S,H,KV,DH",
                    help="a shape (repeatable; default the benchmark's three)")
    ap.add_argument("--backends", type=parse_backends, default=list(BACKEND_NAMES), help="cudnn,flash (default both)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per figure (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed forward+backward calls first (default 3)")
    args = ap.parse_args()
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be positive and --warmup not negative")
    shapes = args.shape or DEFAULT_SHAPES

    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as err:
        raise PeerError("PyTorch with torch.nn.attention is not importable: %s" % err)
    if not torch.cuda.is_available():
        raise PeerError("CUDA is not available to PyTorch %s" % torch.__version__)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 0)
    l2_known = l2_bytes > 0
    if not l2_known:
        l2_bytes = 64 << 20  # more than any current GPU's L2 but the B200's

    rows = []
    for dims in shapes:
        b, s, h, kv, dh = dims
        flops = causal_flops(b, s, h, dh)
        for name in args.backends:
            backend = backends[name]
            gqa = pick_gqa(torch, F, sdpa_kernel, backend, name, dims)
            print("attention_peer: %s %s (gqa: %s)..." % (name, shape_name(dims), gqa), file=sys.stderr, flush=True)
            try:
                fwd_ms, bwd_ms, sets = measure(torch, F, sdpa_kernel, backend, dims, gqa, l2_bytes, args.warmup, args.iters)
            except RuntimeError as err:
                raise PeerError("the %s backend failed on %s: %s" % (name, shape_name(dims), str(err).strip()))
            row = {"batch": b, "seq": s, "heads": h, "kv_heads": kv, "head_dim": dh, "backend": name, "gqa": gqa,
                   "input_sets": sets, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
                   "fwd_tflops": flops / fwd_ms / 1e9, "bwd_tflops": 2.5 * flops / bwd_ms / 1e9}
            rows.append(row)
            print("attention_peer: %s %s: fwd %.3f ms (%.1f TFLOP/s), bwd %.3f ms (%.1f TFLOP/s)"
                  % (name, shape_name(dims), fwd_ms, row["fwd_tflops"], bwd_ms, row["bwd_tflops"]), file=sys.stderr, flush=True)

    out = {
        "peer": "torch.nn.functional.scaled_dot_product_attention",
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(0), "l2_bytes": l2_bytes if l2_known else None,
        "dtype": "bfloat16", "causal": True, "layout": "[B, S, heads, Dh] storage, passed as [B, heads, S, Dh] views",
        "iters": args.iters, "warmup": args.warmup,
        "timing": "median of --iters calls, each between two CUDA events; backward: torch.autograd.grad after an untimed forward",
        "flops": "forward 2*2*B*H*S*S*Dh/2, backward 2.5x the forward",
        "rows": rows,
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    try:
        main()
    except PeerError as err:
        print("attention_peer: error: %s" % err, file=sys.stderr)
        sys.exit(1)
