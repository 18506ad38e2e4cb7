"""Torch port of the official DeepSeek-V4 TileLang kernels (post-fix revision).

The official inference ``model.py`` does ``from kernel import act_quant, fp4_act_quant,
fp8_gemm, fp4_gemm, sparse_attn, hc_split_sinkhorn`` and, inside ``rotate_activation``,
``from fast_hadamard_transform import hadamard_transform``. Neither TileLang nor
fast-hadamard-transform is installable on the GPU machine, so ``v4_decode.py`` registers
this module as ``kernel`` and ``hadamard_module()`` as ``fast_hadamard_transform`` before
importing the unmodified ``model.py``.

Semantics follow ``inference/kernel.py`` of deepseek-ai/DeepSeek-V4-Flash at HF revision
60d8d707 (byte-identical to Nicooo-Wang/DeepSeek-V4-Pro-code:inference/kernel_tilelang.py,
SHA-256 59b32508...c0c2): the in-place ``act_quant`` casts to FP8 E4M3 (the release-day
kernel cast to bf16, which made the fake quantisation a no-op). Each function names the
kernel it mirrors. What is faithful and what is not:

* act_quant / fp4_act_quant: bit-exact to the kernel formula (amax floor, scale
  ``2^ceil(log2(f32(amax * f32(1/max))))`` taken from the fp32 bits, clamp, RNE cast,
  multiply back, bf16 out).
* fp8_gemm / fp4_gemm: both operands dequantised exactly (power-of-two scales), one fp32
  GEMM (TF32 off), bf16 out. The kernel sums each 128-wide K block on tensor cores and adds
  the scaled block sums in a second fp32 accumulator; the summation order differs, so the
  last bits before the bf16 rounding can differ from a real TileLang run.
* sparse_attn: the kernel's online softmax: chunks of 64 index entries in list order,
  running max, ``P`` rounded to bf16 for the P.V product, sink in the denominator only.
  Dot products are cuBLAS fp32 sums of bf16 products and exp is torch's expf.
* hc_split_sinkhorn: the kernel's formula, fp32.
* hadamard_transform: ``bf16(f32(scale) * (H . f32(x)))`` with the Sylvester matrix H
  (the library's own reference is F.linear with scipy.linalg.hadamard); one fp32 GEMM.
"""

import types

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
FP4_MAX = 6.0
# Python floats 1/448 and 1/6 become fp32 constants inside the TileLang kernels.
FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32).item()
FP4_MAX_INV = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32).item()
CHUNK = 64  # sparse_attn_kernel: block = 64 index entries per iteration

# E2M1 magnitudes by 3-bit code; midpoints between neighbouring codes.
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _f32_const(v, like):
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def ceil2_bits(t: torch.Tensor) -> torch.Tensor:
    """fast_round_scale of the kernel: 2^(e - 127 + [m != 0]) from the fp32 bits of t (t > 0, normal)."""
    assert t.dtype == torch.float32
    bits = t.view(torch.int32)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    ex = e - 127 + (m != 0).to(torch.int32)
    return ((ex + 127) << 23).view(torch.float32)


