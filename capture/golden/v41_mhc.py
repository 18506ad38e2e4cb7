"""Golden of DeepSeek-V4.1's pipelined hyper-connections (mHC), written for sparsemla.

Follows Block.forward / hc_mixes / hc_pre / hc_post and Transformer.forward's tail of
deepseek-ai/DeepSeek-V4.1-Flash inference/model.py (revision dba1be0a) in torch, with the
sub-layers replaced by a fixed elementwise map (attention: y = bf16(x * ca_l), FFN:
ffn_out = bf16(ffn_in * cf_l)), so that only the mHC, the norms and the head are under test:

  hc_mixes(h):  rsqrt(mean(f32(flatten(h))^2) + norm_eps) * F.linear(f32(flatten(h)), fn)
                -> hc_split_sinkhorn (capture/golden/v4_kernels.py's port)
  block:        attn_pre/post/comb = hc_mixes(h_in); x = attn_norm(hc_pre(h_in, pre_mix_in))
                h_mid = hc_post(y, h_in, attn_post, attn_comb)
                ffn_pre/post/comb = hc_mixes(h_mid); ffn_in = ffn_norm(hc_pre(h_mid, attn_pre))
                h_out = hc_post(ffn_out, h_mid, ffn_post, ffn_comb); pre_mix_out = ffn_pre
  head:         head_x = norm(hc_pre(h_out, pre_mix_out)); logits = F.linear(f32(head_x), head fp32)

norm_eps = 1e-20 (V4.1), hc_eps 1e-6, 20 Sinkhorn iterations, hc_mult 4, dim 256, 2 blocks,
vocab 64; the first pre_mix is one-hot [1,0,0,0]. Streams are N(0, 0.01) so that mean(h^2)
is about 1e-4 and V4's norm_eps 1e-6 would be visible. CPU, fp32 matmuls.

Usage: python3 capture/golden/v41_mhc.py --out testdata/v41-mhc
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import v4_kernels as v4  # noqa: E402

ST_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32"}


def save_st(tensors, path, meta=None):
    """safetensors: header JSON, then the raw little-endian bytes (as v41_decode.py writes them)."""
    import json
    import struct
    hdr, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        b = t.view(-1).view(torch.uint8).numpy().tobytes()
        hdr[name] = {"dtype": ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if meta:
        hdr["__metadata__"] = meta
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)

HC, DIM, LAYERS, VOCAB, NORM_EPS, HC_EPS, ITERS = 4, 256, 2, 64, 1e-20, 1e-6, 20


def rmsnorm(x, w):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + NORM_EPS)
    return (w * xf).to(x.dtype)


def mixes_of(h, fn, scale, base):
    hf = h.flatten(-2).float()
    rs = torch.rsqrt(hf.square().mean(-1, keepdim=True) + NORM_EPS)
    m = F.linear(hf, fn) * rs
    pre, post, comb = v4.hc_split_sinkhorn(m, scale, base, HC, ITERS, HC_EPS)
    return m, pre, post, comb


def collapse(h, mix):
    return torch.sum(mix.unsqueeze(-1) * h.float(), dim=-2).to(h.dtype)


def post_of(a, res, post, comb):
    return (post.unsqueeze(-1) * a.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * res.unsqueeze(-2), dim=-3)).type_as(a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=41)
    o = ap.parse_args()
    os.makedirs(o.out, exist_ok=True)
    g = torch.Generator().manual_seed(o.seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    mix = (2 + HC) * HC
    W, S = {}, {}
    for l in range(LAYERS):
        for side in ("attn", "ffn"):
            W[f"layers.{l}.hc_{side}_fn"] = rn(mix, HC * DIM) / (HC * DIM) ** 0.5
            W[f"layers.{l}.hc_{side}_base"] = 0.1 * rn(mix)
            W[f"layers.{l}.hc_{side}_scale"] = 0.5 + 0.1 * rn(3)
            W[f"layers.{l}.{side}_norm.weight"] = (1 + 0.1 * rn(DIM)).bfloat16()
        W[f"layers.{l}.sub.ca"] = (1 + 0.5 * rn(DIM)).bfloat16()
        W[f"layers.{l}.sub.cf"] = (1 + 0.5 * rn(DIM)).bfloat16()
    W["norm.weight"] = (1 + 0.1 * rn(DIM)).bfloat16()
    W["head.weight"] = (rn(VOCAB, DIM) / DIM ** 0.5).bfloat16().float()
    h = (0.01 * rn(DIM)).bfloat16().unsqueeze(0).repeat(HC, 1)
    pre_mix = torch.zeros(HC)
    pre_mix[0] = 1.0
    S["global.h0"] = h.clone()
    for l in range(LAYERS):
        P = f"layers.{l}."
        S[f"L{l}.h_in"], S[f"L{l}.pre_mix_in"] = h.clone(), pre_mix.clone()
        m, ap_, apo, ac = mixes_of(h, W[P + "hc_attn_fn"], W[P + "hc_attn_scale"], W[P + "hc_attn_base"])
        S.update({f"L{l}.hc_attn_mixes": m, f"L{l}.hc_attn_pre": ap_, f"L{l}.hc_attn_post": apo, f"L{l}.hc_attn_comb": ac})
        ani = collapse(h, pre_mix)
        x = rmsnorm(ani, W[P + "attn_norm.weight"])
        y = (x.float() * W[P + "sub.ca"].float()).bfloat16()
        hm = post_of(y, h, apo, ac)
        S.update({f"L{l}.attn_norm_in": ani, f"L{l}.x": x, f"L{l}.y": y, f"L{l}.h_mid": hm})
        m, fp, fpo, fc = mixes_of(hm, W[P + "hc_ffn_fn"], W[P + "hc_ffn_scale"], W[P + "hc_ffn_base"])
        S.update({f"L{l}.hc_ffn_mixes": m, f"L{l}.hc_ffn_pre": fp, f"L{l}.hc_ffn_post": fpo, f"L{l}.hc_ffn_comb": fc})
        fni = collapse(hm, ap_)
        fi = rmsnorm(fni, W[P + "ffn_norm.weight"])
        fo = (fi.float() * W[P + "sub.cf"].float()).bfloat16()
        h = post_of(fo, hm, fpo, fc)
        pre_mix = fp
        S.update({f"L{l}.ffn_norm_in": fni, f"L{l}.ffn_in": fi, f"L{l}.ffn_out": fo, f"L{l}.h_out": h, f"L{l}.pre_mix_out": fp})
    hi = collapse(h, pre_mix)
    hx = rmsnorm(hi, W["norm.weight"])
    S["global.head_in"], S["global.head_x"] = hi, hx
    S["global.logits"] = F.linear(hx.float(), W["head.weight"])
    save_st(W, os.path.join(o.out, "weights.safetensors"), {"producer": "capture/golden/v41_mhc.py"})
    save_st(S, os.path.join(o.out, "stages.safetensors"), {"producer": "capture/golden/v41_mhc.py", "torch": torch.__version__})
    print("torch", torch.__version__, "wrote", sorted(os.listdir(o.out)))


if __name__ == "__main__":
    main()
