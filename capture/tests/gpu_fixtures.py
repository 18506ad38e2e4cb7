"""GPU fixtures for sparsemla issue 14 (run on the CUDA machine; writes into $OUT).

Every part runs in its own try/except and writes its own log ($OUT/work/logs/<part>.log),
so one failure does not lose the rest. Parts:

  hf_build     a tiny random DeepseekV4ForCausalLM (transformers, the official-v4-tiny
               shapes: dim 256, 4 layers with compress ratios [0, 4, 128, 4], 4 heads of 512,
               window 128, indexer 4 x 128 top-16, hc 4; small MoE), saved with
               save_pretrained (index + shards), reloaded in bf16 as HF runs it; its
               config.json, state_dict names and named_modules are written.
  hf_eager     prompt of S tokens, decode steps P = S .. S+N-1 eagerly, captured with
               sparsemla_capture hooks (HF module names -> canonical stages), plus start
               state, GPU RoPE tables, pos/tok, a simulated TP=2 pair of dumps (q_b
               sharded by heads) and a batch-2 run split by request.
  hf_graph     the same decode under torch.cuda.graph: each step captured (hooks record
               copies into static buffers inside the graph), replayed, written by
               graph_replayed(); replayed a second time to check the buffers refill.
  sglang       the real SGLang dumper.py (fetched source, DUMPER_* environment) on the same
               tiny model: non-intrusive hooks (mode all, filtered), explicit dumps of
               positions / input_ids, and a .pt of every dtype; the older
               --debug-tensor-dump-output-folder hook (tensor_dump_forward_hook.py) too.
  pt_zoo       torch.save files of every dtype, views with offsets/strides, shared storage.

Usage: FETCHED=<dir with dumper.py, tensor_dump_forward_hook.py> python3 gpu_fixtures.py
"""
import json
import os
import sys
import tarfile
import time
import traceback
import types

import torch

OUT = os.environ.get("OUT", "out")
WORK = "/tmp/sparsemla_work"   # outside $OUT: only the tar files come back
LOGS = os.path.join(WORK, "logs")
os.makedirs(LOGS, exist_ok=True)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
FETCHED = os.environ.get("FETCHED", os.path.join(HERE, "..", "..", ".gpufetched"))
DEV = "cuda"
S = 2          # prompt length
NSTEPS = 8     # decode steps P = S .. S+NSTEPS-1
H, D, IH, ID, G = 4, 512, 4, 128, 2
STATE = {}


_TORCH_TENSOR = torch.tensor


def _graph_safe_tensor(data, *args, **kwargs):
    """torch.tensor, except that a Python scalar put on a CUDA device while a
    CUDA graph is captured becomes torch.full((), data) on that device: the
    same value, made by a fill kernel the graph can record, where torch.tensor
    copies it from pageable host memory, which capture refuses ("Cannot copy
    between CPU and CUDA tensors during CUDA graph capture"). transformers'
    masking_utils.eager_mask does `torch.where(mask, torch.tensor(0.0,
    device=mask.device, dtype=dtype), min_dtype)` in every forward."""
    dev = kwargs.get("device")
    if (isinstance(data, (bool, int, float)) and not args and dev is not None
            and torch.device(dev).type == "cuda" and torch.cuda.is_current_stream_capturing()):
        dt = kwargs.get("dtype")
        if dt is None:
            dt = torch.bool if isinstance(data, bool) else (torch.int64 if isinstance(data, int)
                                                               else torch.get_default_dtype())
        GRAPH_SAFE_USED.add(dt)
        return torch.full((), data, dtype=dt, device=dev)
    return _TORCH_TENSOR(data, *args, **kwargs)


GRAPH_SAFE_USED = set()


class graph_safe_scalars:
    """Within the block, torch.tensor(<scalar>, device=cuda) is capturable."""

    def __enter__(self):
        torch.tensor = _graph_safe_tensor

    def __exit__(self, *exc):
        torch.tensor = _TORCH_TENSOR


def cache_tensors(cache):
    """Every tensor HF's cache holds now: kept referenced across a graph capture
    and its replays, so that memory the graph reads (the previous step's cache
    rows, which the captured step replaces in the cache object) is not handed
    out again by the caching allocator before the replays are done."""
    out = []
    for lay in getattr(cache, "layers", []):
        for v in vars(lay).values():
            if torch.is_tensor(v):
                out.append(v)
            elif isinstance(v, dict):
                out += [t for t in v.values() if torch.is_tensor(t)]
    return out


