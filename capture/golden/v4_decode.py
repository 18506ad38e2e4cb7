"""Golden decode dump of the official DeepSeek-V4 model.py past the first window wrap.

Runs the UNMODIFIED release-day ``inference/model.py`` (deepseek-v4-flash-spark @ 0825add)
on a CUDA GPU with a tiny random config, prefills a prompt of S tokens, decodes one
teacher-forced token per step, and writes safetensors files whose keys and layout are those
of the official-v4-tiny golden (``L<l>.<stage>``; see testdata/gpu-v4-tiny-long/README.txt):

  config.json, rope_tables.safetensors, prefill_state.safetensors,
  step_<P>.safetensors   (selected decode steps: attention-path stages + state after P; a step
                          that is not selected but whose successor is keeps only its state
                          keys, so every dumped step has its start state),
  topk_facts.json        (top-k tie statistics for every decode step and CSA layer),
  checks.txt             (self-consistency checks of the dumped values).

The kernel functions ``model.py`` imports come from ``v4_kernels.py`` (a torch port of the
post-fix official TileLang kernels), registered as the modules ``kernel`` and
``fast_hadamard_transform``. Capture is done from outside: forward (pre-)hooks on the
official modules, and wrappers around the module-level functions model.py calls
(apply_rotary_emb, rotate_activation, act_quant, fp4_act_quant, sparse_attn,
hc_split_sinkhorn) and around torch.Tensor.topk (only while the indexer runs). Two values
that no hook sees are recomputed with the official expression on the same tensors:
``iw`` (weights_proj output times the scale) and ``index_qk`` (the einsum before ReLU).

Usage (on the GPU machine, model.py copied to MODEL_DIR):
  python capture/golden/v4_decode.py --model-dir MODEL_DIR --out OUT \
      [--weights weights.safetensors] [--prompt-len 126] [--last-pos 256] \
      [--dump-steps 126,127,128,255,256]
Without --weights, random weights are generated from --seed (see make_weights).

testdata/gpu-v4-tiny-long was made with the weights of the official-v4-tiny golden:
  python3 capture/golden/v4_decode.py --model-dir .gpu/F \
      --weights .gpu/F/weights.safetensors --out OUT/gpu-v4-tiny-long
"""

import argparse
import json
import math
import os
import sys
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

# Tiny config of the official-v4-tiny golden (ModelArgs fields; MTP disabled).
TINY_CONFIG = {
    "max_batch_size": 1, "max_seq_len": 512, "dtype": "fp8", "scale_fmt": "ue8m0",
    "expert_dtype": "fp4", "scale_dtype": "fp8", "vocab_size": 512, "dim": 256,
    "moe_inter_dim": 256, "n_layers": 4, "n_hash_layers": 1, "n_mtp_layers": 0,
    "n_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1, "n_activated_experts": 2,
    "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0,
    "q_lora_rank": 128, "head_dim": 512, "rope_head_dim": 64, "norm_eps": 1e-06,
    "o_groups": 2, "o_lora_rank": 128, "window_size": 128, "compress_ratios": [0, 4, 128, 4],
    "compress_rope_theta": 160000.0, "original_seq_len": 65536, "rope_theta": 10000.0,
    "rope_factor": 16.0, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 4,
    "index_head_dim": 128, "index_topk": 16, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
}

WEIGHT_SEED = 20260424


def import_model(model_dir):
    """Import the unmodified model.py with the kernel port standing in for kernel.py."""
    sys.path.insert(0, HERE)
    import v4_kernels
    sys.modules["kernel"] = v4_kernels
    sys.modules["fast_hadamard_transform"] = v4_kernels.hadamard_module()
    sys.path.insert(0, os.path.abspath(model_dir))
    import model as official
    return official, v4_kernels


# ---------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------

