#!/usr/bin/env python3
"""Golden vectors for the Go package sparsemla/quant, computed by PyTorch on CUDA.

Run on a machine with a CUDA GPU (made on an H200, torch 2.11):

    python3 capture/golden/quant_golden.py --out testdata/quant/golden.bin.gz

Every input is built here from fixed seeds and hand-picked edge cases; every
output is what torch on the GPU returns for it. The Go test
quant/golden_test.go reads the file and compares every value bit for bit.

What is recorded (all integers little-endian; floats as their bit patterns):

  meta                  u8   text: torch/CUDA versions, device, seeds
  cast/in               u32  fp32 inputs of the casts (edge cases + random)
  cast/bf16             u16  x.to(torch.bfloat16)
  cast/f16              u16  x.to(torch.float16)
  cast/e4m3fn           u8   x.to(torch.float8_e4m3fn)
  cast/e5m2             u8   x.to(torch.float8_e5m2)
  cast/e8m0fnu          u8   x.to(torch.float8_e8m0fnu)
  decode/<fmt>          u32  every code of <fmt> (e4m3fn, e5m2, e8m0fnu: 256;
                             f16, bf16: 65536) widened with .float()
  fq8/in, fq8/out       u16  bf16 rows of 64 -> FQ8(v, 64), spec section 3.3
  qfp8/codes, /scales   u8   the same rows as real E4M3 codes + UE8M0 bytes
  act/codes, act/scales u8,u32  the same data as rows of 128: activation
                             quantiser codes and fp32 block scales (3.2)
  fq4/in, fq4/out       u16  bf16 rows of 32 -> FQ4(v, 32), spec section 3.4
  qfp4/packed, /scales  u8   the same rows as packed E2M1 codes + UE8M0 bytes
  had/in                u16  bf16 128-vectors
  had/linear            u16  bf16(F.linear(x.float(), H) * f32(128**-0.5))
  had/butterfly         u16  the same with the fp32 butterfly, stage h = 1 first
  wdq/codes, wdq/scale, wdq/scale_inv, wdq/out, wdq/out_inv
                             FP8 weight [130, 260] dequantised with UE8M0 and
                             with fp32 128x128 block scales
  scale/amax            u32  block absolute maxima
  scale/<rule>_<q>      u16  int16 exponents x of the block scale 2^x, for rule
                             in ceil2, log2ceil, flashmla, roundlog2 and
                             q in e4m3 (qmax 448, floor 1e-4), e2m1 (qmax 6,
                             floor 6*2^-126)

FP4 rounding has no torch cast on CUDA (torch 2.11 cannot cast to
float4_e2m1fn_x2), so E2M1 is written here with comparisons against the
rounding thresholds of the spec (ties to the even code).

File format (then gzip): magic b"SMQGOLD\\x01", u32 record count, then per
record: u16 name length, name (ASCII), u8 element size (1, 2 or 4), u32 element
count, data.
"""

import argparse
import gzip
import struct
import sys

import numpy as np
import torch

SEED = 20260424
MAGIC = b"SMQGOLD\x01"


def dev():
    if not torch.cuda.is_available():
        sys.exit("quant_golden: needs a CUDA device")
    return torch.device("cuda")


D = None  # set in main


def f32_from_bits(b):
    return np.asarray(b, dtype=np.uint32).view(np.float32)


def bits_of_f32(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def to_gpu_f32(bits_u32):
    return torch.from_numpy(np.ascontiguousarray(bits_u32, dtype=np.uint32).view(np.int32)).to(D).view(torch.float32)


def to_gpu_bf16(bits_u16):
    return torch.from_numpy(np.ascontiguousarray(bits_u16, dtype=np.uint16).view(np.int16)).to(D).view(torch.bfloat16)


def u8(t):
    return t.contiguous().view(torch.uint8).cpu().numpy().copy()


def u16(t):
    return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16).copy()


def u32(t):
    return t.contiguous().view(torch.int32).cpu().numpy().view(np.uint32).copy()


# ---------------------------------------------------------------- inputs


