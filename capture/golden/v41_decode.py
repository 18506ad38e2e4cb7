"""Golden decode dump of the official DeepSeek-V4.1 model.py attention sub-layers.

Runs the attention code of deepseek-ai/DeepSeek-V4.1-Flash inference/model.py (revision
dba1be0a, verbatim excerpt in v41ref/model.py) on a GPU with the tiny config of sparsemla's
v41-tiny preset: 8 layers, ratios 0,0,2,2,2,1,1,1, KV sources [2,5], index sources [2,5,7],
candidate source 5 (2 blocks of 4). Each layer's attention input x is seeded random bf16 (no
mHC/MoE between layers: the Attention modules are called in layer order, as Transformer does,
with the module-global shared_attn). Prefill S tokens, then decode steps S..S+n-1.

Setup (the official code is not part of this repository): a directory holding this script and
a package v41ref/ with __init__.py, kernel_cpu.py (= capture/golden/v41_kernels.py) and
model.py = the official inference/model.py at dba1be0a reduced to the attention path: the
module globals, ModelArgs, linear, Linear, ColumnParallelLinear, RowParallelLinear, RMSNorm,
precompute_freqs_cis, apply_rotary_emb, get_window_topk_idxs, Compressor, Indexer,
select_candidate_blocks, Attention, SharedAttentionRuntime and shared_attn kept verbatim; the
engram / vision / image_processor imports and classes, Gate, Expert, MoE, Block, DSpark*,
Transformer and sample removed. Run from the repository root (v4_kernels.py is imported from
capture/golden): python3 DIR/v41_decode.py --out OUT [--prefill 12] [--steps 4] [--seed 41]

Writes OUT/: config.json, weights.safetensors (layers.L.attn.* official names; FP8 weights as
U8 E4M3 codes with U8 UE8M0 32x32 block scales), rope.safetensors (freqs_cis_r0 /
freqs_cis_cmp as [T,32,2] fp32 cos,sin), prefill_state.safetensors and step_P.safetensors
(L<l>.<stage>), meta.json (which layer's index keys shared_attn.index_k holds before each step).
"""

import argparse
import json
import os
import struct
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.getcwd(), "capture", "golden"))

DRY = not hasattr(torch, "float8_e4m3fn")
if DRY:  # local dry run on an old torch: wrong values, same flow
    torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2 = torch.float16, torch.float32, torch.int16

import v4_kernels as v4  # noqa: E402

if DRY:
    v4.f32_to_e8m0 = lambda s: s
from v41ref import model as M  # noqa: E402

CFG = dict(max_batch_size=1, max_seq_len=512, dim=256, n_layers=8, n_heads=4, q_lora_rank=128,
           head_dim=512, rope_head_dim=64, norm_eps=1e-20, o_groups=2, o_lora_rank=128, window_size=128,
           compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1), kv_source_layers=(2, 5), index_source_layers=(2, 5, 7),
           compress_rope_theta=160000.0, original_seq_len=65536, rope_theta=10000.0, rope_factor=16,
           beta_fast=32, beta_slow=1, index_n_heads=4, index_head_dim=128, index_topk=4,
           candidate_source_layer=5, candidate_topk_blocks=2, candidate_block_size=4)

ST_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}