def make_weights(model, kernels, seed):
    """Random weights in the official state_dict layout, after the recipe of official-v4-tiny.

    That golden's README gives the formats and most distributions; where it gives none
    (hc_* parameters, gate bias, tid2eid) the choice below is ours, so these weights are NOT
    the official-v4-tiny ones (pass --weights with that file to reproduce its model).

    FP8 linears: W = bf16(N(0,1)/sqrt(in)), 128x128 block scale ceil2(f32(amax*f32(1/448))),
    E4M3_RNE(W/scale). FP4 experts: same W, scale ceil2(f32(amax*f32(1/6))) per 1x32 block,
    E2M1 RNE. bf16: embed N(0,1); wo_a FP8-quantised then dequantised; weights_proj and
    gate N(0,1)/sqrt(in). fp32 params hold bf16-representable values: norms 1+0.1N,
    compressor wkv/wgate and head N(0,1)/sqrt(in), ape 0.5N, attn_sink N(0,1); hc_*_fn
    N(0,1)/sqrt(in) * 0.1, hc_*_base 0.1N, hc_*_scale 0.5 + 0.1N (full fp32); gate bias 0.1N.
    tid2eid: the first k entries of a random permutation of the experts, per token.
    Tensors are drawn in state_dict order from one CPU generator, so the result only
    depends on the seed.
    """
    g = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float32, device="cpu")

    out = {}
    sd = model.state_dict()
    for name, p in sd.items():
        shape = tuple(p.shape)
        if name.endswith(".scale") and p.dtype == torch.float8_e8m0fnu and name[:-6] + ".weight" in sd:
            continue  # produced with its weight
        if p.dtype == torch.float8_e4m3fn:
            n_out, n_in = shape
            w = (randn(shape) / math.sqrt(n_in)).to(torch.bfloat16).float()
            q, s = _quant_fp8_blocks(w, kernels)
            out[name] = q
            out[name[:-7] + ".scale"] = s
        elif p.dtype == torch.float4_e2m1fn_x2:
            n_out, half = shape
            n_in = half * 2
            w = (randn((n_out, n_in)) / math.sqrt(n_in)).to(torch.bfloat16)
            packed, s = kernels.fp4_act_quant(w.cuda(), 32, False)
            out[name] = packed.view(torch.uint8).cpu().view(torch.float4_e2m1fn_x2)
            out[name[:-7] + ".scale"] = s.cpu()
        elif name.endswith("tid2eid"):
            n_vocab, k = shape
            n_exp = TINY_CONFIG["n_routed_experts"]
            rows = [torch.randperm(n_exp, generator=g, device="cpu")[:k] for _ in range(n_vocab)]
            out[name] = torch.stack(rows).to(torch.int32)
        elif p.dtype == torch.bfloat16:
            n_in = shape[-1]
            if name == "embed.weight":
                w = randn(shape)
            elif name.endswith("attn.wo_a.weight"):
                w = (randn(shape) / math.sqrt(n_in)).to(torch.bfloat16).float()
                q, s = _quant_fp8_blocks(w, kernels)
                w = _dequant_fp8_blocks(q, s, kernels)
            else:
                w = randn(shape) / math.sqrt(n_in)
            out[name] = w.to(torch.bfloat16)
        else:
            assert p.dtype == torch.float32, (name, p.dtype)
            r = randn(shape)
            short = name.split(".")[-1] if "." in name else name
            if "hc_" in name and name.endswith("_fn"):
                out[name] = r / math.sqrt(shape[-1]) * 0.1
            elif "hc_" in name and name.endswith("_base"):
                out[name] = r * 0.1
            elif "hc_" in name and name.endswith("_scale"):
                out[name] = 0.5 + 0.1 * r
            elif name.endswith("gate.bias"):
                out[name] = 0.1 * r
            elif "norm" in name:
                out[name] = (1 + 0.1 * r).to(torch.bfloat16).float()
            elif short == "ape":
                out[name] = (0.5 * r).to(torch.bfloat16).float()
            elif short == "attn_sink":
                out[name] = r.to(torch.bfloat16).float()
            else:
                out[name] = (r / math.sqrt(shape[-1])).to(torch.bfloat16).float()
    return out


def _quant_fp8_blocks(w, kernels):
    """Per 128x128 block: s = ceil2(f32(amax * f32(1/448))), q = E4M3_RNE(w / s)."""
    n_out, n_in = w.shape
    bo, bi = (n_out + 127) // 128, (n_in + 127) // 128
    wp = torch.zeros(bo * 128, bi * 128, dtype=torch.float32, device=w.device)
    wp[:n_out, :n_in] = w
    blocks = wp.view(bo, 128, bi, 128)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    inv = torch.tensor(kernels.FP8_MAX_INV, dtype=torch.float32, device=w.device)
    s = kernels.ceil2_bits(amax * inv)
    q = (blocks / s.view(bo, 1, bi, 1)).clamp(-448, 448).view(bo * 128, bi * 128)[:n_out, :n_in]
    return q.to(torch.float8_e4m3fn).contiguous(), kernels.f32_to_e8m0(s)


