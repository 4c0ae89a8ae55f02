#!/usr/bin/env python3
"""The PyTorch peer of `mktrain bench train moe-small`: the same Mixtral-style
MoE transformer, batch and step counts, trained in eager PyTorch on one GPU.

scripts/gpu-test.sh runs it right after mktrain's benchmark, on the same
machine, and reports the ratio of the two tokens/s figures; compare ratios
from one run, never absolute figures from different runs.

The model is recipes/moe-small.yaml's: token embedding, per layer RMSNorm ->
GQA attention with RoPE (rotate-half, theta 1e6) through SDPA -> residual ->
RMSNorm -> MoE (softmax router, top-k with renormalised gates, SwiGLU experts
w1/w3/w2 through torch._grouped_mm) -> residual; final RMSNorm; untied LM
head; cross-entropy plus 0.01 x the load-balancing loss. Training: bf16
autocast over fp32 master weights, fused AdamW (lr 3e-4).

Timing: `--warmup` steps, a device sync, then `--steps` steps between two
syncs on the host clock; the figures are their mean. FLOPs per token count
6 per active parameter (the experts a token does not visit and the embedding
lookup left out) plus 6*L*D*S for causal attention, as mktrain's bench does;
MFU is over 989 TFLOP/s, the dense bf16 peak of an H100/H200 SXM.

    /opt/torch/.venv/bin/python scripts/peer/torch_moe_train.py --steps 10 --warmup 3

Prints one JSON line (the last line of its output): peer, attn, gqa, config,
params_M, active_params_M, step_ms, tokens_per_s, model_tflops, mfu, loss,
peak_mem_GB, device, torch.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

PEAK_FLOPS = 989e12  # dense bf16, H100/H200 SXM; the denominator of MFU
MOE_SMALL = dict(vocab=32768, dim=1024, layers=8, heads=16, kv_heads=4, experts=8,
                 topk=2, ffn=2816, seq=2048, batch=8)
ATTENTION_BACKENDS = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "default": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in {**MOE_SMALL, "steps": 10, "warmup": 3}.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    p.add_argument("--gqa", choices=["repeat", "sdpa"], default="repeat",
                   help="repeat: K and V repeated to every query head, as Hugging Face's repeat_kv; "
                        "sdpa: SDPA's enable_gqa")
    p.add_argument("--attn", choices=sorted(ATTENTION_BACKENDS), default="default",
                   help="the SDPA backends allowed")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (fails on torch._grouped_mm in torch 2.11)")
    return p.parse_args()


def rotate_half(x):
    first, second = x.chunk(2, -1)
    return torch.cat((-second, first), -1)


class Experts(nn.Module):
    """Router and SwiGLU experts of one layer; returns (out, aux loss)."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.router = nn.Linear(c.dim, c.experts, bias=False)
        # w1 (gate) and w3 (up) side by side, one grouped product for both.
        self.w13_EDF2 = nn.Parameter(torch.randn(c.experts, c.dim, 2 * c.ffn) * 0.02)
        self.w2_EFD = nn.Parameter(torch.randn(c.experts, c.ffn, c.dim) * 0.02)

    def forward(self, x_BSD):
        c = self.c
        x_TD = x_BSD.reshape(-1, c.dim)
        tokens = x_TD.shape[0]
        probs_TE = self.router(x_TD).float().softmax(-1)
        gates_TK, expert_TK = probs_TE.topk(c.topk, -1)
        gates_TK = gates_TK / gates_TK.sum(-1, keepdim=True)
        # Rows in expert order: row r of the sorted copy is assignment order[r].
        order = expert_TK.flatten().argsort()
        counts_E = torch.bincount(expert_TK.flatten(), minlength=c.experts)
        offsets_E = counts_E.cumsum(0).to(torch.int32)
        # torch._grouped_mm runs outside autocast: bf16 operands by hand.
        x_RD = x_TD.to(torch.bfloat16).repeat_interleave(c.topk, 0)[order]
        h_RF2 = torch._grouped_mm(x_RD, self.w13_EDF2.to(torch.bfloat16), offs=offsets_E)
        gate_RF, up_RF = h_RF2.chunk(2, -1)
        y_RD = torch._grouped_mm(F.silu(gate_RF) * up_RF, self.w2_EFD.to(torch.bfloat16), offs=offsets_E)
        out_RD = torch.empty_like(y_RD)
        out_RD[order] = y_RD
        out_TD = (out_RD.view(tokens, c.topk, c.dim) * gates_TK.unsqueeze(-1).to(out_RD.dtype)).sum(1)
        # Switch-style balance: E * sum_e (fraction routed to e) * (mean prob of e).
        aux = c.experts * ((counts_E.float() / (tokens * c.topk)) * probs_TE.mean(0)).sum()
        return out_TD.view(x_BSD.shape), aux


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        head_dim = c.dim // c.heads
        self.attn_norm = nn.RMSNorm(c.dim, eps=1e-5)
        self.moe_norm = nn.RMSNorm(c.dim, eps=1e-5)
        self.wq = nn.Linear(c.dim, c.heads * head_dim, bias=False)
        self.wkv = nn.Linear(c.dim, 2 * c.kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(c.heads * head_dim, c.dim, bias=False)
        self.moe = Experts(c)

    def forward(self, x_BSD, cos, sin):
        c = self.c
        batch, seq, _ = x_BSD.shape
        head_dim = c.dim // c.heads
        h = self.attn_norm(x_BSD)
        q_BHSd = self.wq(h).view(batch, seq, c.heads, head_dim).transpose(1, 2)
        k_BKSd, v_BKSd = self.wkv(h).view(batch, seq, 2, c.kv_heads, head_dim).permute(2, 0, 3, 1, 4)
        q_BHSd = q_BHSd * cos + rotate_half(q_BHSd) * sin
        k_BKSd = k_BKSd * cos + rotate_half(k_BKSd) * sin
        grouped = c.kv_heads != c.heads
        if grouped and c.gqa == "repeat":
            per_group = c.heads // c.kv_heads
            k_BKSd = k_BKSd.repeat_interleave(per_group, 1)
            v_BKSd = v_BKSd.repeat_interleave(per_group, 1)
        att = F.scaled_dot_product_attention(q_BHSd, k_BKSd, v_BKSd, is_causal=True,
                                             enable_gqa=grouped and c.gqa == "sdpa")
        x_BSD = x_BSD + self.wo(att.transpose(1, 2).reshape(batch, seq, c.dim))
        moe_out, aux = self.moe(self.moe_norm(x_BSD))
        return x_BSD + moe_out, aux


class Transformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.dim, eps=1e-5)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        head_dim = c.dim // c.heads
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(c.seq).float(), inv_freq)
        angles = torch.cat((angles, angles), -1)
        self.register_buffer("cos", angles.cos()[None, None].bfloat16())
        self.register_buffer("sin", angles.sin()[None, None].bfloat16())

    def forward(self, tokens_BS, targets_BS):
        x = self.embed(tokens_BS)
        aux_total = 0.0
        for layer in self.layers:
            x, aux = layer(x, self.cos, self.sin)
            aux_total = aux_total + aux
        logits = self.head(self.norm(x)).float()
        loss = F.cross_entropy(logits.view(-1, self.c.vocab), targets_BS.view(-1))
        return loss + 0.01 * aux_total


