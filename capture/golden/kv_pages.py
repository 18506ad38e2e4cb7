#!/usr/bin/env python3
"""Make KV-cache page goldens on a GPU with torch, for kvcache's codec tests.

Writes, under OUT (default $OUT or ./out):
  manifest.json            one record per case (layout, page size, rule, file names)
  <case>.rows.bf16         the input rows, bf16 little endian [n, dim]
  <case>.pages.bin         the quantised pages, exactly the bytes the GPU wrote
  <case>.decoded.bf16      the pages dequantised on the GPU, bf16 [n, dim]

The quantisers are written here from the semantics of FlashMLA tests/quant.py
(quantize_k_cache / dequantize_k_cache for MODEL1_FP8Sparse and V32_FP8Sparse) and
of vLLM's indexer cache writers (fused_compress_quant_cache.py, FP8 and MXFP4
branches; the RoPE/norm part of those kernels is left out: the rows given here
are the values to store). No code is copied from either project.

Scale rules (spec dsv4-attention.md §9.4; kvcache.Scaling in Go):
  flashmla : s = 2^ceil(log2(max(amax/448, 1e-4)))                  (FlashMLA test)
  ceil2    : s = ceil2(f32(max(amax, 1e-4) * f32(1/448))) from bits   (reference act_quant)
  log2ceil : s = 2^ceil(log2(max(amax, floor) / qmax))               (vLLM/SGLang form)

Inputs read from the repository: testdata/kvcache/model_kv_rows.bf16 (the
official model's FQ8 window/compressed rows, [36, 512]) and
testdata/kvcache/model_index_rows.bf16 (its FQ4 indexer keys, [4, 128]).

Pad bytes: FlashMLA allocates pages with torch.empty, so pad bytes are whatever
memory held. To make that visible and testable, cases with pad_fill 0x5A start
from a buffer filled with 0x5A; the Go decoder must report those bytes as
warnings and the page comparer must mask them.
"""
import json
import os
import sys

import torch

DEV = "cuda"
OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "out")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
E4M3, E8M0, BF16, F32 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16, torch.float32


def load_bf16(path, dim):
    raw = open(os.path.join(ROOT, path), "rb").read()
    t = torch.frombuffer(bytearray(raw), dtype=torch.int16).view(BF16)
    return t.view(-1, dim).to(DEV)


def scale_exp(amax, rule, qmax, floor):
    """Exponent x (int32 tensor) of the power-of-two scale 2^x of each block."""
    amax = amax.float()
    if rule == "flashmla":
        return torch.clamp_min(amax / qmax, floor).log2().ceil().to(torch.int32)
    if rule == "log2ceil":
        return (torch.clamp_min(amax, floor) / qmax).log2().ceil().to(torch.int32)
    if rule == "ceil2":
        t = torch.clamp_min(amax, floor) * torch.tensor(1.0 / qmax, dtype=F32, device=DEV)
        bits = t.view(torch.int32)
        return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    raise ValueError(rule)


def pow2(x):
    return torch.ldexp(torch.ones_like(x, dtype=F32), x.to(F32))