class Log:
    def __init__(self, part):
        self.f = open(os.path.join(LOGS, part + ".log"), "w")

    def __call__(self, *a):
        msg = " ".join(str(x) for x in a)
        print(msg, flush=True)
        self.f.write(msg + "\n")
        self.f.flush()


def tar(name, paths):
    fn = os.path.join(OUT, name)
    with tarfile.open(fn, "w:gz") as t:
        for p in paths:
            if os.path.exists(p):
                t.add(p, arcname=os.path.relpath(p, WORK))
    print("tar", name, os.path.getsize(fn), flush=True)


def part(fn):
    name = fn.__name__
    log = Log(name)
    t0 = time.time()
    try:
        fn(log)
        log("PART %s: ok (%.1fs)" % (name, time.time() - t0))
        STATE[name] = "ok"
    except Exception:
        log(traceback.format_exc())
        log("PART %s: FAILED (%.1fs)" % (name, time.time() - t0))
        STATE[name] = "failed"


OFFICIAL_ARGS = {
    "max_batch_size": 2, "max_seq_len": 512, "dtype": "bf16", "scale_fmt": "ue8m0", "expert_dtype": "bf16",
    "vocab_size": 512, "dim": 256, "moe_inter_dim": 64, "n_layers": 4, "n_hash_layers": 1, "n_mtp_layers": 0,
    "n_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1, "n_activated_experts": 2,
    "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 128,
    "head_dim": 512, "rope_head_dim": 64, "norm_eps": 1e-06, "o_groups": 2, "o_lora_rank": 128,
    "window_size": 128, "compress_ratios": [0, 4, 128, 4], "compress_rope_theta": 160000.0,
    "original_seq_len": 65536, "rope_theta": 10000.0, "rope_factor": 16.0, "beta_fast": 32, "beta_slow": 1,
    "index_n_heads": 4, "index_head_dim": 128, "index_topk": 16, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
}
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]


def hf_config():
    from transformers import DeepseekV4Config
    kw = dict(vocab_size=512, hidden_size=256, moe_intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=1, head_dim=512, q_lora_rank=128,
              num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, scoring_func="sqrtsoftplus",
              routed_scaling_factor=1.5, max_position_embeddings=512, rope_theta=10000.0,
              layer_types=LAYER_TYPES, compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20,
              hc_eps=1e-6, mlp_layer_types=["hash_moe", "moe", "moe", "moe"], swiglu_limit=10.0,
              sliding_window=128, o_groups=2, o_lora_rank=128, index_n_heads=4, index_head_dim=128,
              index_topk=16, num_nextn_predict_layers=0, rms_norm_eps=1e-6, partial_rotary_factor=64 / 512,
              tie_word_embeddings=False)
    try:
        return DeepseekV4Config(**kw, rope_parameters={"rope_type": "yarn", "factor": 16.0,
                                                       "original_max_position_embeddings": 65536,
                                                       "beta_fast": 32.0, "beta_slow": 1.0}), "yarn"
    except Exception as e:
        print("yarn rope_parameters refused:", e)
        return DeepseekV4Config(**kw), "default"


def new_cache(model):
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


def prefill(model, cache, toks):
    ids = torch.tensor([toks[:S]], device=DEV)
    pos = torch.arange(S, device=DEV)[None]
    return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits


@part
def hf_build(log):
    import transformers
    from transformers import DeepseekV4ForCausalLM
    log("torch", torch.__version__, "transformers", transformers.__version__, "gpu", torch.cuda.get_device_name())
    cfg, rope = hf_config()
    log("rope", rope, "rope_parameters", cfg.rope_parameters)
    torch.manual_seed(14)
    m = DeepseekV4ForCausalLM(cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in m.named_parameters():
            # HF initialises these to zeros / ones: random values make the fixture see them.
            if n.endswith("sinks") or n.endswith("position_bias") or n.endswith(".base"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for n, b in m.named_buffers():
            if n.endswith("tid2eid"):
                t = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(b.shape[0])])
                b.copy_(t)
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.01)
    ck = os.path.join(WORK, "hf_ckpt")
    m.save_pretrained(ck, max_shard_size="6MB")
    log("save_pretrained:", sorted(os.listdir(ck)))
    names = {n: [list(t.shape), str(t.dtype)] for n, t in m.state_dict().items()}
    json.dump(names, open(os.path.join(WORK, "hf_state_dict.json"), "w"), indent=0)
    try:
        model = DeepseekV4ForCausalLM.from_pretrained(ck, dtype=torch.bfloat16, experts_implementation="batched_mm")
        impl = "batched_mm (from_pretrained experts_implementation)"
    except Exception as e:
        log("from_pretrained(experts_implementation=batched_mm) refused:", repr(e))
        model = DeepseekV4ForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)
        impl = "default"
    model = model.to(DEV).eval()
    # transformers keeps input_layernorm / q_a_norm / kv_norm / norm in fp32
    # (_keep_in_fp32_modules_strict); their fp32 outputs then meet bf16 Linear
    # weights (RuntimeError: mat1 and mat2 dtypes). Cast what is needed, log it.
    cast = []
    for attempt in ("as loaded", "norms to bf16", "all bf16"):
        try:
            with torch.no_grad():
                prefill(model, new_cache(model), list(range(S)))
            break
        except RuntimeError as e:
            log("forward failed (%s): %s" % (attempt, e))
            if attempt == "all bf16":
                raise
            if attempt == "as loaded":
                for n, mm in model.named_modules():
                    if type(mm).__name__ == "DeepseekV4RMSNorm" and mm.weight.dtype != torch.bfloat16:
                        mm.to(torch.bfloat16)
                        cast.append(n)
            else:
                model.to(torch.bfloat16)
                cast.append("<all>")
    log("cast to bf16:", cast)
    STATE["cast"] = cast
    ck2 = os.path.join(WORK, "hf_ckpt_bf16")
    model.save_pretrained(ck2, max_shard_size="5MB")
    log("save_pretrained (bf16 as run):", sorted(os.listdir(ck2)))
    log("experts implementation:", impl, "config:", getattr(model.config, "_experts_implementation", None),
        "attn:", model.config._attn_implementation)
    STATE["model"], STATE["cfg"] = model, cfg
    toks = list(range(5, 5 + S + 1))
    for attempt in ("as loaded", "dense sync-free experts"):
        try:
            with torch.no_grad():
                wc = new_cache(model)
                prefill(model, wc, toks)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    model(input_ids=torch.tensor([[toks[S]]], device=DEV), position_ids=torch.tensor([[S]], device=DEV),
                          past_key_values=new_cache(model), use_cache=True)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                sid, spos = torch.tensor([[toks[S]]], device=DEV), torch.tensor([[S]], device=DEV)  # static inputs:
                with graph_safe_scalars(), torch.cuda.graph(g):  # made before the capture (a host->device copy cannot be captured)
                    model(input_ids=sid, position_ids=spos, past_key_values=wc, use_cache=True)
                g.replay()
                torch.cuda.synchronize()
                del g, wc
            log("graph capture probe ok:", attempt, "torch.tensor scalars made capturable:", sorted(map(str, GRAPH_SAFE_USED)))
            break
        except Exception as e:
            log("graph capture probe failed (%s): %r" % (attempt, e))
            log(traceback.format_exc()[-3000:])
            torch.cuda.synchronize()
            if attempt != "as loaded":
                log("graph capture probe failed twice: hf_graph will report its own error")
                break
            import torch.nn.functional as F
            from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdv4

            def dense_forward(self, hidden_states, top_k_index, top_k_weights):
                # every expert on every token, weighted by its routing weight (0 if not routed): no host sync
                final = torch.zeros_like(hidden_states)
                for e in range(self.num_experts):
                    w = (top_k_weights * (top_k_index == e).to(top_k_weights.dtype)).sum(-1)
                    cur = self._apply_gate(F.linear(hidden_states, self.gate_up_proj[e]))
                    cur = F.linear(cur, self.down_proj[e]) * w[:, None]
                    final = final + cur.to(final.dtype)
                return final
            for mm in model.modules():
                if type(mm).__name__ == "DeepseekV4Experts":
                    mm.forward = types.MethodType(dense_forward, mm)
            impl = "dense sync-free experts (patched: HF's eager experts loop calls .nonzero(), not capturable)"
    STATE["impl"] = impl
    mods = [(n, type(mm).__name__) for n, mm in model.named_modules()]
    json.dump(mods, open(os.path.join(WORK, "hf_named_modules.json"), "w"), indent=0)
    json.dump({n: str(p.dtype) for n, p in model.named_parameters()},
              open(os.path.join(WORK, "hf_loaded_dtypes.json"), "w"), indent=0)
    STATE["rope"] = rope
    g = torch.Generator().manual_seed(7)
    STATE["tokens"] = torch.randint(0, 512, (S + NSTEPS,), generator=g).tolist()
    STATE["tokens_b"] = torch.randint(0, 512, (S + NSTEPS,), generator=g).tolist()
    json.dump({"tokens": STATE["tokens"], "tokens_b": STATE["tokens_b"]}, open(os.path.join(WORK, "tokens.json"), "w"))


