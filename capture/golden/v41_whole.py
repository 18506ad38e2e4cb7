"""Golden of a whole DeepSeek-V4.1 decode step: the official Transformer.forward on a GPU.

Runs deepseek-ai/DeepSeek-V4.1-Flash inference/model.py (revision dba1be0a, verbatim excerpt in
v41ref/model.py) end to end -- ParallelEmbedding, per layer Block.forward with the pipelined mHC
(hc_mixes / hc_pre / hc_post, the incoming pre_mix collapsing the attention input, attn_pre the
FFN input, ffn_pre handed on), attn_norm, Attention with the module-global shared_attn, ffn_norm,
MoE (Gate with gate_temp and the correction bias, routed Experts in FP4, the FP8 shared expert,
swiglu_limit), then the tail layer.hc_pre(h, pre_mix), norm, ParallelHead -- with a tiny random
config of the v41-tiny structure: 8 layers, ratios 0,0,2,2,2,1,1,1, KV sources [2,5], index
sources [2,5,7], candidate source 5 (2 blocks of 4), dim 256, 4 heads x 512, plus 8 routed
experts top-2 (moe_inter_dim 64), 1 shared expert, score_func sqrtsoftplus, gate_temp 0.7,
route_scale 1.5, swiglu_limit 1.5, hc_mult 4, vocab 512. Prefill S random tokens, then decode
steps S..S+n-1 teacher-forced with random tokens, every stage of every layer dumped per step.

Setup (the official code is not part of this repository): a directory DIR holding this script
and a package DIR/v41ref/ with
  __init__.py          empty
  kernel_cpu.py        = capture/golden/v41_kernels.py (torch ports of act_quant, fp4_act_quant,
                         fp8_gemm, fp4_gemm, sparse_attn, hc_split_sinkhorn written here)
  model.py             = the official inference/model.py at dba1be0a with ParallelEngramEmbedding,
                         Engram, the DSpark* classes and the __main__ demo left out; everything
                         else (module globals, ModelArgs, ParallelEmbedding, linear, Linear,
                         Column/RowParallelLinear, RMSNorm, precompute_freqs_cis,
                         apply_rotary_emb, get_window_topk_idxs, Compressor, Indexer,
                         select_candidate_blocks, Attention, Gate, Expert, MoE, Block,
                         ParallelHead, make_identity_pre_mix, SharedAttentionRuntime,
                         shared_attn, Transformer, sample) verbatim, its imports unchanged
  engram.py, image_processor.py, vision.py
                         stand-ins supplying the imported names (EngramLayout.from_args returns
                         None for engram_layer_ids = (), the rest refuse to run)
Run from the repository root (v4_kernels.py is imported from capture/golden):
    python3 DIR/v41_whole.py --out OUT [--prefill 12] [--steps 3] [--seed 4141]
On an old torch without float8 dtypes it runs a dry run on the CPU (wrong values, same flow).

Writes OUT/: config.json (dataclasses.asdict(ModelArgs)), weights.safetensors (official
parameter names; FP8 weights U8 E4M3 codes + U8 UE8M0 32x32 scales, FP4 experts U8 packed E2M1 +
U8 UE8M0 1x32 scales), rope.safetensors, prefill_state.safetensors, step_P.safetensors
(L<l>.<stage> and the globals), meta.json. The stage list is in testdata/v41-tiny-whole/README.md.
"""

import argparse
import dataclasses
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
    torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2 = torch.float16, torch.float32, torch.float64

import v4_kernels as v4  # noqa: E402

if DRY:
    v4.f32_to_e8m0 = lambda s: s
from v41ref import model as M  # noqa: E402

CFG = dict(max_batch_size=1, max_seq_len=512, temperature=0.0, dtype="fp8", expert_dtype="fp4", vocab_size=512,
           dim=256, moe_inter_dim=64, n_layers=8, n_heads=4, n_routed_experts=8, n_shared_experts=1,
           n_activated_experts=2, score_func="sqrtsoftplus", gate_temp=0.7, norm_topk_prob=True, route_scale=1.5,
           swiglu_limit=1.5, q_lora_rank=128, head_dim=512, rope_head_dim=64, norm_eps=1e-20, o_groups=2,
           o_lora_rank=128, window_size=128, compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1), kv_source_layers=(2, 5),
           index_source_layers=(2, 5, 7), compress_rope_theta=160000.0, original_seq_len=65536,
           rope_theta=10000.0, rope_factor=16, beta_fast=32, beta_slow=1, index_n_heads=4, index_head_dim=128,
           index_topk=4, candidate_source_layer=5, candidate_topk_blocks=2, candidate_block_size=4, hc_mult=4,
           hc_sinkhorn_iters=20, hc_eps=1e-6)

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