def cast_inputs(rng):
    v = []
    # zeros, infinities, NaNs with payloads and both signs
    v += [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
          0xFF800001, 0x7FA00000, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC12345, 0xFFF0F0F0,
          0x7FE00000, 0x7F801234, 0xFF812345]
    # fp32 subnormals, smallest/largest normals, bf16/fp32 top edge
    edge = [0x00000001, 0x00000002, 0x003FFFFF, 0x00400000, 0x00400001, 0x007FFFFF, 0x00800000,
            0x00800001, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F7F8001, 0x7F7EFFFF, 0x7F7E8000,
            0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF]
    v += edge + [b | 0x80000000 for b in edge]

    # bf16 halfway points: for a sample of bf16 codes h, the fp32 value halfway to h+1 and its
    # fp32 neighbours (odd stride: both even and odd h)
    for h in range(0, 0x7F80, 13):
        m = (h << 16) | 0x8000
        for b in (m - 1, m, m + 1, h << 16):
            v += [b, b | 0x80000000]

    # fp16 halfway points (0x7BFF's upper neighbour is 65536, where fp16 overflows)
    def f16val(c):
        return float(np.array(c, dtype=np.uint16).view(np.float16))

    for c in list(range(0, 0x7C00, 23)) + [0, 1, 2, 0x3FF, 0x400, 0x7BFE, 0x7BFF]:
        lo = f16val(c)
        hi = f16val(c + 1) if c + 1 < 0x7C00 else 65536.0
        m = int(bits_of_f32((lo + hi) / 2))
        for b in (m - 1, m, m + 1, int(bits_of_f32(lo))):
            v += [b, b | 0x80000000]

    # FP8 grids: every code, halfway to the next code, and the fp32 neighbours of that
    def minifloat_values(m_bits, bias, n_codes):
        out = []
        for c in range(n_codes):
            e, man = c >> m_bits, c & ((1 << m_bits) - 1)
            if e == 0:
                out.append(man * 2.0 ** (1 - bias - m_bits))
            else:
                out.append((man + (1 << m_bits)) * 2.0 ** (e - bias - m_bits))
        return out

    for vals, top in ((minifloat_values(3, 7, 0x7F), 480.0),      # E4M3FN: 0..0x7E, then 480 = NaN
                      (minifloat_values(2, 15, 0x7C), 65536.0)):  # E5M2: 0..0x7B, then inf
        nxt = vals[1:] + [top]
        for lo, hi in zip(vals, nxt):
            m = int(bits_of_f32((lo + hi) / 2))
            for b in (m - 1, m, m + 1, int(bits_of_f32(lo))):
                v += [b, b | 0x80000000]
    for x in (448.0, 449.0, 463.9, 464.0, 465.0, 479.0, 480.0, 481.0, 1e4, 57344.0, 61439.0, 61440.0,
              65535.0, 65536.0, 1e6, 1e30, 2.0 ** -10, 2.0 ** -17, 2.0 ** -16, 1.5 * 2.0 ** -17):
        b = int(bits_of_f32(x))
        v += [b, b | 0x80000000]

    # E8M0: per fp32 exponent E (0 = fp32 subnormal), mantissas around the linear halfway 1.5,
    # the geometric halfway sqrt(2), and the ends
    mants = [0, 1, 0x3FFFFF, 0x400000, 0x400001, 0x3504F3, 0x7FFFFF]
    for E in range(0, 255):
        for m in mants:
            b = (E << 23) | m
            v.append(b)
            if E % 5 == 0:
                v.append(b | 0x80000000)

    # random: raw bit patterns (NaNs included), wide log-uniform, and values in the FP8 range
    v += list(rng.integers(0, 2 ** 32, size=8000, dtype=np.uint64).astype(np.uint32))
    mag = rng.uniform(1, 2, size=8000) * 2.0 ** rng.integers(-150, 128, size=8000)
    sgn = rng.choice([-1.0, 1.0], size=8000)
    v += list(bits_of_f32((sgn * mag).astype(np.float32)))
    w = rng.standard_normal(6000) * 2.0 ** rng.uniform(-12, 9, size=6000)
    v += list(bits_of_f32(w.astype(np.float32)))
    return np.array([int(b) & 0xFFFFFFFF for b in v], dtype=np.uint32)


def bf16_bits_rne(x):
    """fp32 -> bf16 bits, RNE, for finite x (numpy, used only to build inputs)."""
    b = bits_of_f32(np.asarray(x, dtype=np.float32)).astype(np.uint64)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).astype(np.uint16)