def _rules():
    from sparsemla_capture import hf_deepseek_v4_rules
    return hf_deepseek_v4_rules(H, D, IH, ID)


RULES = _rules()


def dump_cache(d, model, cache, p, kind, log=None):
    """Canonical kv_cache / icache rows from HF's cache, and HF's raw compressor state."""
    W = model.config.sliding_window
    for li, lay in enumerate(cache.layers):
        keys = getattr(lay, "keys", None)
        if keys is None or not torch.is_tensor(keys):
            continue
        n = keys.shape[2]
        comp = getattr(lay, "compressed_kv", {}) or {}
        ck = comp.get("compressor")
        tc = 0 if ck is None else ck.shape[1]
        rows = torch.zeros(W + tc, D, dtype=keys.dtype, device=keys.device)
        for j, t in enumerate(range(p - n + 1, p + 1)):
            rows[t % W] = keys[0, 0, j]
        if tc:
            rows[W:] = ck[0]
        kw = dict(layer=li, step=p, kind=kind)
        d.dump("kv_cache", rows, **kw)
        ik = comp.get("indexer")
        if ik is not None and ik.shape[1]:
            d.dump("icache", ik[0], **kw)
        for attr in ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"):
            for nm, t in (getattr(lay, attr, {}) or {}).items():
                if torch.is_tensor(t) and t.numel():
                    d.dump("hf_%s_%s" % (attr, nm), t[0], **kw)
        ec = getattr(lay, "entry_count", None)
        if ec:
            for nm, c in ec.items():
                d.dump("hf_entry_count_%s" % nm, torch.tensor([c], dtype=torch.int64), **kw)


def rope_tables(d, model):
    """HF's cos/sin as its forward uses them: DeepseekV4RotaryEmbedding returns
    `cos.to(dtype=x.dtype)` for x = inputs_embeds (bf16), so the tables are the
    bf16-rounded cos/sin, stored as f32 (exact)."""
    T = model.config.max_position_embeddings
    x = torch.zeros(1, T, 8, device=DEV, dtype=model.model.embed_tokens.weight.dtype)
    pos = torch.arange(T, device=DEV)[None]
    for lt, name in (("main", "freqs_cis_r0"), ("compress", "freqs_cis_cmp")):
        cos, sin = model.model.rotary_emb(x, position_ids=pos, layer_type=lt)
        d.dump_table(name, torch.stack([cos[0].float(), sin[0].float()], dim=-1))


def header(mode):
    import transformers
    return dict(config=OFFICIAL_ARGS, dtype_policy={"policy": "hf-eager", "activations": "bf16", "linear": "bf16",
                                                      "kv_cache": "bf16"},
                producer={"engine": "transformers DeepseekV4ForCausalLM", "engine_revision": transformers.__version__,
                          "mode": mode, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                          "experts_implementation": str(STATE.get("impl")),
                          "cast_to_bf16": ",".join(STATE.get("cast", []))},
                user={"hf_config": json.dumps(STATE["cfg"].to_dict(), default=str), "rope": STATE["rope"]})