def flops_per_token(c, total_params):
    expert = 3 * c.dim * c.ffn
    active = total_params - c.layers * c.experts * expert + c.layers * c.topk * expert - c.vocab * c.dim
    return active, 6 * active + 6 * c.layers * c.dim * c.seq


def main():
    c = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    model = Transformer(c).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    forward = torch.compile(model) if c.compile else model
    tokens = torch.randint(0, c.vocab, (c.batch, c.seq), device="cuda")
    targets = torch.randint(0, c.vocab, (c.batch, c.seq), device="cuda")
    backends = ATTENTION_BACKENDS[c.attn]

    def train_step():
        with sdpa_kernel(backends), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(c.warmup):
        train_step()
    torch.cuda.synchronize()
    start = time.time()
    for _ in range(c.steps):
        loss = train_step()
    torch.cuda.synchronize()
    step_s = (time.time() - start) / c.steps

    total = sum(p.numel() for p in model.parameters())
    active, per_token = flops_per_token(c, total)
    step_tokens = c.batch * c.seq
    print(json.dumps({
        "peer": "pytorch-eager" + ("+compile" if c.compile else ""), "attn": c.attn, "gqa": c.gqa,
        "config": {k: getattr(c, k) for k in MOE_SMALL},
        "params_M": round(total / 1e6, 1), "active_params_M": round(active / 1e6, 1),
        "step_ms": round(step_s * 1e3, 2), "tokens_per_s": round(step_tokens / step_s),
        "model_tflops": round(per_token * step_tokens / step_s / 1e12, 1),
        "mfu": round(per_token * step_tokens / step_s / PEAK_FLOPS, 3),
        "loss": round(loss.item(), 4),
        "peak_mem_GB": round(torch.cuda.max_memory_allocated() / 1e9, 2),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
    }), flush=True)


if __name__ == "__main__":
    main()