def fq8_inputs(rng):
    rows = []
    # random rows with a random per-row scale
    for _ in range(160):
        rows.append(rng.standard_normal(64) * 2.0 ** rng.uniform(-20, 20))
    # rows whose |max| sits on and next to 448 * 2^k (bf16 448 = 0x43E0), where ceil2 flips
    for k in range(-36, 37, 4):
        for j in (-2, -1, 0, 1, 2):
            r = rng.uniform(-1, 1, 64) * 400 * 2.0 ** k
            amax = float(np.array(((0x43E0 + j + (k << 7)) << 16), dtype=np.uint32).view(np.float32))
            r[rng.integers(0, 64)] = amax * rng.choice([-1, 1])
            rows.append(r)
    # rows whose scaled values sit exactly on E4M3 halfway points (s = 2^k, amax = 448 * 2^k)
    e4 = []
    for c in range(0x7E):
        e, man = c >> 3, c & 7
        lo = man * 2.0 ** -9 if e == 0 else (man + 8) * 2.0 ** (e - 10)
        c1 = c + 1
        e, man = c1 >> 3, c1 & 7
        hi = man * 2.0 ** -9 if e == 0 else (man + 8) * 2.0 ** (e - 10)
        e4.append((lo + hi) / 2)
    e4 = np.array(e4)
    for k in (-8, 0, 5):
        for start in range(0, len(e4), 62):
            seg = e4[start:start + 62]
            r = np.zeros(64)
            r[0] = 448 * 2.0 ** k
            r[1:1 + len(seg)] = seg * 2.0 ** k * rng.choice([-1, 1], size=len(seg))
            rows.append(r)
    # near-zero rows: zeros, -0, below the 1e-4 floor, on it, bf16 subnormals
    rows.append(np.zeros(64))
    rows.append(-np.zeros(64))
    for a in (1e-7, 5e-5, 9.99e-5, 1e-4, 1.0001e-4, 2e-4, 1e-38, 1e-40):
        rows.append(rng.uniform(-1, 1, 64) * a)
    # huge rows near the bf16 maximum
    rows.append(rng.uniform(-1, 1, 64) * 3.38e38)
    rows.append(rng.uniform(-1, 1, 64) * 1e30)
    while len(rows) % 2:  # even count: the same data is also read as rows of 128
        rows.append(rng.standard_normal(64))
    x = np.array(rows, dtype=np.float64).astype(np.float32)
    bits = bf16_bits_rne(x)
    # a few explicit signed zeros inside random rows
    bits[0, 3] = 0x8000
    bits[1, 5] = 0x0000
    return bits


def fq4_inputs(rng):
    rows = []
    for _ in range(300):
        rows.append(rng.standard_normal(32) * 2.0 ** rng.uniform(-20, 20))
    # |max| on and next to 6 * 2^k (bf16 6 = 0x40C0)
    for k in range(-40, 41, 4):
        for j in (-2, -1, 0, 1, 2):
            r = rng.uniform(-1, 1, 32) * 5 * 2.0 ** k
            amax = float(np.array(((0x40C0 + j + (k << 7)) << 16), dtype=np.uint32).view(np.float32))
            r[rng.integers(0, 32)] = amax * rng.choice([-1, 1])
            rows.append(r)
    # scaled values on the E2M1 halfway points and one bf16 ulp either side (s = 2^k)
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    for k in (-10, 0, 7):
        vals = []
        for m in mids:
            hb = int(bf16_bits_rne(np.float32(m)))
            for d in (-1, 0, 1):
                vals.append(float(np.array((hb + d) << 16, dtype=np.uint32).view(np.float32)))
        vals = np.array(vals)
        r = np.zeros(32)
        r[0] = 6 * 2.0 ** k
        r[1:1 + len(vals)] = vals * 2.0 ** k
        rows.append(r)
        r2 = r.copy()
        r2[1:1 + len(vals)] *= -1
        rows.append(r2)
    # grid values themselves, both signs
    for k in (-3, 0, 4):
        r = np.zeros(32)
        g = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
        r[:8], r[8:16], r[16:24] = g, -g, g * 0.9
        r[24:] = rng.uniform(-6, 6, 8)
        rows.append(r * 2.0 ** k)
    rows.append(np.zeros(32))
    rows.append(-np.zeros(32))
    for a in (1e-30, 1e-37, 3e-38, 1e-39, 1e-40, 3.38e38):
        rows.append(rng.uniform(-1, 1, 32) * a)
    while len(rows) % 4:
        rows.append(rng.standard_normal(32))
    x = np.array(rows, dtype=np.float64).astype(np.float32)
    bits = bf16_bits_rne(x)
    bits[0, 7] = 0x8000
    return bits


