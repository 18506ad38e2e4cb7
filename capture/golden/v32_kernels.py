"""Torch stand-in for the DeepSeek-V3.2-Exp TileLang kernels (inference/kernel.py, 2305c7e).

model.py imports ``act_quant, fp8_gemm, fp8_index`` from ``kernel``. The V3.2 act_quant
(round_scale when scale_fmt is set: s = 2^ceil(log2(max(amax, 1e-4)/448)) from the fp32
bits, q = E4M3(clamp(x/s, +-448))) and fp8_gemm (per-128 activation scales, 128x128
weight scales, fp32 accumulation, bf16 out) are the formulas of the V4 kernels, so they
are taken from v4_kernels.py (its docstring says what is bit-faithful and what is not:
the GEMM's summation order). fp8_index is ported here from fp8_index_kernel:

  logits[b, m, n, h] = sum_d q[b, m, h, d] * k[b, n, d]      (E4M3 operands, fp32)
  logits = max(logits, 0) * q_s[b, m, h]                      (q_s: the indexer's weights)
  o[b, m, n] = (sum_h logits[b, m, n, h]) * k_s[b, n]          (fp32)

The kernel sums the 128 products on tensor cores and the heads with reduce_sum; this port
uses one fp32 einsum (TF32 off) and torch.sum: the last fp32 bits may differ.
"""

import types

import torch

import v4_kernels

act_quant = v4_kernels.act_quant
fp8_gemm = v4_kernels.fp8_gemm
hadamard_module = v4_kernels.hadamard_module
ceil2_bits = v4_kernels.ceil2_bits
FP8_MAX_INV = v4_kernels.FP8_MAX_INV


def fp8_index(q, q_s, k, k_s):
    """fp8_index_kernel: q [b, m, h, d] E4M3, q_s [b, m, h(, 1)] fp32, k [b, n, d] E4M3, k_s [b, n(, 1)] fp32 -> [b, m, n] fp32."""
    b, m, h, d = q.shape
    n = k.size(1)
    logits = torch.einsum("bmhd,bnd->bmnh", q.float(), k.float())
    logits = logits.clamp_min(0) * q_s.float().reshape(b, m, 1, h)
    return logits.sum(-1) * k_s.float().reshape(b, 1, n)


def einops_module():
    """einops stand-in with the one rearrange pattern model.py uses: 'b s (h d) -> b s h d'."""
    mod = types.ModuleType("einops")

    def rearrange(x, pattern, **sizes):
        assert pattern == "b s (h d) -> b s h d", pattern
        d = sizes["d"]
        return x.view(*x.shape[:-1], x.size(-1) // d, d)

    mod.rearrange = rearrange
    return mod
