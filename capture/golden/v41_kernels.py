"""Torch stand-ins for the kernels DeepSeek-V4.1's model.py imports (act_quant, fp4_act_quant,
fp8_gemm, sparse_attn), written for sparsemla's V4.1 capture (v41_decode.py imports this file as
v41ref/kernel_cpu.py, the module name model.py's vendored copy imports). They reuse the V4 ports of capture/golden/v4_kernels.py where the V4.1
kernel differs only in block sizes, and add V4.1's pieces:

  fp4_act_quant(..., scale_dtype=float8_e4m3fn): s = E4M3_satfinite(max(amax, 6*2^-9) / 6),
      a real division (dew's transcription of kernel.py), q = E2M1_RNE(clamp(x / s, +-6));
  fp8_gemm(x, s, w, w_s, scale_dtype, block_size=32): both operands dequantised exactly
      (power-of-two scales), one fp32 GEMM, bf16 out -- the V4.1 kernel's accumulation order
      was not read, so this matches it only up to fp32 summation order;
  sparse_attn: the V4 chunked kernel order (chunks of 64, bf16(P) for P.V) with leading
      chunks that hold no key skipped (V4.1 puts a filling window's -1 first; without the skip
      the first chunk gives exp(-inf - -inf) = NaN).
"""

import torch

import v4_kernels as v4

act_quant = v4.act_quant
hc_split_sinkhorn = v4.hc_split_sinkhorn


def fp4_act_quant(x, block_size=32, inplace=False, scale_dtype=torch.float8_e8m0fnu):
    if scale_dtype != torch.float8_e4m3fn:
        return v4.fp4_act_quant(x, block_size, inplace)
    assert inplace, "only the fake-quantising path is used"
    N = x.size(-1)
    z = x.contiguous().float().unflatten(-1, (N // block_size, block_size))
    amax = z.abs().amax(dim=-1, keepdim=True).clamp_min(6.0 * 2.0 ** -9)
    t = amax / torch.tensor(6.0, dtype=torch.float32, device=x.device)
    s = t.clamp_max(448.0).to(torch.float8_e4m3fn).float()
    q = v4._e2m1_rne((z / s).clamp(-6.0, 6.0))
    x.copy_((q * s).to(x.dtype).flatten(-2))
    return x


def _dequant(w, w_s, block):
    wf = w.float()
    s = v4.e8m0_to_f32(w_s)
    s = s.repeat_interleave(block, 0)[: wf.size(0)].repeat_interleave(block, 1)[:, : wf.size(1)]
    return wf * s


def fp8_gemm(x, s, w, w_s, scale_dtype, block_size=32):
    xs = v4.e8m0_to_f32(s) if s.dtype != torch.float32 else s
    xf = x.float() * xs.repeat_interleave(block_size, -1)
    y = torch.matmul(xf, _dequant(w, w_s, block_size).t())
    return y.to(torch.get_default_dtype())


def fp4_gemm(*args, **kwargs):
    raise NotImplementedError("the capture runs no FP4 linear (no MoE)")


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    b, m = topk_idxs.shape[:2]
    if m == 1:
        valid = (topk_idxs[0, 0] >= 0).nonzero()
        if valid.numel():
            skip = (int(valid[0, 0]) // v4.CHUNK) * v4.CHUNK
            topk_idxs = topk_idxs[..., skip:]
    return v4.sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale)