def _dequant_fp8_blocks(q, s, kernels):
    sf = kernels.e8m0_to_f32(s)
    n_out, n_in = q.shape
    sf = sf.repeat_interleave(128, 0)[:n_out].repeat_interleave(128, 1)[:, :n_in]
    return q.float() * sf


def load_weights(model, tensors):
    """Copy tensors (official names; raw-byte dtypes as U8) into the model's parameters in place."""
    sd = model.state_dict()
    missing = [k for k in sd if k not in tensors]
    assert not missing, f"weights missing: {missing[:5]}"
    with torch.no_grad():
        for name, p in sd.items():
            t = tensors[name]
            assert tuple(t.shape) == tuple(p.shape), (name, t.shape, p.shape)
            if p.dtype in (torch.float8_e8m0fnu, torch.float4_e2m1fn_x2):
                p.view(torch.uint8).copy_(t.view(torch.uint8))
            else:
                assert t.dtype == p.dtype, (name, t.dtype, p.dtype)
                p.copy_(t)


def save_weights(tensors, path):
    from safetensors.torch import save_file
    meta = {"content": "random tiny DeepSeek-V4 weights; names = official model.state_dict()"}
    out = {}
    for k, t in tensors.items():
        if t.dtype == torch.float8_e8m0fnu:
            meta[k] = "float8_e8m0fnu stored as raw uint8 bytes"
            t = t.view(torch.uint8)
        elif t.dtype == torch.float4_e2m1fn_x2:
            meta[k] = "float4_e2m1fn_x2 stored as raw uint8 bytes"
            t = t.view(torch.uint8)
        out[k] = t.contiguous()
    save_file(out, path, metadata=meta)


# ---------------------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------------------

class Capture:
    """Collects the stage tensors of one decode step, keyed L<layer>.<stage>.

    ``rec`` is None during the prefill (nothing recorded). A context stack says which
    official module is running: attn, indexer, cmp (main compressor), icmp (indexer
    compressor); ``refs`` keeps the live tensors that later in-place ops modify, so the
    value after each op can be cloned.
    """

    def __init__(self):
        self.rec = None
        self.layer = None
        self.stack = []
        self.refs = {}
        self.hc_calls = 0
        self.pos = None

    @property
    def ctx(self):
        return self.stack[-1] if self.stack else None

    def put(self, stage, t, shape=None):
        if self.rec is None:
            return
        t = t.detach().clone()
        if shape is not None:
            t = t.reshape(shape)
        self.rec[f"L{self.layer}.{stage}"] = t