def save_st(tensors, path, meta=None):
    """A safetensors writer (no dependency): header JSON, then the raw little-endian bytes."""
    hdr, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        raw = t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1)
        b = raw.numpy().tobytes()
        hdr[name] = {"dtype": ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if meta:
        hdr["__metadata__"] = meta
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def quant_fp8_weight(W):
    """32x32 UE8M0 blocks: s = ceil2(max(amax,1e-4)/448), code = E4M3(clamp(W/s, +-448))."""
    N, K = W.shape
    blk = W.view(N // 32, 32, K // 32, 32)
    amax = blk.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-4)
    s = v4.ceil2_bits(amax * torch.tensor(1 / 448, dtype=torch.float32, device=W.device))
    q = (blk / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(N, K)
    return q, v4.f32_to_e8m0(s.view(N // 32, K // 32).contiguous())


def init_weights(layers, g):
    out = {}
    for l, a in enumerate(layers):
        mods = dict(a.named_modules())
        for name, p in a.named_parameters():
            full = f"layers.{l}.attn.{name}"
            if name.endswith(".scale") or name == "scale":
                continue
            if p.dtype == torch.float8_e4m3fn:
                N, K = p.shape
                W = torch.randn(N, K, generator=g, device="cpu").to(p.device) / K ** 0.5
                q, s = quant_fp8_weight(W.float())
                p.data.copy_(q)
                owner = mods[name.rsplit(".", 1)[0]]
                owner.scale.data.copy_(s)
                out[full] = q.view(torch.uint8)
                out[full.rsplit(".", 1)[0] + ".scale"] = s.view(torch.uint8)
                continue
            if name == "attn_sink":
                v = torch.randn(p.shape, generator=g, device="cpu").to(p.device)
            elif name.endswith("norm.weight"):
                v = (1 + 0.1 * torch.randn(p.shape, generator=g, device="cpu")).to(p.device)
            else:
                v = (torch.randn(p.shape, generator=g, device="cpu") / p.shape[-1] ** 0.5).to(p.device)
            if name != "attn_sink":
                v = v.to(torch.bfloat16)
            p.data.copy_(v.to(p.dtype))
            out[full] = p.data.clone()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefill", type=int, default=12)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--device", default="cuda")
    o = ap.parse_args()
    os.makedirs(o.out, exist_ok=True)
    dev = o.device
    torch.set_default_dtype(torch.bfloat16)
    if hasattr(torch, "set_default_device"):
        torch.set_default_device(dev)  # as generate.py does: model.py makes index lists with bare arange
    torch.backends.cuda.matmul.allow_tf32 = False
    args = M.ModelArgs(**CFG)
    layers = [M.Attention(l, args).to(dev) for l in range(args.n_layers)]
    g = torch.Generator().manual_seed(o.seed)
    weights = init_weights(layers, g)
    save_st(weights, os.path.join(o.out, "weights.safetensors"), {"producer": "v41_decode.py"})
    T = o.prefill + o.steps
    xs = [(torch.randn(1, T, args.dim, generator=g, device="cpu")).to(torch.bfloat16).to(dev) for _ in layers]

    rope = {}
    for l, a in enumerate(layers):
        key = "freqs_cis_cmp" if a.compress_ratio else "freqs_cis_r0"
        rope[key] = torch.view_as_real(a.freqs_cis[:T + 1]).float()
    save_st(rope, os.path.join(o.out, "rope.safetensors"))

    # ---- capture machinery ----
    rec, cur = {}, [None]
    names = {}
    for l, a in enumerate(layers):
        for n, m in a.named_modules():
            names[id(m)] = (l, n)
    stage_of = {"wq_a": "q_a", "q_norm": "cq", "wq_b": "q_b", "wkv": "kv_raw", "kv_norm": "kv_normed",
                "compressor.norm": "cmp_latent", "compressor.wgate": "cmp_b", "indexer.wq_b": "iq_b",
                "indexer.weights_proj": "iw_raw", "indexer.k_norm": "ik_normed", "indexer.wk": "ik_raw"}

    def hook(m, inp, out):
        if cur[0] is None:
            return
        l, n = names[id(m)]
        st = stage_of.get(n)
        if n == "compressor.wkv":
            st = "cmp_raw" if layers[l].compress_ratio == 1 else "cmp_a"
        if st:
            rec[f"L{l}.{st}"] = out.detach().clone().squeeze(0).squeeze(0)

    for a in layers:
        for n, m in a.named_modules():
            if n in stage_of or n == "compressor.wkv":
                m.register_forward_hook(hook)

    sa = M.sparse_attn

    def sparse_attn(q, kv, sink, idx, scale):
        y = sa(q, kv, sink, idx, scale)
        if cur[0] is not None:
            l = cur[0]
            rec[f"L{l}.q"] = q.detach().clone()[0, 0]
            rec[f"L{l}.kv_cache"] = kv.detach().clone()[0]
            rec[f"L{l}.topk_idxs"] = idx.detach().clone()[0, 0].int()
            rec[f"L{l}.o"] = y.detach().clone()[0, 0]
        return y

    M.sparse_attn = sparse_attn
    scb = M.select_candidate_blocks

    def select_candidate_blocks(*a, **k):
        mask = scb(*a, **k)
        if cur[0] is not None:
            rec[f"L{cur[0]}.cand_mask"] = mask.detach().clone().reshape(-1).int()
        return mask

    M.select_candidate_blocks = select_candidate_blocks
    ifw = M.Indexer.forward

    def indexer_forward(self, *a, **k):
        y = ifw(self, *a, **k)
        if cur[0] is not None:
            rec[f"L{cur[0]}.index_sel"] = y.detach().clone().reshape(-1).int()
        return y

    M.Indexer.forward = indexer_forward

    def state(l, a, p_next):
        s = {f"L{l}.window": a.window_kv_cache[0].clone()}
        r = a.compress_ratio
        if a.is_kv_source:
            tc = p_next // r
            s[f"L{l}.ckv"] = a.compress_kv_cache[0, :tc].clone()
            if a.compressor.compress_ratio > 1:
                s[f"L{l}.cmp_kv_state"] = a.compressor.kv_state[0].clone()
                s[f"L{l}.cmp_score_state"] = a.compressor.score_state[0].clone()
            if a.indexer is not None:
                s[f"L{l}.icache"] = a.indexer.k_cache[0, :tc].clone()
        return s

    def index_k_at():
        for l, a in enumerate(layers):
            if a.indexer is not None and a.indexer.owns_k and M.shared_attn.index_k is a.indexer.k_cache:
                return l
        return -1

    with torch.inference_mode():
        for l, a in enumerate(layers):
            a(xs[l][:, :o.prefill], 0)
        pre = {}
        for l, a in enumerate(layers):
            pre.update(state(l, a, o.prefill))
        save_st(pre, os.path.join(o.out, "prefill_state.safetensors"))
        meta = {"prefill": o.prefill, "index_k_at": {}, "seed": o.seed}
        for p in range(o.prefill, T):
            meta["index_k_at"][str(p)] = index_k_at()
            rec.clear()
            for l, a in enumerate(layers):
                cur[0] = l
                x = xs[l][:, p:p + 1]
                rec[f"L{l}.x"] = x[0, 0].clone()
                y = a(x, p)
                rec[f"L{l}.y"] = y.detach().clone()[0, 0]
                cur[0] = None
                for k, v in state(l, a, p + 1).items():
                    if not k.endswith(".window") and not k.endswith(".ckv"):
                        rec[k] = v
            bad = [k for k, v in rec.items() if v.is_floating_point() and not torch.isfinite(v.float()).all()]
            meta.setdefault("nonfinite", {})[str(p)] = bad
            save_st(rec, os.path.join(o.out, f"step_{p}.safetensors"))
    cfg = dict(CFG)
    cfg["compress_ratios"] = list(cfg["compress_ratios"])
    cfg["kv_source_layers"] = list(cfg["kv_source_layers"])
    cfg["index_source_layers"] = list(cfg["index_source_layers"])
    json.dump(cfg, open(os.path.join(o.out, "config.json"), "w"), indent=1)
    json.dump(meta, open(os.path.join(o.out, "meta.json"), "w"), indent=1)
    print("torch", torch.__version__, "device", dev, "wrote", sorted(os.listdir(o.out)))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
