# Minimal stand-in for the official inference/kernel.py, so that the official
# model.py can be imported and its Compressor run on a GPU without TileLang.
# Only the two in-place fake quantisers the Compressor calls are implemented
# (spec dsv4-attention.md §3.3 and §3.4, post-fix kernel revision 60d8d707:
# the FP8 branch really rounds to E4M3). Written for sparsemla; not official code.
import torch


def _ceil2(t):
    # ceil2 from the fp32 bits, as fast_log2_ceil / fast_pow2 do.
    bits = t.float().contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.ldexp(torch.ones_like(t, dtype=torch.float32), e.float())


def act_quant(x, block_size, scale_fmt=None, scale_dtype=None, inplace=False):
    assert inplace, "stand-in kernel: only the in-place FQ8 branch is implemented"
    v = x.float().unflatten(-1, (-1, block_size))
    a = v.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    s = _ceil2(a * torch.tensor(1.0 / 448, dtype=torch.float32))
    q = (v / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    x.copy_(q.flatten(-2).to(x.dtype))
    return x


_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1(v):
    # round |v| <= 6 to the FP4 grid, ties to the even code
    grid = torch.tensor(_E2M1, device=v.device, dtype=torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    a = v.abs()
    i = torch.bucketize(a, mids)  # a == mids[k] gives k (the lower code)
    at_mid = (i < 7) & (a == mids[i.clamp(max=6)])
    i = torch.where(at_mid & (i % 2 == 1), i + 1, i)
    return torch.sign(v) * grid[i]


def fp4_act_quant(x, block_size, inplace=False):
    assert inplace, "stand-in kernel: only the in-place FQ4 branch is implemented"
    v = x.float().unflatten(-1, (-1, block_size))
    a = v.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0 ** -126)
    s = _ceil2(a * torch.tensor(1.0 / 6, dtype=torch.float32))
    q = _e2m1((v / s).clamp(-6, 6)) * s
    x.copy_(q.flatten(-2).to(x.dtype))
    return x


def _missing(*args, **kwargs):
    raise NotImplementedError("stand-in kernel: not needed by the Compressor")


fp8_gemm = fp4_gemm = sparse_attn = hc_split_sinkhorn = _missing