def install_capture(official, model, args):
    cap = Capture()
    H, D = args.n_heads, args.head_dim
    HI, DI = args.index_n_heads, args.index_head_dim

    def push(name):
        def pre(mod, inp):
            cap.stack.append(name)
        return pre

    # --- module-level functions model.py calls (looked up in its namespace at call time)
    orig_rope = official.apply_rotary_emb

    def rope(x, freqs_cis, inverse=False):
        c = cap.ctx
        if c == "attn" and not inverse and x.ndim == 4:
            cap.put("q_pe_prerope", x[0, 0])
        y = orig_rope(x, freqs_cis, inverse)
        if c == "attn":
            if inverse:
                cap.put("o_inv", cap.refs["o"][0, 0])
            elif x.ndim == 3:
                cap.put("kv_roped", cap.refs["kv"][0, 0])
        elif c == "indexer":
            cap.put("iq_roped", cap.refs["iq"][0, 0], (HI, DI))
        elif c in ("cmp", "icmp"):
            cap.put(c + "_roped", cap.refs[c + "_norm"][0, 0])
        return y
    official.apply_rotary_emb = rope

    orig_rotate = official.rotate_activation

    def rotate(x):
        y = orig_rotate(x)
        if cap.ctx == "indexer":
            cap.put("iq_had", y[0, 0])
        elif cap.ctx == "icmp":
            cap.put("icmp_had", y[0, 0])
        return y
    official.rotate_activation = rotate

    orig_act_quant = official.act_quant

    def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
        y = orig_act_quant(x, block_size, scale_fmt, scale_dtype, inplace)
        if inplace and cap.ctx == "attn":
            cap.put("kv", cap.refs["kv"][0, 0])
        elif inplace and cap.ctx == "cmp":
            cap.put("cmp_row", cap.refs["cmp_norm"][0, 0])
        return y
    official.act_quant = act_quant

    orig_fp4 = official.fp4_act_quant

    def fp4_act_quant(x, block_size=32, inplace=False):
        y = orig_fp4(x, block_size, inplace)
        if inplace and cap.ctx == "indexer":
            cap.refs["iq_final"] = x
            cap.put("iq", x[0, 0])
        elif inplace and cap.ctx == "icmp":
            cap.put("icmp_row", x[0, 0])
        return y
    official.fp4_act_quant = fp4_act_quant

    orig_attn = official.sparse_attn

    def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
        o = orig_attn(q, kv, attn_sink, topk_idxs, softmax_scale)
        if cap.ctx == "attn":
            cap.put("q", q[0, 0])
            cap.put("topk_idxs", topk_idxs[0, 0])
            cap.put("o", o[0, 0])
            cap.refs["o"] = o
        return o
    official.sparse_attn = sparse_attn

    orig_hc = official.hc_split_sinkhorn

    def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
        pre, post, comb = orig_hc(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps)
        if cap.hc_calls == 0:  # first call of a block = the attention sub-layer
            cap.put("hc_attn_mixes", mixes[0, 0])
            cap.put("hc_attn_pre", pre[0, 0])
            cap.put("hc_attn_post", post[0, 0])
            cap.put("hc_attn_comb", comb[0, 0])
        cap.hc_calls += 1
        return pre, post, comb
    official.hc_split_sinkhorn = hc_split_sinkhorn

    # torch.Tensor.topk: record the exact tensor the indexer ranks.
    orig_topk = torch.Tensor.topk

    def topk(self, *a, **kw):
        if cap.ctx == "indexer":
            cap.put("index_score", self[0, 0])
        return orig_topk(self, *a, **kw)
    torch.Tensor.topk = topk

    # --- module hooks
    for l, blk in enumerate(model.layers):
        def blk_pre(mod, inp, l=l):
            cap.layer = l
            cap.hc_calls = 0
            cap.put("h_in", inp[0][0, 0])
        blk.register_forward_pre_hook(blk_pre)
        blk.attn_norm.register_forward_pre_hook(lambda m, inp: cap.put("attn_norm_in", inp[0][0, 0]))
        blk.attn_norm.register_forward_hook(lambda m, inp, out: cap.put("x", out[0, 0]))

        attn = blk.attn
        attn.register_forward_pre_hook(push("attn"))

        def attn_post(mod, inp, out):
            cap.put("y", out[0, 0])
            if cap.rec is not None:
                r = mod.compress_ratio
                tc = (cap.pos + 1) // r if r else 0
                cap.put("kv_cache", mod.kv_cache[0, :mod.window_size + tc])
                if getattr(mod, "indexer", None) is not None:
                    cap.put("icache", mod.indexer.kv_cache[0, :tc])
            cap.stack.pop()
        attn.register_forward_hook(attn_post)
        attn.wq_a.register_forward_hook(lambda m, inp, out: cap.put("q_a", out[0, 0]))
        attn.q_norm.register_forward_hook(lambda m, inp, out: cap.put("cq", out[0, 0]))
        attn.wq_b.register_forward_hook(lambda m, inp, out: cap.put("q_b", out[0, 0], (H, D)))
        attn.wkv.register_forward_hook(lambda m, inp, out: cap.put("kv_raw", out[0, 0]))

        def kv_norm_post(mod, inp, out):
            cap.refs["kv"] = out
            cap.put("kv_normed", out[0, 0])
        attn.kv_norm.register_forward_hook(kv_norm_post)
        attn.wo_b.register_forward_pre_hook(
            lambda m, inp: cap.put("u", inp[0][0, 0], (args.o_groups, args.o_lora_rank)))

        if attn.compress_ratio:
            install_compressor(cap, attn.compressor, "cmp", push)
        if getattr(attn, "indexer", None) is not None:
            idx = attn.indexer
            idx.register_forward_pre_hook(push("indexer"))

            def idx_post(mod, inp, out):
                if cap.rec is not None:
                    cap.put("index_sel", out[0, 0])
                    cap.put("index_topk", out[0, 0] - inp[3])  # inp[3] = offset (= window size)
                    iq = cap.refs["iq_final"]
                    tc = (cap.pos + 1) // mod.compress_ratio
                    qk = torch.einsum("bshd,btd->bsht", iq, mod.kv_cache[:1, :tc])
                    cap.put("index_qk", qk[0, 0])
                cap.stack.pop()
            idx.register_forward_hook(idx_post)

            def iwq_post(mod, inp, out):
                cap.refs["iq"] = out
                cap.put("iq_b", out[0, 0], (HI, DI))
            idx.wq_b.register_forward_hook(iwq_post)

            def iw_post(mod, inp, out, idx=idx):
                cap.put("iw_raw", out[0, 0])
                # model.py R-M:418, same expression on the same tensor
                cap.put("iw", (out * (idx.softmax_scale * idx.n_heads ** -0.5))[0, 0])
            idx.weights_proj.register_forward_hook(iw_post)
            install_compressor(cap, idx.compressor, "icmp", push)
    return cap


