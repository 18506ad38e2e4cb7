"""Torch stand-ins for the kernels DeepSeek-V4.1's model.py imports (act_quant, fp4_act_quant,
fp8_gemm, fp4_gemm, sparse_attn), written for sparsemla's V4.1 capture (v41_decode.py imports this file as
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
  fp4_gemm(x, s, w, w_s, scale_dtype, act_block_size=32): the routed experts' FP4 linear, the
      same dequantise-and-one-fp32-GEMM form (v41_whole.py's MoE).
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


def fp4_weight_to_f32(w, w_s):
    """[N, K/2] packed E2M1 (low nibble = even column; code = sign<<3 | index into
    0, 0.5, 1, 1.5, 2, 3, 4, 6) times its UE8M0 scale per 1x32 block -> fp32 [N, K], exact."""
    u = w.view(torch.uint8).long()
    codes = torch.stack([u & 0xF, u >> 4], dim=-1).flatten(-2)
    grid = torch.tensor(v4._E2M1_GRID, dtype=torch.float32, device=w.device)
    val = grid[codes & 7]
    val = torch.where((codes & 8) != 0, -val, val)
    return val * v4.e8m0_to_f32(w_s).repeat_interleave(32, 1)


def fp4_gemm(x, s, w, w_s, scale_dtype, act_block_size=32):
    """linear()'s FP4 path (routed experts): x FP8 E4M3 [..., K] with one UE8M0 scale per
    act_block_size columns (act_quant), w packed E2M1 [N, K/2] (low nibble = even column, the
    float4_e2m1fn_x2 layout) with one UE8M0 scale per 32 columns [N, K/32]. Both operands are
    dequantised exactly (power-of-two scales, E2M1 and E4M3 values are exact in fp32), one fp32
    GEMM (TF32 off), out in the default dtype (bf16). Port written for sparsemla: the V4.1
    kernel's accumulation order was not read, so this matches it up to fp32 summation order."""
    K = x.size(-1)
    xs = v4.e8m0_to_f32(s) if s.dtype != torch.float32 else s
    xf = x.reshape(-1, K).float() * xs.reshape(-1, K // act_block_size).repeat_interleave(act_block_size, 1)
    y = torch.matmul(xf, fp4_weight_to_f32(w, w_s).t())
    return y.to(torch.get_default_dtype()).view(*x.shape[:-1], w.size(0))


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    b, m = topk_idxs.shape[:2]
    if m == 1:
        valid = (topk_idxs[0, 0] >= 0).nonzero()
        if valid.numel():
            skip = (int(valid[0, 0]) // v4.CHUNK) * v4.CHUNK
            topk_idxs = topk_idxs[..., skip:]
    return v4.sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale)