@part
def hf_eager(log):
    from sparsemla_capture import Dumper, hook_modules
    model, toks = STATE["model"], STATE["tokens"]
    out = os.path.join(WORK, "hf_eager")
    d = Dumper(out, split="step", **header("eager"))
    tp = [Dumper(os.path.join(WORK, "hf_tp2"), split="step", tp_rank=r, tp_size=2, **header("eager-tp2-simulated"))
          for r in range(2)]
    last = {}
    hs = hook_modules(model, d, RULES)
    for li in range(4):
        hs.append(model.model.layers[li].self_attn.q_b_proj.register_forward_hook(
            lambda m, a, o, li=li: last.__setitem__(li, o.detach().clone())))
        hs.append(model.model.layers[li].self_attn.register_forward_pre_hook(
            lambda m, a, kw, li=li: last.__setitem__(("x", li), (a[0] if a else kw["hidden_states"]).detach().clone()),
            with_kwargs=True))
    cache = new_cache(model)
    with torch.no_grad():
        d.enabled = False
        prefill(model, cache, toks)
        d.enabled = True
        dump_cache(d, model, cache, S - 1, "state")
        rope_tables(d, model)
        logits = []
        for p in range(S, S + NSTEPS):
            with d.at(step=p):
                ids = torch.tensor([[toks[p]]], device=DEV)
                out_l = model(input_ids=ids, position_ids=torch.tensor([[p]], device=DEV), past_key_values=cache,
                              use_cache=True).logits
                d.dump("pos", torch.tensor([p], dtype=torch.int64))
                d.dump("tok", torch.tensor([toks[p]], dtype=torch.int64))
                dump_cache(d, model, cache, p, "stage")
                logits.append(out_l.float().cpu())
            for r in range(2):
                with tp[r].at(step=p):
                    for li in range(4):
                        q = last[li].reshape(H, D)
                        tp[r].dump("q_b", q[r * H // 2:(r + 1) * H // 2], layer=li, shard_dim=0)
                        tp[r].dump("x", last[("x", li)].reshape(-1), layer=li)   # replicated
        for h in hs:
            h.remove()
    d.close()
    for t in tp:
        t.close()
    STATE["eager_logits"] = torch.cat(logits)
    log("eager files:", sorted(os.listdir(out))[:5], "... errors:", d.errors)
    log("tp files:", sorted(os.listdir(os.path.join(WORK, "hf_tp2")))[:6])

    # batch 2, split by request
    db = Dumper(os.path.join(WORK, "hf_batch2"), split="step", **header("eager-batch2"))
    hs = hook_modules(model, db, [r for r in RULES if r[1] in ("x", "q_a", "cq", "q_b", "kv_raw", "kv_normed", "u",
                                                                 "y", "o_inv", "q_pe_prerope", "h_in", "h_out")])
    cache = new_cache(model)
    tb = STATE["tokens_b"]
    with torch.no_grad():
        db.enabled = False
        ids = torch.tensor([toks[:S], tb[:S]], device=DEV)
        model(input_ids=ids, position_ids=torch.arange(S, device=DEV)[None].expand(2, -1), past_key_values=cache,
              use_cache=True)
        db.enabled = True
        for p in range(S, S + 3):
            with db.at(requests=["rA", "rB"], steps=[p, p]):
                ids = torch.tensor([[toks[p]], [tb[p]]], device=DEV)
                model(input_ids=ids, position_ids=torch.tensor([[p], [p]], device=DEV), past_key_values=cache,
                      use_cache=True)
    for h in hs:
        h.remove()
    db.close()
    log("batch2 files:", sorted(os.listdir(os.path.join(WORK, "hf_batch2"))), "errors:", db.errors)


@part
def hf_graph(log):
    from sparsemla_capture import Dumper, hook_modules
    model, toks = STATE["model"], STATE["tokens"]
    out = os.path.join(WORK, "hf_graph")
    d = Dumper(out, split="step", **header("cuda-graph"))
    hs = hook_modules(model, d, RULES)
    cache = new_cache(model)
    logits, refill = [], []
    with torch.no_grad():
        d.enabled = False
        prefill(model, cache, toks)
        # warm-up on a side stream with a throwaway cache (cuBLAS handles, allocator)
        wc = new_cache(model)
        prefill(model, wc, toks)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(input_ids=torch.tensor([[toks[S]]], device=DEV), position_ids=torch.tensor([[S]], device=DEV),
                  past_key_values=wc, use_cache=True)
        torch.cuda.current_stream().wait_stream(s)
        del wc
        d.enabled = True
        dump_cache(d, model, cache, S - 1, "state")
        rope_tables(d, model)
        d.flush()
        for p in range(S, S + NSTEPS):
            sid = torch.tensor([[toks[p]]], device=DEV)
            spos = torch.tensor([[p]], device=DEV)
            g = torch.cuda.CUDAGraph()
            keep = cache_tensors(cache)
            with d.graph_capture("decode"):
                with graph_safe_scalars(), torch.cuda.graph(g):
                    o = model(input_ids=sid, position_ids=spos, past_key_values=cache, use_cache=True).logits
            nbuf = len(d._graph_bufs["decode"])
            g.replay()
            torch.cuda.synchronize()
            d.graph_replayed("decode", step=p)
            first = o.float().cpu().clone()
            bufs = [b.clone() for _, b, *_ in d._graph_bufs["decode"]]
            # replay again: the same inputs and the same (already updated) cache
            # tensors, so the static buffers refill with the same values
            g.replay()
            torch.cuda.synchronize()
            same = all(torch.equal(a, b) for a, (_, b, *_) in zip(bufs, d._graph_bufs["decode"]))
            refill.append(same and torch.equal(first, o.float().cpu()))
            with d.at(step=p):
                d.dump("pos", torch.tensor([p], dtype=torch.int64))
                d.dump("tok", torch.tensor([toks[p]], dtype=torch.int64))
                dump_cache(d, model, cache, p, "stage")
            logits.append(first)
            log("step", p, "graph buffers", nbuf, "second replay identical", refill[-1])
            del g, keep
    for h in hs:
        h.remove()
    d.close()
    gl = torch.cat(logits)
    el = STATE.get("eager_logits")
    if el is not None:
        log("graph vs eager logits bit-identical:", torch.equal(gl, el), "max abs diff", (gl - el).abs().max().item())
    log("errors:", d.errors, "all second replays identical:", all(refill))


@part
def compare(log):
    """The CUDA-graph dump against the eager one, record for record and byte for byte."""
    from sparsemla_capture import read
    ea, gr = os.path.join(WORK, "hf_eager"), os.path.join(WORK, "hf_graph")
    fe, fg = sorted(os.listdir(ea)), sorted(os.listdir(gr))
    log("files eager", fe, "graph", fg)
    bad = 0
    for f in sorted(set(fe) | set(fg)):
        if f not in fe or f not in fg:
            log("only in one:", f)
            bad += 1
            continue
        he, re_, _, ce = read(os.path.join(ea, f))
        hg, rg, _, cg = read(os.path.join(gr, f))
        ke = {(m["request"], m["step"], m["layer"], m["stage"], m["kind"]): (m["dtype"], t) for m, t in re_}
        kg = {(m["request"], m["step"], m["layer"], m["stage"], m["kind"]): (m["dtype"], t) for m, t in rg}
        if set(ke) != set(kg):
            log(f, "record keys differ: eager only", sorted(set(ke) - set(kg))[:10], "graph only",
                sorted(set(kg) - set(ke))[:10])
            bad += 1
        nd = 0
        for k in sorted(set(ke) & set(kg)):
            (de, te), (dg, tg) = ke[k], kg[k]
            if de != dg or list(te.shape) != list(tg.shape) or \
                    te.contiguous().view(-1).view(torch.uint8).tolist() != tg.contiguous().view(-1).view(torch.uint8).tolist():
                nd += 1
                if nd <= 5:
                    log(f, "differs:", k, de, dg, list(te.shape), list(tg.shape))
        bad += nd
        log(f, "records", len(ke), len(kg), "differing", nd, "complete", ce, cg)
    log("graph dump vs eager dump:", "IDENTICAL" if bad == 0 else "%d differences" % bad)


for _name, _paths in (("hf_dumps.tgz", [os.path.join(WORK, x) for x in ("hf_eager", "hf_graph", "hf_tp2", "hf_batch2")]),
                      ("hf_ckpt.tgz", [os.path.join(WORK, "hf_ckpt_bf16")]),
                      ("logs.tgz", [LOGS, os.path.join(WORK, "hf_state_dict.json"), os.path.join(WORK, "hf_named_modules.json"),
                 os.path.join(WORK, "hf_loaded_dtypes.json"), os.path.join(WORK, "tokens.json")])):
    try:  # the HF fixtures come back even if a later part hangs
        tar(_name, _paths)
    except Exception:
        traceback.print_exc()


@part
def sglang(log):
    model, toks = STATE["model"], STATE["tokens"]
    root = os.path.join(WORK, "sglang")
    flt = ("search(r'(self_attn\\.(q_a_proj|q_a_norm|q_b_proj|kv_proj|kv_norm|o_a_proj|o_b_proj)|"
           "compressor\\.(kv_proj|gate_proj)|indexer\\.q_b_proj|layers\\.\\d+)\\.(output|inputs\\.0)$', name) "
           "or name in ('positions', 'input_ids') or name.startswith('dtype_')")
    os.environ.update(DUMPER_ENABLE="1", DUMPER_DIR=root, DUMPER_EXP_NAME="sglang_v4_tiny",
                      DUMPER_NON_INTRUSIVE_MODE="all", DUMPER_ENABLE_OUTPUT_CONSOLE="0", DUMPER_FILTER=flt)
    sys.path.insert(0, FETCHED)
    import dumper as sgl  # the fetched SGLang dumper.py, unmodified
    dumper = sgl.dumper
    log("dumper config:", sgl.DumperConfig.from_env())
    ni = dumper.register_non_intrusive_dumper(model)
    cache = new_cache(model)
    with torch.no_grad():
        dumper.configure(enable=False)
        prefill(model, cache, toks)
        dumper.configure(enable=True)
        for p in range(S, S + 3):
            ids = torch.tensor([[toks[p]]], device=DEV)
            pos = torch.tensor([[p]], device=DEV)
            dumper.dump("positions", pos.reshape(-1))
            dumper.dump("input_ids", ids.reshape(-1))
            model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
            if p == S:
                zoo = {"dtype_bf16": torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16),
                       "dtype_f16": torch.tensor([65504.0, -1.0], dtype=torch.float16),
                       "dtype_f32": torch.tensor([1.5, float("inf")]),
                       "dtype_f64": torch.tensor([0.25, -3.0], dtype=torch.float64),
                       "dtype_i8": torch.tensor([-1, 5], dtype=torch.int8),
                       "dtype_i16": torch.tensor([-32768], dtype=torch.int16),
                       "dtype_i32": torch.tensor([-1, 130], dtype=torch.int32),
                       "dtype_i64": torch.tensor([1 << 40], dtype=torch.int64),
                       "dtype_u8": torch.tensor([255, 0], dtype=torch.uint8),
                       "dtype_bool": torch.tensor([True, False]),
                       "dtype_e4m3": torch.tensor([448.0, 1.0, -0.5]).to(torch.float8_e4m3fn),
                       "dtype_e5m2": torch.tensor([1.0, -57344.0]).to(torch.float8_e5m2),
                       "dtype_e8m0": torch.tensor([1.0, 8.0, 2.0 ** -10]).to(torch.float8_e8m0fnu)}
                for k, v in zoo.items():
                    dumper.dump(k, v.to(DEV))
            dumper.step()
    ni.remove()
    dumper.configure(enable=False)
    files = []
    for dp, _, fs in os.walk(root):
        files += fs
    log("sglang dumper files:", len(files), sorted(files)[:8])

    # the older --debug-tensor-dump-output-folder hook (needs two sglang classes: stubbed)
    for modname in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.logits_processor",
                    "sglang.srt.model_executor", "sglang.srt.model_executor.forward_batch_info"):
        sys.modules.setdefault(modname, types.ModuleType(modname))
    sys.modules["sglang.srt.layers.logits_processor"].LogitsProcessorOutput = type("LogitsProcessorOutput", (), {})
    fb = sys.modules["sglang.srt.model_executor.forward_batch_info"]
    fb.ForwardBatch = type("ForwardBatch", (), {})
    fb.PPProxyTensors = type("PPProxyTensors", (), {})
    import tensor_dump_forward_hook as tdh
    old = os.path.join(WORK, "sglang_old")
    tdh.register_forward_hook_for_model(model, old, dump_layers=[0, 1], tp_size=1, tp_rank=0, pp_rank=0)
    cache = new_cache(model)
    with torch.no_grad():
        prefill(model, cache, toks)
        for p in range(S, S + 2):
            model(input_ids=torch.tensor([[toks[p]]], device=DEV), position_ids=torch.tensor([[p]], device=DEV),
                  past_key_values=cache, use_cache=True)
    files = []
    for dp, _, fs in os.walk(old):
        files += [os.path.join(os.path.relpath(dp, old), f) for f in fs]
    log("old-format files:", sorted(files))