def install_compressor(cap, comp, name, push):
    comp.register_forward_pre_hook(push(name))

    def post(mod, inp, out):
        if cap.rec is not None:
            r = mod.compress_ratio
            if mod.overlap:
                kv, sc = mod.kv_state[0], mod.score_state[0]
            else:  # r = 128: only the live rows 0 .. p mod r
                n = cap.pos % r + 1
                kv, sc = mod.kv_state[0, :n], mod.score_state[0, :n]
            cap.put(name + "_kv_state", kv)
            cap.put(name + "_score_state", sc)
        cap.stack.pop()
    comp.register_forward_hook(post)
    comp.wkv.register_forward_hook(lambda m, inp, out: cap.put(name + "_a", out[0, 0]))
    comp.wgate.register_forward_hook(lambda m, inp, out: cap.put(name + "_b", out[0, 0]))
    comp.norm.register_forward_pre_hook(lambda m, inp: cap.put(name + "_pooled", inp[0][0, 0]))

    def norm_post(mod, inp, out):
        cap.refs[name + "_norm"] = out
        cap.put(name + "_normed", out[0, 0])
    comp.norm.register_forward_hook(norm_post)


# ---------------------------------------------------------------------------------------
# State snapshots, checks, facts
# ---------------------------------------------------------------------------------------

STATE_STAGES = ("kv_cache", "cmp_kv_state", "cmp_score_state", "icache", "icmp_kv_state", "icmp_score_state")


def prefill_state(model, S):
    """State after the prefill of S tokens: caches up to S div r rows, full compressor buffers."""
    st = {}
    for l, blk in enumerate(model.layers):
        a = blk.attn
        r = a.compress_ratio
        n = S // r if r else 0
        st[f"L{l}.kv_cache"] = a.kv_cache[0, :a.window_size + n].clone()
        if r:
            st[f"L{l}.cmp_kv_state"] = a.compressor.kv_state[0].clone()
            st[f"L{l}.cmp_score_state"] = a.compressor.score_state[0].clone()
        if getattr(a, "indexer", None) is not None:
            st[f"L{l}.icache"] = a.indexer.kv_cache[0, :n].clone()
            st[f"L{l}.icmp_kv_state"] = a.indexer.compressor.kv_state[0].clone()
            st[f"L{l}.icmp_score_state"] = a.indexer.compressor.score_state[0].clone()
    return st


