"""Runs the official V4.1 Block.forward on the mHC golden's weights and first streams, on a GPU.

Usage (from the repository root, with the vendored excerpts next to this script or on
sys.path: v41ref/model.py for RMSNorm, v41ref/block_excerpt.py = Block.hc_mixes / hc_pre /
hc_post / forward of deepseek-ai/DeepSeek-V4.1-Flash inference/model.py revision dba1be0a,
verbatim; neither is committed):

    python3 capture/golden/v41_mhc_official.py OUT [cuda|cpu] [GOLDEN_DIR]

GOLDEN_DIR (default: mhc/ next to this script) holds weights.safetensors and
stages.safetensors of capture/golden/v41_mhc.py. The Block is built without __init__ (which
would build Attention, MoE, Engram) and given the golden's hc_* / norm weights; the sub-layers
are the same elementwise maps as v41_mhc.py. After the two blocks, Transformer.forward's tail:
layer.hc_pre(h, pre_mix), norm, fp32 head. Writes OUT/stages_gpu.safetensors with the same
stage names and prints, per stage, the largest difference to the CPU transcription."""
import json
import os
import struct
import sys

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.getcwd(), "capture", "golden"))
if not hasattr(torch, "float8_e4m3fn"):  # local dry run on an old torch (no fp8 dtypes; unused here)
    torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2 = torch.float16, torch.float32, torch.int16
from v41ref import block_excerpt as B  # noqa: E402
from v41ref import model as M  # noqa: E402

DT = {"BF16": torch.bfloat16, "F32": torch.float32}


def load_st(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        buf = bytearray(raw[8 + n + a:8 + n + b])
        out[k] = torch.frombuffer(buf, dtype=DT[v["dtype"]]).reshape(v["shape"]).clone()
    return out


def save_st(tensors, path):
    hdr, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        b = t.view(-1).view(torch.uint8).numpy().tobytes()
        hdr[name] = {"dtype": {torch.bfloat16: "BF16", torch.float32: "F32"}[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hdr["__metadata__"] = {"producer": "v41_mhc_official.py (official Block.forward)", "torch": torch.__version__, "device": str(DEV)}
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


DEV = sys.argv[2] if len(sys.argv) > 2 else "cuda"
GOLDEN = sys.argv[3] if len(sys.argv) > 3 else os.path.join(HERE, "mhc")


class Scale(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x, *_):
        return (x.float() * self.c.float()).to(torch.bfloat16)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    W = {k: v.to(DEV) for k, v in load_st(os.path.join(GOLDEN, "weights.safetensors")).items()}
    CPU = load_st(os.path.join(GOLDEN, "stages.safetensors"))
    HC, DIM = 4, 256
    rec, cnt = {}, {}
    split = B.hc_split_sinkhorn

    def hc_split(mixes, *a):
        rec.setdefault("mixes", []).append(mixes.clone())
        return split(mixes, *a)

    B.hc_split_sinkhorn = hc_split
    h = CPU["global.h0"].to(DEV).view(1, 1, HC, DIM)
    pre_mix = torch.zeros(1, 1, HC, dtype=torch.float32, device=DEV)
    pre_mix[..., 0] = 1.0  # make_identity_pre_mix
    S = {}
    for l in range(2):
        P = f"layers.{l}."
        blk = B.Block.__new__(B.Block)
        nn.Module.__init__(blk)
        blk.norm_eps, blk.hc_mult, blk.hc_sinkhorn_iters, blk.hc_eps = 1e-20, HC, 20, 1e-6
        for side in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                setattr(blk, f"hc_{side}_{part}", nn.Parameter(W[P + f"hc_{side}_{part}"], requires_grad=False))
            nm = M.RMSNorm(DIM, 1e-20).to(DEV)
            nm.weight = nn.Parameter(W[P + f"{side}_norm.weight"], requires_grad=False)
            setattr(blk, f"{side}_norm", nm)
        blk.attn, blk.ffn = Scale(W[P + "sub.ca"]), Scale(W[P + "sub.cf"])
        calls = {}

        def wrap(obj, name):
            f = getattr(obj, name)

            def g(*a, **k):
                r = f(*a, **k)
                calls.setdefault(name, []).append((a, r))
                return r
            setattr(obj, name, g)

        for n in ("hc_mixes", "hc_pre", "hc_post"):
            wrap(blk, n)
        for n in ("attn_norm", "ffn_norm", "attn", "ffn"):
            wrap(getattr(blk, n), "forward")
        rec.clear()
        S[f"L{l}.h_in"], S[f"L{l}.pre_mix_in"] = h[0, 0].clone(), pre_mix[0, 0].clone()
        with torch.inference_mode():
            h, pre_mix = blk(h, 0, pre_mix, None)
        (ap, apo, ac), (fp, fpo, fc) = [r for _, r in calls["hc_mixes"]]
        sq = lambda t: t.reshape(t.shape[2:])  # noqa: E731
        S.update({f"L{l}.hc_attn_mixes": sq(rec["mixes"][0]), f"L{l}.hc_attn_pre": sq(ap), f"L{l}.hc_attn_post": sq(apo), f"L{l}.hc_attn_comb": sq(ac),
                  f"L{l}.hc_ffn_mixes": sq(rec["mixes"][1]), f"L{l}.hc_ffn_pre": sq(fp), f"L{l}.hc_ffn_post": sq(fpo), f"L{l}.hc_ffn_comb": sq(fc)})
        S[f"L{l}.attn_norm_in"], S[f"L{l}.ffn_norm_in"] = [sq(r) for _, r in calls["hc_pre"]]
        S[f"L{l}.h_mid"], S[f"L{l}.h_out"] = [sq(r) for _, r in calls["hc_post"]]
        S[f"L{l}.x"], S[f"L{l}.y"], S[f"L{l}.ffn_in"], S[f"L{l}.ffn_out"] = [sq(calls["forward"][i][1]) for i in range(4)]
        S[f"L{l}.pre_mix_out"] = sq(pre_mix)
    # Transformer.forward's tail: h = layer.hc_pre(h, pre_mix); logits = self.head(self.norm(h))
    with torch.inference_mode():
        hi = blk.hc_pre(h, pre_mix)
        norm = M.RMSNorm(DIM, 1e-20).to(DEV)
        norm.weight = nn.Parameter(W["norm.weight"], requires_grad=False)
        hx = norm(hi)
        logits = F.linear(hx[:, -1].float(), W["head.weight"])
    S["global.head_in"], S["global.head_x"], S["global.logits"] = hi[0, 0], hx[0, 0], logits[0]
    S["global.h0"] = CPU["global.h0"]
    for k in sorted(S):
        a, b = S[k].float().cpu(), CPU[k].float()
        d = (a - b).abs().max().item()
        print(f"{k:22s} {str(list(a.shape)):10s} max|gpu-cpu| {d:.3g}  max|cpu| {b.abs().max().item():.3g}  bits-equal {torch.equal(S[k].cpu(), CPU[k])}")
    save_st(S, os.path.join(out, "stages_gpu.safetensors"))
    print("torch", torch.__version__, DEV)


if __name__ == "__main__":
    main()