@part
def pt_zoo(log):
    z = os.path.join(WORK, "pt_zoo")
    os.makedirs(z, exist_ok=True)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    zoo = {"bf16": torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16),
           "f16": torch.tensor([65504.0, -1.0], dtype=torch.float16),
           "f32": torch.tensor([1.5, float("inf")]), "f64": torch.tensor([0.25, -3.0], dtype=torch.float64),
           "i8": torch.tensor([-1, 5], dtype=torch.int8), "i16": torch.tensor([-32768], dtype=torch.int16),
           "i32": torch.tensor([-1, 130], dtype=torch.int32), "i64": torch.tensor([1 << 40], dtype=torch.int64),
           "u8": torch.tensor([255, 0], dtype=torch.uint8), "bool": torch.tensor([True, False]),
           "e4m3": torch.tensor([448.0, 1.0, -0.5]).to(torch.float8_e4m3fn),
           "e5m2": torch.tensor([1.0, -57344.0]).to(torch.float8_e5m2),
           "e8m0": torch.tensor([1.0, 8.0, 2.0 ** -10]).to(torch.float8_e8m0fnu),
           "scalar": torch.tensor(7.0), "empty": torch.zeros(3, 0),
           "transposed": base.t(), "offset_view": base[1:3, 2:5], "shared_a": base, "shared_b": base[2]}
    for nm in ("uint16", "uint32", "uint64"):
        if hasattr(torch, nm):
            zoo[nm] = torch.tensor([1, 2], dtype=getattr(torch, nm))
    if hasattr(torch, "float4_e2m1fn_x2"):
        zoo["fp4x2"] = torch.tensor([0x92, 0x07], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    torch.save(zoo, os.path.join(z, "zoo.pt"))
    torch.save(torch.tensor([1.0, 2.0], dtype=torch.bfloat16), os.path.join(z, "bare_tensor.pt"))
    torch.save({"value": torch.tensor([3, 4], dtype=torch.int32), "meta": {"name": "x", "step": 1, "rank": 0,
                                                                          "nested": [1, 2.5, None, True]}},
               os.path.join(z, "value_meta.pt"))
    expect = {}
    for k, v in zoo.items():
        try:
            expect[k] = {"dtype": str(v.dtype), "shape": list(v.shape), "stride": list(v.stride()),
                         "offset": v.storage_offset(),
                         "bytes": v.contiguous().reshape(-1).view(torch.uint8).tolist() if v.numel() else []}
        except Exception as e:
            expect[k] = {"dtype": str(v.dtype), "shape": list(v.shape), "error": repr(e)}
    json.dump(expect, open(os.path.join(z, "zoo_expect.json"), "w"))
    log("zoo:", sorted(zoo))


def smoke(log):
    import subprocess
    env = dict(os.environ, OUT=os.path.join(WORK, "smoke"))
    r = subprocess.run([sys.executable, os.path.join(HERE, "gpu_smoke.py")], env=env, capture_output=True, text=True,
                       timeout=120)
    log(r.stdout[-4000:], r.stderr[-4000:], "rc", r.returncode)
    if r.returncode:
        raise RuntimeError("gpu_smoke.py failed")


if os.environ.get("SMOKE"):
    part(smoke)
summary = {k: v for k, v in STATE.items() if isinstance(v, str)}
json.dump(summary, open(os.path.join(LOGS, "summary.json"), "w"))
print("SUMMARY", summary, flush=True)
for name, paths in (("logs.tgz", [LOGS, os.path.join(WORK, "smoke"), os.path.join(WORK, "hf_state_dict.json"),
                                  os.path.join(WORK, "hf_named_modules.json"),
                                  os.path.join(WORK, "hf_loaded_dtypes.json"), os.path.join(WORK, "tokens.json")]),
                    ("hf_dumps.tgz", [os.path.join(WORK, x) for x in ("hf_eager", "hf_graph", "hf_tp2", "hf_batch2")]),
                    ("sglang.tgz", [os.path.join(WORK, "sglang"), os.path.join(WORK, "sglang_old"),
                                    os.path.join(WORK, "pt_zoo")]),
                    ("hf_ckpt.tgz", [os.path.join(WORK, "hf_ckpt_bf16")])):
    try:
        tar(name, paths)
    except Exception:
        traceback.print_exc()