def check_step(rec, pos, args, log):
    """Self-consistency of one step's capture; returns a list of failures (empty = fine)."""
    bad = []
    win = args.window_size
    for l, r in enumerate(args.compress_ratios):
        g = lambda s: rec[f"L{l}.{s}"]
        kvc = g("kv_cache")
        if not torch.equal(g("kv"), kvc[pos % win]):
            bad.append(f"L{l} kv != kv_cache[{pos % win}]")
        if r and (pos + 1) % r == 0:
            j = pos // r
            if not torch.equal(g("cmp_row"), kvc[win + j]):
                bad.append(f"L{l} cmp_row != kv_cache[{win + j}]")
            if r == 4 and not torch.equal(g("icmp_row"), g("icache")[j]):
                bad.append(f"L{l} icmp_row != icache[{j}]")
        if r == 4:
            sel = g("index_sel")
            if not torch.equal(g("topk_idxs")[win:].long(), sel):
                bad.append(f"L{l} topk_idxs[128:] != index_sel")
            score = (g("index_qk").relu() * g("iw").unsqueeze(-1)).sum(dim=0)
            if not torch.equal(score, g("index_score")):
                bad.append(f"L{l} recomputed index_score from index_qk/iw differs")
            k = min(args.index_topk, (pos + 1) // 4)
            again = g("index_score").topk(k)[1]
            if not torch.equal(again, sel - win):
                bad.append(f"L{l} topk(index_score) recomputed gives another order")
        for k, t in rec.items():
            if k.startswith(f"L{l}.") and t.is_floating_point() and "score_state" not in k:
                if not bool(torch.isfinite(t.float()).all()):
                    bad.append(f"{k} not finite")
    for b in bad:
        log(f"CHECK FAIL step {pos}: {b}")
    return bad


def topk_facts(rec, pos, args):
    """Tie statistics of the indexer top-k at one step (every CSA layer)."""
    out = []
    for l, r in enumerate(args.compress_ratios):
        if r != 4:
            continue
        score_bf16 = rec[f"L{l}.index_score"].cpu()
        score = score_bf16.float()
        sel = rec[f"L{l}.index_topk"].cpu()
        tc = score.numel()
        k = sel.numel()
        vals = score[sel]
        kth = float(vals[-1]) if k else None
        n_eq = int((score == kth).sum()) if k else 0
        n_sel_eq = int((vals == kth).sum()) if k else 0
        # order among equal scores inside the returned list
        groups, ascending = [], True
        i = 0
        while i < k:
            j = i
            while j + 1 < k and float(vals[j + 1]) == float(vals[i]):
                j += 1
            if j > i:
                grp = sel[i:j + 1].tolist()
                groups.append({"score": float(vals[i]), "rows": grp})
                if grp != sorted(grp):
                    ascending = False
            i = j + 1
        lowest_rule = None
        if k and n_eq > n_sel_eq:
            tied = sorted(torch.nonzero(score == kth).flatten().tolist())
            chosen = sorted([int(x) for x in sel.tolist() if float(score[x]) == kth])
            lowest_rule = chosen == tied[:n_sel_eq]
        out.append({
            "pos": pos, "layer": l, "Tc": tc, "k": k,
            "descending": bool((vals[:-1] >= vals[1:]).all()) if k > 1 else True,
            "kth_score": kth, "rows_equal_kth": n_eq, "selected_equal_kth": n_sel_eq,
            "boundary_tie": bool(k and n_eq > n_sel_eq),
            "boundary_tie_picks_lowest_rows": lowest_rule,
            "zero_scores": int((score == 0).sum()),
            "cpu_topk_same_order": bool(torch.equal(score_bf16.topk(k)[1], sel)) if k else True,
            "cpu_topk_same_set": (set(score_bf16.topk(k)[1].tolist()) == set(sel.tolist())) if k else True,
            "tie_groups_in_selection": groups,
            "ties_in_ascending_row_order": ascending,
        })
    return out


def to_cpu(d):
    return {k: v.detach().cpu().contiguous() for k, v in d.items()}


@torch.inference_mode()
def decode(model, cap, tokens, S, last, dump_steps, args, out, log):
    """Decode positions S..last one teacher-forced token each; write the selected steps."""
    from safetensors.torch import save_file
    facts, n_bad = [], 0
    for pos in range(S, last + 1):
        cap.rec, cap.pos = {}, pos
        model(tokens[pos].view(1, 1).cuda(), pos)
        rec = cap.rec
        cap.rec = None
        n_bad += len(check_step(rec, pos, args, log))
        facts.extend(topk_facts(rec, pos, args))
        if pos in dump_steps:
            rec = to_cpu(rec)
            rec["pos"] = torch.tensor([pos], dtype=torch.int64, device="cpu")
            rec["tok"] = tokens[pos].view(1).to(torch.int64).cpu()
            save_file(rec, os.path.join(out, f"step_{pos}.safetensors"),
                      metadata={"content": "one decode step; see README.txt", "pos": str(pos)})
        elif pos + 1 in dump_steps:
            # A step whose successor is dumped but which is not: keep only the state after it
            # (the start state of step pos+1), under the same keys as a full step file.
            st = to_cpu({k: v for k, v in rec.items() if k.split(".", 1)[1] in STATE_STAGES})
            st["pos"] = torch.tensor([pos], dtype=torch.int64, device="cpu")
            st["tok"] = tokens[pos].view(1).to(torch.int64).cpu()
            save_file(st, os.path.join(out, f"step_{pos}.safetensors"),
                      metadata={"content": f"state after decode step {pos} only "
                                           f"(start state of step {pos + 1}); see README.txt",
                                "pos": str(pos), "state_only": "true"})
    return facts, n_bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="folder holding the official model.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--weights", help="load these weights (official names) instead of generating")
    ap.add_argument("--save-weights", action="store_true", help="write weights.safetensors too")
    ap.add_argument("--seed", type=int, default=WEIGHT_SEED)
    ap.add_argument("--prompt-len", type=int, default=126)
    ap.add_argument("--last-pos", type=int, default=256)
    ap.add_argument("--dump-steps", default="126,127,128,255,256")
    opt = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(0)
    os.makedirs(opt.out, exist_ok=True)
    logf = open(os.path.join(opt.out, "checks.txt"), "w")

    def log(msg):
        print(msg)
        logf.write(msg + "\n")

    official, kernels = import_model(opt.model_dir)
    from safetensors.torch import load_file, save_file
    args = official.ModelArgs(**TINY_CONFIG)
    with torch.device("cuda"):
        model = official.Transformer(args)
    torch.set_default_device("cuda")

    if opt.weights:
        tensors = load_file(opt.weights)
        log(f"weights: loaded {opt.weights}")
    else:
        with torch.device("cpu"):
            tensors = make_weights(model, kernels, opt.seed)
        log(f"weights: generated, seed {opt.seed}")
    load_weights(model, tensors)
    if opt.save_weights:
        save_weights(tensors, os.path.join(opt.out, "weights.safetensors"))

    with open(os.path.join(opt.out, "config.json"), "w") as f:
        json.dump(TINY_CONFIG, f, indent=2)

    rope = {}
    for l, r in enumerate(args.compress_ratios):
        key = "freqs_cis_cmp" if r else "freqs_cis_r0"
        if key not in rope:
            rope[key] = torch.view_as_real(model.layers[l].attn.freqs_cis).float().contiguous()
    save_file(to_cpu(rope), os.path.join(opt.out, "rope_tables.safetensors"),
              metadata={"content": "freqs_cis as [max_seq_len, 32, (cos, sin)] fp32, built on the GPU"})

    S, last = opt.prompt_len, opt.last_pos
    dump_steps = sorted(int(x) for x in opt.dump_steps.split(",") if x)
    assert all(S <= p <= last for p in dump_steps)
    g = torch.Generator().manual_seed(7 + S)
    tokens = torch.randint(0, args.vocab_size, (last + 1,), generator=g, device="cpu")
    prompt, decode_tokens = tokens[:S], tokens[S:]

    log("kernel self-test: " + kernels.selftest())
    cap = install_capture(official, model, args)
    logits = model(prompt.view(1, S).cuda(), 0)
    pre = prefill_state(model, S)
    pre.update({"prompt": prompt, "decode_tokens": decode_tokens, "logits": logits[0].float()})
    save_file(to_cpu(pre), os.path.join(opt.out, "prefill_state.safetensors"),
              metadata={"content": f"state after the prefill (start_pos 0) of S = {S} tokens; see README.txt",
                        "prompt_len": str(S)})
    log(f"prefill S={S} done; decode {S}..{last}; dump {dump_steps}")

    facts, n_bad = decode(model, cap, tokens, S, last, dump_steps, args, opt.out, log)
    with open(os.path.join(opt.out, "topk_facts.json"), "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(x, separators=(",", ":")) for x in facts) + "\n]\n")
    ties = [x for x in facts if x["boundary_tie"]]
    log(f"steps {S}..{last}: {n_bad} check failures")
    log(f"top-k: {len(facts)} (step, CSA layer) selections, {len(ties)} with a tie at the k-th place")
    for x in ties:
        log(f"  boundary tie: pos {x['pos']} L{x['layer']} Tc {x['Tc']} kth {x['kth_score']} "
            f"equal {x['rows_equal_kth']} selected {x['selected_equal_kth']} "
            f"picks-lowest-rows {x['boundary_tie_picks_lowest_rows']}")
    unordered = [x for x in facts if not x["ties_in_ascending_row_order"]]
    log(f"top-k: {len(unordered)} selections return tied scores in non-ascending row order")
    cpu_order = sum(not x["cpu_topk_same_order"] for x in facts)
    cpu_set = sum(not x["cpu_topk_same_set"] for x in facts)
    log(f"top-k: torch.topk of the same bf16 scores on the CPU: {cpu_order} selections in another order, "
        f"{cpu_set} with another set")
    logf.close()


if __name__ == "__main__":
    main()
