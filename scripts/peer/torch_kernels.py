#!/usr/bin/env python3
"""The PyTorch peers of mktrain's kernel figures, on the GPU machine: dense
bf16 GEMM (cuBLAS), grouped GEMM (torch._grouped_mm) on the MoE shapes,
attention (SDPA with the flash and the cuDNN backends) forward and backward,
and the device copy bandwidth.

scripts/gpu-test.sh runs it with PEER_KERNELS=1, in the same run as the GPU
tests whose "figure:" lines it is read against (summary.json); compare ratios
from one run. The key names say the shape:

  gemm_bf16_m{M}_n{N}_k{K}_tflops          a @ b, bf16, 2*M*N*K FLOPs
  grouped_mm_T{T}_D{D}_E{E}_K{k}_N{N}_tflops
                                           T tokens, top-k, E experts with
                                           equal rows: x[T*k, D] @ W[E, D, N]
                                           (N = 2*ffn: gate and up at once)
  attn_{flash|cudnn}_B{B}_H{H}_S{S}_D{Dh}[_causal]_{fwd|bwd}_tflops
                                           4*B*H*S*S*Dh FLOPs forward (half
                                           when causal), 2.5x that backward;
                                           the backward's time is the
                                           forward+backward's less the
                                           forward's
  copy_GBps_read_plus_write                a 1 GiB device-to-device copy

Each figure is the median of 20 timed calls (CUDA events around each call,
after 3 untimed ones). A backend that refuses a shape leaves a key ending in
_error instead. Prints one JSON object (indented), with the device's name and
torch's version.

    /opt/torch/.venv/bin/python scripts/peer/torch_kernels.py >torch_kernels.json
"""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DEVICE = "cuda"

# (M, N, K): a square ceiling, then moe-small's dense and expert products.
DENSE_SHAPES = [(8192, 8192, 8192), (16384, 1024, 1024), (16384, 5632, 1024), (16384, 1024, 2816)]
# (tokens, dim, experts, top-k, ffn): moe-small, the fine-grained shape, and
# a Mixtral-8x7B-sized layer.
GROUPED_SHAPES = [(16384, 1024, 8, 2, 2816), (16384, 2048, 64, 6, 1408), (16384, 4096, 8, 2, 14336)]
# (batch, heads, seq, head dim, causal). The last two of the causal D64 and
# D128 at S2048 have the FLOPs of mktrain's attention figures (moe-small's
# B8 H16 S2048 Dh64, and B4 H16 S2048 Dh128; mktrain's run 4 KV heads,
# which changes the bytes, not the FLOPs).
ATTENTION_SHAPES = [(4, 16, 2048, 64, True), (2, 16, 8192, 128, True), (2, 16, 8192, 128, False),
                    (8, 16, 2048, 64, True), (4, 16, 2048, 128, True)]
ATTENTION_BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]


def median_ms(fn, warmup=3, reps=20):
    """The median time of fn in ms, each call between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def tflops(flops, ms):
    return round(flops / ms / 1e9, 1)


def dense_gemms(out):
    for m, n, k in DENSE_SHAPES:
        a = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=DEVICE, dtype=torch.bfloat16)
        out[f"gemm_bf16_m{m}_n{n}_k{k}_tflops"] = tflops(2 * m * n * k, median_ms(lambda: a @ b))


def grouped_gemms(out):
    for tokens, dim, experts, topk, ffn in GROUPED_SHAPES:
        rows, n = tokens * topk, 2 * ffn
        # Rows spread evenly, the remainder on the first experts.
        counts = torch.full((experts,), rows // experts, dtype=torch.int64)
        counts[: rows % experts] += 1
        offsets = counts.cumsum(0).to(device=DEVICE, dtype=torch.int32)
        x = torch.randn(rows, dim, device=DEVICE, dtype=torch.bfloat16)
        w = torch.randn(experts, dim, n, device=DEVICE, dtype=torch.bfloat16)
        ms = median_ms(lambda: torch._grouped_mm(x, w, offs=offsets))
        out[f"grouped_mm_T{tokens}_D{dim}_E{experts}_K{topk}_N{n}_tflops"] = tflops(2 * rows * dim * n, ms)


def attention(out):
    for batch, heads, seq, head_dim, causal in ATTENTION_SHAPES:
        q = torch.randn(batch, heads, seq, head_dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn_like(q, requires_grad=True)
        v = torch.randn_like(q, requires_grad=True)
        flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1)
        for name, backend in ATTENTION_BACKENDS:
            key = f"attn_{name}_B{batch}_H{heads}_S{seq}_D{head_dim}{'_causal' if causal else ''}"
            try:
                with sdpa_kernel([backend]):
                    def fwd():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    fwd_ms = median_ms(fwd)
                    grad = torch.randn_like(fwd())
                    both_ms = median_ms(lambda: fwd().backward(grad))
                out[key + "_fwd_tflops"] = tflops(flops, fwd_ms)
                out[key + "_bwd_tflops"] = tflops(2.5 * flops, both_ms - fwd_ms)
            except Exception as err:  # a backend may refuse a shape
                out[key + "_error"] = str(err)[:160]


def copy_bandwidth(out):
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    out["copy_GBps_read_plus_write"] = round(2 * 2 ** 30 / median_ms(lambda: dst.copy_(src)) / 1e6, 1)


def main():
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    dense_gemms(out)
    grouped_gemms(out)
    attention(out)
    copy_bandwidth(out)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