def fp8_blocks(v, tile, rule, floor):
    """v [n, k*tile] bf16 -> (codes uint8 [n, k*tile], exponents int32 [n, k])."""
    n, d = v.shape
    blk = v.float().view(n, d // tile, tile)
    x = scale_exp(blk.abs().amax(-1), rule, 448.0, floor)
    codes = (blk / pow2(x).unsqueeze(-1)).to(E4M3).view(torch.uint8)
    return codes.reshape(n, d), x


def model1_pages(rows, P, rule, pad_fill):
    """MODEL1_FP8Sparse: per page P data rows (448 e4m3 | 64 bf16) then P scale rows
    (7 ue8m0 + 1 pad); page bytes round_up(P*584, 576)."""
    n = rows.shape[0]
    nb = n // P
    page_bytes = (P * 584 + 575) // 576 * 576
    buf = torch.full((nb, page_bytes), pad_fill, dtype=torch.uint8, device=DEV)
    data = buf[:, : P * 576].view(nb, P, 576)
    scl = buf[:, P * 576 : P * 584].view(nb, P, 8)
    codes, x = fp8_blocks(rows[:, :448], 64, rule, 1e-4)
    data[:, :, :448] = codes.view(nb, P, 448)
    data[:, :, 448:] = rows[:, 448:].contiguous().view(torch.uint8).view(nb, P, 128)
    scl[:, :, :7] = pow2(x).to(E8M0).view(torch.uint8).view(nb, P, 7)
    # dequantize_k_cache: e4m3 -> bf16, times the e8m0 scale as bf16, product in bf16
    dq = torch.empty((nb, P, 512), dtype=BF16, device=DEV)
    dq[:, :, 448:] = data[:, :, 448:].contiguous().view(BF16)
    nope = data[:, :, :448].contiguous().view(E4M3).to(BF16).view(nb, P, 7, 64)
    sc = scl[:, :, :7].contiguous().view(E8M0).to(BF16).view(nb, P, 7, 1)
    dq[:, :, :448] = (nope * sc).view(nb, P, 448)
    return buf, dq.view(n, 512)


def v32_pages(rows, P, rule):
    """V32_FP8Sparse: per entry 512 e4m3 | 4 fp32 scales | 64 bf16; entries contiguous."""
    n = rows.shape[0]
    buf = torch.zeros((n, 656), dtype=torch.uint8, device=DEV)
    codes, x = fp8_blocks(rows[:, :512], 128, rule, 1e-4)
    buf[:, :512] = codes
    buf[:, 512:528] = pow2(x).contiguous().view(torch.uint8).view(n, 16)
    buf[:, 528:] = rows[:, 512:].contiguous().view(torch.uint8).view(n, 128)
    s = buf[:, 512:528].contiguous().view(F32)  # [n, 4]
    nope = buf[:, :512].contiguous().view(E4M3).float().view(n, 4, 128)
    dq = torch.empty((n, 576), dtype=BF16, device=DEV)
    dq[:, :512] = (nope * s.unsqueeze(-1)).view(n, 512)  # fp32 product, stored to bf16
    dq[:, 512:] = rows[:, 512:]
    return buf.view(n // P, P * 656), dq


def indexer_fp8_pages(rows, P, rule):
    """Per page: P*128 e4m3 codes, then P fp32 scales."""
    n = rows.shape[0]
    nb = n // P
    codes, x = fp8_blocks(rows, 128, rule, 1e-4)
    s = pow2(x).view(n)
    buf = torch.cat([codes.view(nb, P * 128), s.view(nb, P).contiguous().view(torch.uint8).view(nb, P * 4)], 1)
    dq = (codes.view(E4M3).float() * s.unsqueeze(-1)).to(BF16)
    return buf, dq


GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_codes(v):
    """fp32 -> 4-bit E2M1 code, round to nearest, ties to the even code, saturating
    (torch has no CUDA cast to float4_e2m1fn_x2)."""
    g = torch.tensor(GRID, dtype=torch.float64, device=DEV)
    a = v.double().abs().clamp_max(6.0)
    d = (a.unsqueeze(-1) - g).abs()
    i = d.argmin(-1)  # first (lowest) index among equal distances
    nxt = (i + 1).clamp_max(7)
    tie = (d.gather(-1, nxt.unsqueeze(-1)).squeeze(-1) == d.gather(-1, i.unsqueeze(-1)).squeeze(-1)) & (nxt != i)
    i = torch.where(tie & (i % 2 == 1), nxt, i)
    sign = torch.signbit(v).to(torch.int64) << 3  # -0 and small negatives keep the sign, as cvt does
    return (i | sign).to(torch.uint8)


def indexer_mxfp4_pages(rows, P, rule):
    """Per page: P*64 packed e2m1 (even dim in the low nibble), then P*4 ue8m0."""
    n = rows.shape[0]
    nb = n // P
    blk = rows.float().view(n, 4, 32)
    x = scale_exp(blk.abs().amax(-1), rule, 6.0, 6.0 * 2.0**-126).clamp(-127, 127)
    c = e2m1_codes(blk / pow2(x).unsqueeze(-1)).view(n, 64, 2)
    packed = c[..., 0] | (c[..., 1] << 4)
    sb = (x + 127).to(torch.uint8)
    buf = torch.cat([packed.reshape(nb, P * 64), sb.reshape(nb, P * 4)], 1)
    g = torch.tensor(GRID, dtype=F32, device=DEV)
    cc = c.view(n, 128).long()
    val = g[cc & 7] * torch.where(cc >= 8, -1.0, 1.0)
    dq = (val.view(n, 4, 32) * pow2(x).unsqueeze(-1)).to(BF16).view(n, 128)
    return buf, dq


def random_rows(gen, n, dim, tile, qmax):
    """bf16 rows that cover the scale rules' corner cases, row by row:
    plain N(0, sigma) for sigma over 1e-6 .. 1e30, a different magnitude per tile,
    tiles whose |max| is exactly qmax*2^k (the ceil2 / log2 edge), all-zero rows and
    rows below every amax floor."""
    rows = torch.randn((n, dim), generator=gen, device=DEV, dtype=F32)
    sig = [1e-6, 1e-3, 0.1, 1.0, 30.0, 1e4, 1e30]
    for r in range(n):
        kind = r % 10
        if kind < 7:
            rows[r] *= sig[kind]
        elif kind == 7:
            nt = (dim + tile - 1) // tile
            rows[r] *= torch.logspace(-5, 5, nt, device=DEV).repeat_interleave(tile)[:dim]
        elif kind == 8:
            rows[r] = rows[r].clamp(-1, 1)
            for t in range(dim // tile):
                rows[r, t * tile + (r + t) % tile] = qmax * 2.0 ** ((r + t) % 9 - 4)
        else:
            rows[r] *= 0.0 if (r // 10) % 2 == 0 else 1e-9
    return rows.to(BF16)


def main():
    os.makedirs(OUT, exist_ok=True)
    gen = torch.Generator(device=DEV)
    gen.manual_seed(20261130)
    kv_rows = load_bf16("testdata/kvcache/model_kv_rows.bf16", 512)
    idx_rows = load_bf16("testdata/kvcache/model_index_rows.bf16", 128)
    cases = []

    def emit(name, layout, P, dim, rule, floor, pad_fill, rows, pages, dq):
        rows.contiguous().view(torch.int16).cpu().numpy().tofile(os.path.join(OUT, name + ".rows.bf16"))
        pages.contiguous().cpu().numpy().tofile(os.path.join(OUT, name + ".pages.bin"))
        dq.contiguous().view(torch.int16).cpu().numpy().tofile(os.path.join(OUT, name + ".decoded.bf16"))
        cases.append(dict(name=name, layout=layout, page_size=P, dim=dim, rule=rule, floor=floor,
                          pad_fill=pad_fill, entries=rows.shape[0], pages=pages.shape[0],
                          page_bytes=pages.shape[1] if pages.dim() == 2 else pages.numel() // pages.shape[0]))

    # 1. the official model's FQ8 rows, 28 all-zero rows after them, one 64-entry page,
    #    under the reference rule (must round-trip losslessly) and FlashMLA's rule.
    m = torch.cat([kv_rows, torch.zeros((64 - kv_rows.shape[0], 512), dtype=BF16, device=DEV)])
    for rule in ("ceil2", "flashmla"):
        pages, dq = model1_pages(m, 64, rule, 0)
        same = (dq.view(torch.int16) == m.view(torch.int16)).all(-1)
        print(f"model1 {rule}: rows decoded bit-exactly: {int(same.sum())}/{m.shape[0]}")
        emit("model1_fq8_" + rule, "v4-model1", 64, 512, rule, 1e-4, 0, m, pages, dq)
    # 2. corner-case rows, FlashMLA's rule, pad bytes left as 0x5A: 2 pages of 64, 3 pages of 2.
    r = random_rows(gen, 128, 512, 64, 448.0)
    pages, dq = model1_pages(r, 64, "flashmla", 0x5A)
    emit("model1_rand_p64", "v4-model1", 64, 512, "flashmla", 1e-4, 0x5A, r, pages, dq)
    r = random_rows(gen, 6, 512, 64, 448.0)
    pages, dq = model1_pages(r, 2, "flashmla", 0x5A)
    emit("model1_rand_p2", "v4-model1", 2, 512, "flashmla", 1e-4, 0x5A, r, pages, dq)
    # 3. V3.2 656-byte layout, FlashMLA's rule, 2 pages of 16.
    r = random_rows(gen, 32, 576, 128, 448.0)
    pages, dq = v32_pages(r, 16, "flashmla")
    emit("v32_rand_p16", "v32", 16, 576, "flashmla", 1e-4, 0, r, pages, dq)
    # 4. indexer keys: the model's 4 FQ4 keys + 60 corner-case rows, one page of 64.
    r = torch.cat([idx_rows, random_rows(gen, 60, 128, 32, 6.0)])
    pages, dq = indexer_fp8_pages(r, 64, "log2ceil")
    emit("indexer_fp8_p64", "indexer-fp8", 64, 128, "log2ceil", 1e-4, 0, r, pages, dq)
    pages, dq = indexer_mxfp4_pages(r, 64, "log2ceil")
    emit("indexer_mxfp4_p64", "indexer-mxfp4", 64, 128, "log2ceil", 6.0 * 2.0**-126, 0, r, pages, dq)

    meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name(0), seed=20261130, cases=cases)
    json.dump(meta, open(os.path.join(OUT, "manifest.json"), "w"), indent=1)
    for c in cases:
        print(c["name"], c["layout"], c["entries"], "entries", c["pages"], "pages of", c["page_bytes"], "B")


if __name__ == "__main__":
    main()