def init_weights(model, g, dev):
    """Seeded random weights in each parameter's official dtype; returns the state to save (FP8 /
    FP4 / UE8M0 parameters as their raw bytes, U8)."""
    out = {}
    mods = dict(model.named_modules())

    def rn(*shape):
        return torch.randn(*shape, generator=g, device="cpu").to(dev)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        owner = mods[name.rsplit(".", 1)[0]] if "." in name else model
        if leaf == "scale" and isinstance(owner, M.Linear):
            continue  # written with its weight
        if p.dtype == torch.float8_e4m3fn:
            N, K = p.shape
            q, s = quant_fp8_weight(rn(N, K).float() / K ** 0.5)
            p.data.copy_(q)
            owner.scale.data = s
            out[name] = q.view(torch.uint8)
            out[name[:-len("weight")] + "scale"] = s.view(torch.uint8)
            continue
        if p.dtype == torch.float4_e2m1fn_x2:
            N, K = owner.out_features, owner.in_features
            packed, s = v4.fp4_act_quant(rn(N, K).float() / K ** 0.5, 32)
            p.data = packed
            owner.scale.data = s
            out[name] = packed.view(torch.uint8)
            out[name[:-len("weight")] + "scale"] = s.view(torch.uint8)
            continue
        if name.startswith("layers.") and ".hc_" in name:
            hc, dim = CFG["hc_mult"], CFG["dim"]
            if leaf.endswith("_fn"):
                v = rn(*p.shape) / (hc * dim) ** 0.5
            elif leaf.endswith("_base"):
                v = 0.1 * rn(*p.shape)
            else:
                v = 0.5 + 0.1 * rn(*p.shape)
        elif leaf == "attn_sink":
            v = rn(*p.shape)
        elif name == "embed.weight":
            v = rn(*p.shape).to(torch.bfloat16)
        elif leaf == "bias":  # Gate correction bias, fp32
            v = 0.05 * rn(*p.shape)
        elif name.endswith("norm.weight"):
            v = (1 + 0.1 * rn(*p.shape)).to(torch.bfloat16)
        else:  # bf16 linears (wo_a, weights_proj, indexer.wk, r=1 compressor.wkv, gate), fp32 ones
            v = (rn(*p.shape) / p.shape[-1] ** 0.5).to(torch.bfloat16)  # bf16-representable
        p.data.copy_(v.to(p.dtype))
        out[name] = p.data.clone()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefill", type=int, default=12)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=4141)
    ap.add_argument("--device", default="cpu" if DRY else "cuda")
    o = ap.parse_args()
    os.makedirs(o.out, exist_ok=True)
    dev = o.device
    torch.set_default_dtype(torch.bfloat16)
    if hasattr(torch, "set_default_device"):
        torch.set_default_device(dev)  # as generate.py does: model.py makes index lists with bare arange
    torch.backends.cuda.matmul.allow_tf32 = False
    args = M.ModelArgs(**CFG)
    model = M.Transformer(args).to(dev)
    g = torch.Generator().manual_seed(o.seed)
    weights = init_weights(model, g, dev)
    save_st(weights, os.path.join(o.out, "weights.safetensors"),
            {"producer": "v41_whole.py", "torch": torch.__version__, "dry": str(DRY)})
    T = o.prefill + o.steps
    tokens = torch.randint(0, args.vocab_size, (1, T), generator=g, device="cpu").to(dev)
    blocks = list(model.layers)
    attns = [b.attn for b in blocks]

    rope = {}
    for a in attns:
        key = "freqs_cis_cmp" if a.compress_ratio else "freqs_cis_r0"
        rope[key] = torch.view_as_real(a.freqs_cis[:T + 1]).float()
    save_st(rope, os.path.join(o.out, "rope.safetensors"))

    # ---- capture machinery: hooks and wrappers around the official code, values unchanged ----
    rec, cur, on = {}, [None], [False]
    seen = {}  # per-layer call counters of hc_split_sinkhorn / hc_pre / hc_post

    def put(key, t):
        if on[0]:
            rec[key] = t.detach().clone()

    def lk(stage):
        return f"L{cur[0]}.{stage}"

    def nth(kind):
        k = (cur[0], kind)
        seen[k] = seen.get(k, 0) + 1
        return seen[k]

    split = M.hc_split_sinkhorn

    def hc_split_sinkhorn(mixes, *a, **k):
        pre, post, comb = split(mixes, *a, **k)
        site = "attn" if nth("split") == 1 else "ffn"
        put(lk(f"hc_{site}_mixes"), mixes[0, 0])
        put(lk(f"hc_{site}_pre"), pre[0, 0])
        put(lk(f"hc_{site}_post"), post[0, 0])
        put(lk(f"hc_{site}_comb"), comb[0, 0])
        return pre, post, comb

    M.hc_split_sinkhorn = hc_split_sinkhorn
    hc_pre, hc_post = M.Block.hc_pre, M.Block.hc_post

    def hc_pre_w(self, x, pre_mix):
        y = hc_pre(self, x, pre_mix)
        if cur[0] is None:  # Transformer's tail: layer.hc_pre(h, pre_mix) after the last block
            put("head_in", y[0, -1])
            put("head_pre_mix", pre_mix[0, -1])
        else:
            put(lk("attn_norm_in" if nth("pre") == 1 else "ffn_norm_in"), y[0, 0])
        return y

    def hc_post_w(self, x, residual, post, comb):
        y = hc_post(self, x, residual, post, comb)
        put(lk("h_mid" if nth("post") == 1 else "h_out_hc_post"), y[0, 0])
        return y

    M.Block.hc_pre, M.Block.hc_post = hc_pre_w, hc_post_w

    def block_pre(m, inp):
        cur[0] = m.layer_id
        put(lk("h_in"), inp[0][0, 0])
        put(lk("pre_mix_in"), inp[2][0, 0])

    def block_post(m, inp, out):
        put(lk("h_out"), out[0][0, 0])
        put(lk("pre_mix_out"), out[1][0, 0])
        cur[0] = None

    def gate_hook(m, inp, out):  # a forward hook must return None (a value replaces the output)
        put(lk("moe_weights"), out[0][0])
        put(lk("moe_indices"), out[1][0])

    for b in blocks:
        b.register_forward_pre_hook(block_pre)
        b.register_forward_hook(block_post)
        b.attn_norm.register_forward_hook(lambda m, i, y: put(lk("x"), y[0, 0]))
        b.ffn_norm.register_forward_hook(lambda m, i, y: put(lk("ffn_in"), y[0, 0]))
        b.attn.register_forward_hook(lambda m, i, y: put(lk("y"), y[0, 0]))
        b.ffn.register_forward_hook(lambda m, i, y: put(lk("ffn_out"), y[0, 0]))
        b.ffn.gate.register_forward_hook(gate_hook)
        b.ffn.shared_experts.register_forward_hook(lambda m, i, y: put(lk("moe_shared_out"), y[0]))
        for e, ex in enumerate(b.ffn.experts):
            ex.register_forward_hook(lambda m, i, y, e=e: put(lk(f"moe_expert_out.{e}"), y[0]))
    model.embed.register_forward_hook(lambda m, i, y: put("embed", y[0, -1]))
    model.norm.register_forward_hook(lambda m, i, y: put("head_x", y[0, -1]))
    model.head.register_forward_hook(lambda m, i, y: put("logits", y[0]))

    # attention stages, as capture/golden/v41_decode.py names them
    names = {}
    for l, a in enumerate(attns):
        for n, m in a.named_modules():
            names[id(m)] = (l, n)
    stage_of = {"wq_a": "q_a", "q_norm": "cq", "wq_b": "q_b", "wkv": "kv_raw", "kv_norm": "kv_normed",
                "compressor.norm": "cmp_latent", "compressor.wgate": "cmp_b", "indexer.wq_b": "iq_b",
                "indexer.weights_proj": "iw_raw", "indexer.k_norm": "ik_normed", "indexer.wk": "ik_raw"}

    def hook(m, inp, out):
        l, n = names[id(m)]
        st = stage_of.get(n)
        if n == "compressor.wkv":
            st = "cmp_raw" if attns[l].compress_ratio == 1 else "cmp_a"
        if st:
            put(f"L{l}.{st}", out.squeeze(0).squeeze(0))

    for a in attns:
        for n, m in a.named_modules():
            if n in stage_of or n == "compressor.wkv":
                m.register_forward_hook(hook)

    sa = M.sparse_attn

    def sparse_attn(q, kv, sink, idx, scale):
        y = sa(q, kv, sink, idx, scale)
        put(lk("q"), q[0, 0])
        put(lk("kv_cache"), kv[0])
        put(lk("topk_idxs"), idx[0, 0].int())
        put(lk("o"), y[0, 0])
        return y

    M.sparse_attn = sparse_attn
    scb = M.select_candidate_blocks

    def select_candidate_blocks(*a, **k):
        mask = scb(*a, **k)
        put(lk("cand_mask"), mask.reshape(-1).int())
        return mask

    M.select_candidate_blocks = select_candidate_blocks
    ifw = M.Indexer.forward

    def indexer_forward(self, *a, **k):
        y = ifw(self, *a, **k)
        put(lk("index_sel"), y.reshape(-1).int())
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
        for l, a in enumerate(attns):
            if a.indexer is not None and a.indexer.owns_k and M.shared_attn.index_k is a.indexer.k_cache:
                return l
        return -1

    meta = {"prefill": o.prefill, "steps": o.steps, "seed": o.seed, "index_k_at": {}, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if dev == "cuda" else dev, "dry": DRY, "argmax": {}}
    with torch.inference_mode():
        ids, logits, _ = model(tokens[:, :o.prefill], 0)
        pre = {"prompt": tokens[0, :o.prefill].clone(), "decode_tokens": tokens[0, o.prefill:].clone(),
               "logits": logits[0].clone()}
        for l, a in enumerate(attns):
            pre.update(state(l, a, o.prefill))
        save_st(pre, os.path.join(o.out, "prefill_state.safetensors"))
        for p in range(o.prefill, T):
            meta["index_k_at"][str(p)] = index_k_at()
            rec.clear()
            seen.clear()
            on[0] = True
            put("token", tokens[0, p:p + 1])
            put("pos", torch.tensor([p], dtype=torch.int64))
            ids, logits, _ = model(tokens[:, p:p + 1], p)
            on[0] = False
            meta["argmax"][str(p)] = int(ids[0])
            for l, a in enumerate(attns):
                for k, v in state(l, a, p + 1).items():
                    if not k.endswith(".window") and not k.endswith(".ckv"):
                        rec[k] = v
            # each routed expert's output, in the gate's top-k order
            for l in range(args.n_layers):
                idx = rec[f"L{l}.moe_indices"].tolist()
                rec[f"L{l}.moe_expert_out"] = torch.stack([rec.pop(f"L{l}.moe_expert_out.{e}") for e in idx])
                for e in range(args.n_routed_experts):
                    assert f"L{l}.moe_expert_out.{e}" not in rec
                hp = rec.pop(f"L{l}.h_out_hc_post")
                assert torch.equal(hp, rec[f"L{l}.h_out"])
                assert torch.equal(rec[f"L{l}.x"], rec[f"L{l}.x"])
            bad = [k for k, v in rec.items() if v.is_floating_point() and not torch.isfinite(v.float()).all()
                   and not k.endswith("score_state")]
            meta.setdefault("nonfinite", {})[str(p)] = bad
            save_st(rec, os.path.join(o.out, f"step_{p}.safetensors"))
    cfg = dataclasses.asdict(args)
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}
    json.dump(cfg, open(os.path.join(o.out, "config.json"), "w"), indent=1)
    json.dump(meta, open(os.path.join(o.out, "meta.json"), "w"), indent=1)
    print("torch", torch.__version__, "device", dev, "wrote", sorted(os.listdir(o.out)))
    print(json.dumps(meta))
    amax = {k: float(v.float().abs().max()) for k, v in sorted(rec.items()) if v.is_floating_point() and v.numel()
            and k.split(".")[-1] in ("h_out", "y", "ffn_out", "x", "ffn_in", "logits")}
    print("last step max|.|:", json.dumps(amax))


if __name__ == "__main__":
    main()