def e8m0_to_f32(s: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale (float8_e8m0fnu or fp32) to fp32; byte b means 2^(b-127)."""
    if s.dtype == torch.float32:
        return s
    assert s.dtype == torch.float8_e8m0fnu, s.dtype
    b = s.view(torch.uint8).to(torch.int32)
    assert bool((b > 0).all()) and bool((b < 255).all()), "e8m0 scale outside the normal range"
    return (b << 23).view(torch.float32)


def f32_to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scale to float8_e8m0fnu (exact: the byte is the fp32 exponent field)."""
    bits = s.view(torch.int32)
    assert bool(((bits & 0x7FFFFF) == 0).all()), "scale is not a power of two"
    return ((bits >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def _block_scale(z: torch.Tensor, floor: float, inv: float, round_scale: bool) -> torch.Tensor:
    """amax per block (last dim), floored, times f32(1/max), optionally rounded up to 2^k."""
    amax = z.abs().amax(dim=-1, keepdim=True).clamp_min(floor)
    t = amax * _f32_const(inv, z)
    return ceil2_bits(t) if round_scale else t


def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    """act_quant_kernel: block-wise FP8 E4M3 quantisation along the last dim.

    s = ceil2(f32(max(amax, 1e-4) * f32(1/448))) when scale_fmt is set (UE8M0), else the
    plain product; q = E4M3_RNE(clamp(x / s, +-448)). inplace=True writes
    bf16(f32(q) * s) back into x (the fake quantisation FQ8 of the spec) and returns x;
    otherwise returns (q as float8_e4m3fn, s as scale_dtype).
    """
    N = x.size(-1)
    assert N % block_size == 0
    z = x.contiguous().float().unflatten(-1, (N // block_size, block_size))
    s = _block_scale(z, 1e-4, FP8_MAX_INV, scale_fmt is not None)
    q = (z / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if inplace:
        y = (q.float() * s).to(x.dtype).flatten(-2)
        x.copy_(y)
        return x
    s = s.squeeze(-1)
    s = f32_to_e8m0(s) if scale_dtype == torch.float8_e8m0fnu else s
    return q.flatten(-2), s


def _e2m1_rne(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 v (already clamped to +-6) to the E2M1 grid, ties to the even code; sign kept."""
    a = v.abs()
    mids = torch.tensor(_E2M1_MIDS, dtype=torch.float32, device=v.device)
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=v.device)
    code = (a.unsqueeze(-1) > mids).sum(-1)  # ties fall to the lower code here
    tie = a.unsqueeze(-1) == mids
    tie_code = torch.argmax(tie.to(torch.int32), dim=-1)
    odd_tie = tie.any(-1) & (tie_code % 2 == 1)
    code = torch.where(odd_tie, tie_code + 1, code)
    return torch.copysign(grid[code], v)


def fp4_act_quant(x, block_size=32, inplace=False):
    """fp4_quant_kernel: block-wise FP4 E2M1 quantisation, UE8M0 scale.

    s = ceil2(f32(max(amax, 6*2^-126) * f32(1/6))); q = E2M1_RNE(clamp(x / s, +-6)).
    inplace=True writes bf16(q * s) into x (FQ4 of the spec); otherwise returns packed
    float4_e2m1fn_x2 codes (low nibble = even element) and float8_e8m0fnu scales.
    """
    N = x.size(-1)
    assert N % block_size == 0
    z = x.contiguous().float().unflatten(-1, (N // block_size, block_size))
    s = _block_scale(z, FP4_MAX * 2.0 ** -126, FP4_MAX_INV, True)
    q = _e2m1_rne((z / s).clamp(-FP4_MAX, FP4_MAX))
    if inplace:
        x.copy_((q * s).to(x.dtype).flatten(-2))
        return x
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=x.device)
    mag = (q.abs().unsqueeze(-1) == grid).to(torch.int32).argmax(-1)
    code = (mag | (torch.signbit(q).to(torch.int32) << 3)).flatten(-2)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.float4_e2m1fn_x2), f32_to_e8m0(s.squeeze(-1))


def _dequant_fp8_weight(b, b_s):
    """[N, K] E4M3 weight times its 128x128 block scales, exact in fp32."""
    N, K = b.shape
    s = e8m0_to_f32(b_s)
    s = s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return b.float() * s


def _gemm_bf16_out(a32, b32):
    c = a32 @ b32.t()  # fp32 GEMM; TF32 is disabled by the driver
    return c.to(torch.get_default_dtype())


def fp8_gemm(a, a_s, b, b_s, scale_dtype=torch.float32):
    """fp8_gemm_kernel: C = (A * s_a) . (B * s_b)^T, fp32 accumulation, bf16 out.

    A [M, K] E4M3 with one scale per 128 columns, B [N, K] E4M3 with 128x128 block scales.
    """
    K = a.size(-1)
    A = a.reshape(-1, K).float() * e8m0_to_f32(a_s).reshape(-1, K // 128).repeat_interleave(128, 1)
    c = _gemm_bf16_out(A, _dequant_fp8_weight(b, b_s))
    return c.view(*a.shape[:-1], b.size(0))


def fp4_weight_to_f32(b, b_s):
    """[N, K/2] packed E2M1 (low nibble = even column) times per-32 UE8M0 scales -> fp32 [N, K]."""
    u = b.view(torch.uint8).to(torch.int32)
    codes = torch.stack([u & 0xF, u >> 4], dim=-1).flatten(-2)
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=b.device)
    val = grid[codes & 7]
    val = torch.where((codes & 8) != 0, -val, val)
    return val * e8m0_to_f32(b_s).repeat_interleave(32, 1)


def fp4_gemm(a, a_s, b, b_s, scale_dtype=torch.float32):
    """fp4_gemm_kernel: FP8 activation (per-128 scale) times FP4 weight (per-32 scale), bf16 out."""
    K = a.size(-1)
    A = a.reshape(-1, K).float() * e8m0_to_f32(a_s).reshape(-1, K // 128).repeat_interleave(128, 1)
    c = _gemm_bf16_out(A, fp4_weight_to_f32(b, b_s))
    return c.view(*a.shape[:-1], b.size(0))


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    """sparse_attn_kernel: attention of each query over the cache rows its index list names.

    q [b, m, h, d] bf16, kv [b, n, d] bf16 (K doubles as V), attn_sink [h] fp32,
    topk_idxs [b, m, L] int32 (-1 = no key). Per chunk of 64 entries, in list order:
      l_i = scale * (q . K_i)  (fp32; -inf for -1 entries, whose K row reads as 0)
      m' = max(m, max_i l_i); alpha = exp(m - m'); P_i = exp(l_i - m')
      sum = sum * alpha + sum_i P_i;  O = O * alpha + sum_i bf16(P_i) * K_i
    then sum += exp(sink - m); o = bf16(O / sum).
    """
    b, m, h, d = q.shape
    L = topk_idxs.size(-1)
    scale = torch.tensor(softmax_scale, dtype=torch.float32).item()
    qf = q.float()
    acc_o = torch.zeros(b, m, h, d, dtype=torch.float32, device=q.device)
    sum_exp = torch.zeros(b, m, h, dtype=torch.float32, device=q.device)
    s_max = torch.full((b, m, h), float("-inf"), dtype=torch.float32, device=q.device)
    n_chunks = (L + CHUNK - 1) // CHUNK
    pad = n_chunks * CHUNK - L
    idx_all = F.pad(topk_idxs.long(), (0, pad), value=-1)
    bi = torch.arange(b, device=q.device).view(b, 1, 1)
    for t in range(n_chunks):
        idx = idx_all[..., t * CHUNK:(t + 1) * CHUNK]                  # [b, m, 64]
        valid = idx != -1
        rows = kv[bi, idx.clamp_min(0)]                                 # [b, m, 64, d] bf16
        rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros_like(rows))
        rf = rows.float()
        acc_s = torch.einsum("bmhd,bmkd->bmhk", qf, rf)
        acc_s = torch.where(valid.unsqueeze(2), acc_s, torch.full_like(acc_s, float("-inf")))
        acc_s = acc_s * scale
        prev = s_max
        s_max = torch.maximum(prev, acc_s.amax(-1))
        alpha = torch.exp(prev - s_max)
        p = torch.exp(acc_s - s_max.unsqueeze(-1))
        sum_exp = sum_exp * alpha + p.sum(-1)
        p_bf = p.to(torch.bfloat16).float()
        acc_o = acc_o * alpha.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p_bf, rf)
    sum_exp = sum_exp + torch.exp(attn_sink.float().view(1, 1, h) - s_max)
    return (acc_o / sum_exp.unsqueeze(-1)).to(torch.bfloat16)


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """hc_split_sinkhorn_kernel: mHC pre/post weights and the Sinkhorn-normalised comb matrix."""
    hc = hc_mult
    pre = torch.sigmoid(mixes[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc])
    comb = mixes[..., 2 * hc:].unflatten(-1, (hc, hc)) * hc_scale[2] + hc_base[2 * hc:].view(hc, hc)
    comb = torch.exp(comb - comb.amax(-1, keepdim=True))
    comb = comb / comb.sum(-1, keepdim=True) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def sylvester(n, device=None):
    """Sylvester-order Hadamard matrix H[i][j] = (-1)^popcount(i & j), fp32."""
    i = torch.arange(n, device=device)
    x = i.view(-1, 1) & i.view(1, -1)
    pop = torch.zeros_like(x)
    while bool((x != 0).any()):
        pop += x & 1
        x = x >> 1
    return (1 - 2 * (pop & 1)).to(torch.float32)


def hadamard_transform(x, scale=1.0):
    """fast_hadamard_transform.hadamard_transform: bf16(f32(scale) * (H . f32(x))) along the last dim."""
    n = x.size(-1)
    H = sylvester(n, x.device)
    y = F.linear(x.float(), H) * torch.tensor(scale, dtype=torch.float32).item()
    return y.to(x.dtype)


def hadamard_module():
    """A module object standing in for the fast_hadamard_transform package."""
    mod = types.ModuleType("fast_hadamard_transform")
    mod.hadamard_transform = hadamard_transform
    return mod


def selftest():
    """Check the port against independent implementations (numpy + ml_dtypes, fp64); returns a summary.

    Raises AssertionError when a bit-exact part disagrees.
    """
    import numpy as np
    import ml_dtypes

    dev = "cuda"
    g = torch.Generator(device="cpu").manual_seed(1)

    def rn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32, device="cpu")

    lines = []

    def f32_bits_ceil2(t):
        b = np.asarray(t, dtype=np.float32).view(np.uint32)
        e = (b >> 23) & 0xFF
        m = b & 0x7FFFFF
        ex = e.astype(np.int64) - 127 + (m != 0)
        return np.ldexp(np.float32(1), ex).astype(np.float32)

    # FQ8 (act_quant inplace, 64-blocks): values spanning many magnitudes, exact-power blocks, zeros.
    x = rn(64, 448) * torch.exp2(torch.randint(-20, 12, (64, 1), generator=g, device="cpu").float())
    x[0] = 0
    x[1, :64] = 448.0
    x[2, :64] = 2.0 ** -10
    xb = x.to(torch.bfloat16)
    got = act_quant(xb.clone().to(dev), 64, "ue8m0", torch.float8_e8m0fnu, True).cpu()
    z = xb.float().numpy().reshape(64, 7, 64)
    amax = np.maximum(np.abs(z).max(-1, keepdims=True), np.float32(1e-4))
    s = f32_bits_ceil2(amax * np.float32(1.0 / 448.0))
    q = np.clip(z / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ref = (q * s).astype(ml_dtypes.bfloat16).reshape(64, 448)
    ok = np.array_equal(got.view(torch.int16).numpy(), ref.view(np.int16))
    assert ok, "act_quant inplace differs from numpy/ml_dtypes FQ8"
    lines.append("FQ8 bit-exact vs ml_dtypes")

    # FQ4 (fp4_act_quant inplace, 32-blocks) incl. exact midpoints of the E2M1 grid.
    x = rn(64, 128) * torch.exp2(torch.randint(-8, 8, (64, 1), generator=g, device="cpu").float())
    x[3] = 0  # one block whose scale is exactly 1: the midpoints below are exact ties
    mids = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5]
    x[3, :16] = torch.tensor(mids + [-v for v in mids], dtype=torch.float32, device="cpu")
    xb = x.to(torch.bfloat16)
    got = fp4_act_quant(xb.clone().to(dev), 32, True).cpu()
    z = xb.float().numpy().reshape(64, 4, 32)
    amax = np.maximum(np.abs(z).max(-1, keepdims=True), np.float32(6 * 2.0 ** -126))
    s = f32_bits_ceil2(amax * np.float32(1.0 / 6.0))
    if hasattr(ml_dtypes, "float4_e2m1fn"):
        q = np.clip(z / s, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
        ref = (q * s).astype(ml_dtypes.bfloat16).reshape(64, 128)
        ok = np.array_equal(got.view(torch.int16).numpy(), ref.view(np.int16))
        assert ok, "fp4_act_quant inplace differs from numpy/ml_dtypes FQ4"
        lines.append("FQ4 bit-exact vs ml_dtypes")
    else:
        lines.append("FQ4 not checked (ml_dtypes has no float4_e2m1fn)")

    # fp8_gemm vs fp64 product of the dequantised operands.
    a = rn(3, 256).to(torch.bfloat16).to(dev)
    w = (rn(384, 256) * 0.05).to(dev)
    ws = ceil2_bits(w.view(3, 128, 2, 128).abs().amax((1, 3)) * FP8_MAX_INV)
    wq = (w.view(3, 128, 2, 128) / ws.view(3, 1, 2, 1)).clamp(-448, 448).view(384, 256).to(torch.float8_e4m3fn)
    ws8 = f32_to_e8m0(ws)
    aq, as_ = act_quant(a, 128, "ue8m0", torch.float8_e8m0fnu)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    c = fp8_gemm(aq, as_, wq, ws8, torch.float8_e8m0fnu).double()
    torch.set_default_dtype(prev)
    a_deq = aq.float().double() * e8m0_to_f32(as_).double().repeat_interleave(128, 1)
    ref = a_deq @ _dequant_fp8_weight(wq, ws8).double().t()
    err = ((c - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()
    assert err < 2 ** -7, f"fp8_gemm relative error {err}"
    lines.append(f"fp8_gemm max rel err vs fp64 {err:.2e} (bf16 output)")

    # sparse_attn vs a direct fp64 softmax with the sink in the denominator.
    h, d, n, L = 4, 512, 300, 150
    q = rn(1, 2, h, d).to(torch.bfloat16).to(dev)
    kv = rn(1, n, d).to(torch.bfloat16).to(dev)
    sink = rn(h).to(dev)
    idx = torch.randint(0, n, (1, 2, L), generator=g, dtype=torch.int32, device="cpu")
    idx[0, 0, 100:] = -1
    idx = idx.to(dev)
    o = sparse_attn(q, kv, sink, idx, d ** -0.5).double()
    worst = 0.0
    for mi in range(2):
        sel = idx[0, mi][idx[0, mi] >= 0].long()
        K = kv[0, sel].double()
        logit = (q[0, mi].double() @ K.t()) * d ** -0.5
        mx = logit.amax(-1, keepdim=True)
        p = torch.exp(logit - mx)
        den = p.sum(-1, keepdim=True) + torch.exp(sink.double().view(h, 1) - mx)
        ref = (p @ K) / den
        worst = max(worst, ((o[0, mi] - ref).abs().max() / ref.abs().max()).item())
    assert worst < 2 ** -6, f"sparse_attn error {worst}"
    lines.append(f"sparse_attn max err vs fp64 softmax {worst:.2e} (of max |o|)")

    # Hadamard: H H = n I and the transform is orthonormal with scale n^-0.5.
    H = sylvester(128, dev)
    assert torch.equal(H @ H, 128 * torch.eye(128, dtype=torch.float32, device=dev))
    lines.append("Sylvester H.H = 128 I")
    return "; ".join(lines)