def had_inputs(rng):
    vs = []
    for _ in range(128):
        vs.append(rng.standard_normal(128))
    for _ in range(64):
        vs.append(rng.standard_normal(128) * 2.0 ** rng.uniform(-12, 12, 128))
    for _ in range(32):
        v = rng.standard_normal(128)
        v[rng.integers(0, 128, 4)] *= 100
        vs.append(v)
    for i in range(8):
        v = np.zeros(128)
        v[i * 13 % 128] = 1.0
        vs.append(v)
    vs.append(np.ones(128))
    vs.append(np.array([(-1.0) ** i for i in range(128)]))
    vs.append(np.zeros(128))
    vs.append(-np.zeros(128))
    vs.append(rng.standard_normal(128) * 2.0 ** 100)
    vs.append(rng.standard_normal(128) * 2.0 ** -100)
    vs.append(rng.standard_normal(128) * 1e-39)
    while len(vs) < 256:
        vs.append(rng.uniform(-1, 1, 128) * 2.0 ** rng.uniform(-30, 30))
    return bf16_bits_rne(np.array(vs, dtype=np.float64).astype(np.float32))


# ---------------------------------------------------------------- torch formulas on the GPU


def ceil2_exp(t):
    """Spec ceil2 exponent from fp32 bits (R-K fast_log2_ceil): e - 127 + [m != 0]."""
    b = t.view(torch.int32)
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    return e - 127 + (m != 0).to(torch.int32)


def pow2(x):
    """R-K fast_pow2: the fp32 with bits (x + 127) << 23."""
    return ((x + 127) << 23).to(torch.int32).view(torch.float32)


INV448 = None
INV6 = None


def fq8_torch(xb, B):
    """xb bf16 [R, B] -> (bf16 FQ8 output, e4m3 codes, s fp32 [R, 1])."""
    xf = xb.float()
    a = torch.maximum(xf.abs().amax(dim=-1, keepdim=True), torch.tensor(1e-4, dtype=torch.float32, device=D))
    s = pow2(ceil2_exp(a * INV448))
    q = (xf / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    out = (q.float() * s).to(torch.bfloat16)
    return out, q, s


def e2m1_code(v):
    """|v| <= 6 fp32 -> E2M1 code (sign in bit 3), RNE with ties to the even code."""
    a = v.abs()
    c = ((a > 0.25).to(torch.int32) + (a >= 0.75).to(torch.int32) + (a > 1.25).to(torch.int32)
         + (a >= 1.75).to(torch.int32) + (a > 2.5).to(torch.int32) + (a >= 3.5).to(torch.int32)
         + (a > 5.0).to(torch.int32))
    neg = torch.signbit(v).to(torch.int32)
    return c | (neg << 3)


E2M1_GRID = None


def fq4_torch(xb, B):
    xf = xb.float()
    floor = torch.tensor(6 * 2.0 ** -126, dtype=torch.float32, device=D)
    a = torch.maximum(xf.abs().amax(dim=-1, keepdim=True), floor)
    s = pow2(ceil2_exp(a * INV6))
    v = (xf / s).clamp(-6.0, 6.0)
    code = e2m1_code(v)
    val = torch.copysign(E2M1_GRID[(code & 7).long()], v)
    out = (val * s).to(torch.bfloat16)
    return out, code, s


def hadamard_matrix(n):
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(D)


def butterfly(x):
    n = x.shape[-1]
    r = x.shape[0]
    h = 1
    while h < n:
        y = x.view(r, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        x = torch.stack((a + b, a - b), dim=2).reshape(r, n)
        h *= 2
    return x


def scale_rules(amax, qmax, floor):
    f = torch.tensor(floor, dtype=torch.float32, device=D)
    inv = torch.tensor(1.0 / qmax, dtype=torch.float32, device=D)
    q = torch.tensor(qmax, dtype=torch.float32, device=D)
    out = {}
    out["ceil2"] = ceil2_exp(torch.maximum(amax, f) * inv)
    out["log2ceil"] = torch.ceil(torch.log2(torch.maximum(amax, f) / q)).to(torch.int32)
    out["flashmla"] = torch.ceil(torch.log2(torch.maximum(amax / q, f))).to(torch.int32)
    out["roundlog2"] = torch.round(torch.log2(torch.maximum(amax, f) / q)).to(torch.int32)
    return {k: v.to(torch.int16) for k, v in out.items()}


def scale_amax(rng):
    a = []
    for base in (448.0, 6.0):
        bb = int(bits_of_f32(base))
        for k in range(-40, 41):
            for j in (-2, -1, 0, 1, 2):
                a.append(bb + (k << 23) + j)
    for x in (0.0, 1e-4, 1e-5, 6 * 2.0 ** -126, 2.0 ** -126, 1e-45, 1e-40, 3.4e38, 1.0, 2.0, 0.5):
        b = int(bits_of_f32(x))
        a += [b - 1 if b else 0, b, b + 1]
    a += list(bits_of_f32((rng.uniform(1, 2, 2000) * 2.0 ** rng.integers(-140, 127, 2000)).astype(np.float32)))
    return np.array([int(b) & 0xFFFFFFFF for b in a], dtype=np.uint32)


# ---------------------------------------------------------------- main


def main():
    global D, INV448, INV6, E2M1_GRID
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="testdata/quant/golden.bin.gz")
    args = ap.parse_args()
    D = dev()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    INV448 = torch.tensor(1.0 / 448, dtype=torch.float32, device=D)
    INV6 = torch.tensor(1.0 / 6, dtype=torch.float32, device=D)
    E2M1_GRID = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32, device=D)
    rng = np.random.default_rng(SEED)
    rec = []

    def add(name, arr):
        rec.append((name, np.ascontiguousarray(arr)))

    meta = (f"torch {torch.__version__}; cuda {torch.version.cuda}; device {torch.cuda.get_device_name(0)}; "
            f"numpy {np.__version__}; seed {SEED}; allow_tf32 {torch.backends.cuda.matmul.allow_tf32}")
    add("meta", np.frombuffer(meta.encode(), dtype=np.uint8))
    print(meta)

    # casts
    xin = cast_inputs(rng)
    x = to_gpu_f32(xin)
    add("cast/in", xin)
    add("cast/bf16", u16(x.to(torch.bfloat16)))
    add("cast/f16", u16(x.to(torch.float16)))
    add("cast/e4m3fn", u8(x.to(torch.float8_e4m3fn)))
    add("cast/e5m2", u8(x.to(torch.float8_e5m2)))
    add("cast/e8m0fnu", u8(x.to(torch.float8_e8m0fnu)))
    xc = x.cpu()
    for name, dt, f in (("bf16", torch.bfloat16, u16), ("f16", torch.float16, u16), ("e4m3fn", torch.float8_e4m3fn, u8),
                        ("e5m2", torch.float8_e5m2, u8), ("e8m0fnu", torch.float8_e8m0fnu, u8)):
        g = dict(rec)["cast/" + name]
        try:
            c = f(xc.to(dt))
        except Exception as e:  # a cast the CPU build lacks
            print(f"cast {name}: CPU cast failed: {e}")
            continue
        diff = np.nonzero(g != c)[0]
        print(f"cast {name}: {len(xin)} inputs, GPU vs CPU differ at {len(diff)}",
              [(hex(int(xin[i])), hex(int(g[i])), hex(int(c[i]))) for i in diff[:6]])

    # decodes
    codes8 = torch.arange(256, dtype=torch.int32, device=D).to(torch.uint8)
    add("decode/e4m3fn", u32(codes8.view(torch.float8_e4m3fn).float()))
    add("decode/e5m2", u32(codes8.view(torch.float8_e5m2).float()))
    add("decode/e8m0fnu", u32(codes8.view(torch.float8_e8m0fnu).float()))
    c16 = torch.from_numpy(np.arange(65536, dtype=np.uint16).view(np.int16)).to(D)
    add("decode/f16", u32(c16.view(torch.float16).float()))
    add("decode/bf16", u32(c16.view(torch.bfloat16).float()))

    # FQ8 and real FP8 block quantisation, blocks of 64
    fin = fq8_inputs(rng)
    xb = to_gpu_bf16(fin)
    out, q, s = fq8_torch(xb, 64)
    add("fq8/in", fin.reshape(-1))
    add("fq8/out", u16(out))
    add("qfp8/codes", u8(q))
    add("qfp8/scales", u8(s.to(torch.float8_e8m0fnu)))
    # activation quantiser, blocks of 128 (same data)
    _, qa, sa = fq8_torch(xb.reshape(-1, 128), 128)
    add("act/codes", u8(qa))
    add("act/scales", u32(sa))

    # FQ4 and real FP4 quantisation, blocks of 32
    fin4 = fq4_inputs(rng)
    xb4 = to_gpu_bf16(fin4)
    out4, code4, s4 = fq4_torch(xb4, 32)
    add("fq4/in", fin4.reshape(-1))
    add("fq4/out", u16(out4))
    c = code4.reshape(-1).to(torch.int32)
    packed = (c[0::2] | (c[1::2] << 4)).to(torch.uint8)
    add("qfp4/packed", u8(packed))
    add("qfp4/scales", u8(s4.to(torch.float8_e8m0fnu)))

    # Hadamard
    hin = had_inputs(rng)
    hx = to_gpu_bf16(hin).float()
    H = hadamard_matrix(128)
    sc = torch.tensor(128 ** -0.5, dtype=torch.float32, device=D)
    lin = (torch.nn.functional.linear(hx, H) * sc).to(torch.bfloat16)
    bfly = (butterfly(hx) * sc).to(torch.bfloat16)
    exact = (torch.nn.functional.linear(hx.double(), H.double()) * (128 ** -0.5)).float().to(torch.bfloat16)
    add("had/in", hin.reshape(-1))
    add("had/linear", u16(lin))
    add("had/butterfly", u16(bfly))
    ex, li, bu = u16(exact), u16(lin), u16(bfly)
    print(f"hadamard: {ex.size} outputs; linear!=butterfly {int((li != bu).sum())}, "
          f"linear!=exact {int((li != ex).sum())}, butterfly!=exact {int((bu != ex).sum())}")

    # FP8 weight dequantisation
    rows, cols = 130, 260
    wcodes = rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
    wscale = np.array([[127, 0, 254], [120, 255, 140]], dtype=np.uint8)
    wsinv = (rng.uniform(1, 2, size=(2, 3)) * 2.0 ** rng.integers(-20, 2, size=(2, 3))).astype(np.float32)
    wsinv[1, 1] = 0.0
    wg = torch.from_numpy(wcodes).to(D).view(torch.float8_e4m3fn).float()
    sg = torch.from_numpy(wscale).to(D).view(torch.float8_e8m0fnu).float()
    sig = torch.from_numpy(wsinv).to(D)

    def expand(t):
        return t.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]

    add("wdq/codes", wcodes.reshape(-1))
    add("wdq/scale", wscale.reshape(-1))
    add("wdq/scale_inv", wsinv.view(np.uint32).reshape(-1))
    add("wdq/out", u32(wg * expand(sg)))
    add("wdq/out_inv", u32(wg * expand(sig)))

    # block scale rules
    amax = scale_amax(rng)
    add("scale/amax", amax)
    ag = to_gpu_f32(amax)
    for qn, qmax, floor in (("e4m3", 448.0, 1e-4), ("e2m1", 6.0, 6 * 2.0 ** -126)):
        for rule, e in scale_rules(ag, qmax, floor).items():
            add(f"scale/{rule}_{qn}", u16(e))

    # facts worth printing
    def show(name, vals, dt):
        t = torch.tensor(vals, dtype=torch.float32, device=D).to(dt)
        print(name, [hex(int(b)) for b in (u8(t) if t.element_size() == 1 else u16(t))])

    show("e8m0fnu of 1, 1.5, 1.4999999, sqrt2, 1.75, 0.75, -3, 0, 2^-127, 3e38:",
         [1.0, 1.5, 1.4999999, 2 ** 0.5, 1.75, 0.75, -3.0, 0.0, 2.0 ** -127, 3e38], torch.float8_e8m0fnu)
    show("e4m3fn of 464, 464.01, 480, inf, -inf, nan:", [464.0, 464.01, 480.0, float("inf"), -float("inf"), float("nan")],
         torch.float8_e4m3fn)

    with gzip.GzipFile(filename=args.out, mode="wb", compresslevel=9, mtime=0) as f:
        f.write(MAGIC)
        f.write(struct.pack("<I", len(rec)))
        for name, arr in rec:
            nb = name.encode()
            f.write(struct.pack("<H", len(nb)))
            f.write(nb)
            f.write(struct.pack("<BI", arr.dtype.itemsize, arr.size))
            f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    total = sum(a.nbytes for _, a in rec)
    print(f"wrote {args.out}: {len(rec)} records, {total} bytes before gzip")


if __name__ == "__main__":
    main()
