"""Golden decode dump of the official DeepSeek-V3.2-Exp inference model.py (DSA).

Runs the UNMODIFIED ``inference/model.py`` of deepseek-ai/DeepSeek-V3.2-Exp at 8631a81 ("fix
indexer rope", 2025-11-17; the file at 87e509a, SHA-256 bfe5b891...db6a63, the current official
code: non-interleaved indexer RoPE, fp32 weights_proj, FP8-rounded latent, bf16 decode scores)
on a CUDA GPU with a tiny random config (the engine's v32-tiny preset), prefills a prompt of
S tokens, decodes one teacher-forced token per step, and writes safetensors files in the
layout of the V4 goldens (``L<l>.<stage>``, the official-v4-tiny name map):

  config.json, weights.safetensors (official state_dict names: FP8 E4M3 weights with fp32
  power-of-two block scales ``.scale``), rope_tables.safetensors (freqs_cis_r0 [T, 32, 2]),
  prefill_state.safetensors (latent_cache, k_cache, k_scale_cache after the prefill),
  step_<P>.safetensors (every attention stage of engine.V32Stages + the state after P),
  checks.txt.

The kernels model.py imports (act_quant, fp8_gemm, fp8_index from ``kernel``; TileLang does
not install on the GPU host) come from ``v32_kernels.py``: act_quant and fp8_gemm are the V4
port (capture/golden/v4_kernels.py: the V3.2 kernel.py formulas are the same), fp8_index is
ported here; ``fast_hadamard_transform`` is v4_kernels.hadamard_module(). model.py's indexer
calls ``dist.broadcast`` unconditionally (an error without a process group, world size 1):
the driver replaces torch.distributed.broadcast by the identity of a 1-rank broadcast.
``einops.rearrange`` gets a one-pattern stand-in when einops is not installed.

Capture is from outside: forward (pre-)hooks on the official modules and wrappers of the
module-level functions model.py calls (apply_rotary_emb, rotate_activation, act_quant,
fp8_index, linear) and of torch.einsum while MLA.forward runs. Two values are assembled
from captured tensors with the official expression: iq_roped / ik_roped (torch.cat of the
rotated and the plain half, V32-M:459, 463) and iw (weights_proj(x) * n_heads ** -0.5).

Usage (GPU host): python capture/golden/v32_decode.py --model-dir DIR_WITH_model.py --out OUT
Local smoke test of the plumbing (torch without float8, CPU): add --smoke.
"""

import argparse
import json
import math
import os
import sys
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

# engine preset v32-tiny (V3.2 ModelArgs keys only).
TINY_CONFIG = {
    "max_batch_size": 1, "max_seq_len": 512, "dtype": "fp8", "scale_fmt": "ue8m0",
    "vocab_size": 512, "dim": 256, "inter_dim": 256, "moe_inter_dim": 128, "n_layers": 2,
    "n_dense_layers": 1, "n_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
    "n_activated_experts": 2, "n_expert_groups": 1, "n_limited_groups": 1,
    "score_func": "sigmoid", "route_scale": 2.5, "q_lora_rank": 128, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "original_seq_len": 128, "rope_theta": 10000.0, "rope_factor": 40, "beta_fast": 32,
    "beta_slow": 1, "mscale": 1.0, "index_n_heads": 4, "index_head_dim": 128, "index_topk": 16,
}
WEIGHT_SEED = 20260432


def import_model(model_dir, smoke):
    sys.path.insert(0, HERE)
    if smoke and not hasattr(torch, "float8_e4m3fn"):
        torch.float8_e4m3fn = torch.float16  # plumbing only: no FP8 numerics in a smoke run
        torch.float8_e8m0fnu = torch.uint8
        torch.float4_e2m1fn_x2 = torch.uint8
    import v32_kernels
    sys.modules["kernel"] = v32_kernels
    sys.modules["fast_hadamard_transform"] = v32_kernels.hadamard_module()
    try:
        import einops  # noqa: F401
    except ImportError:
        sys.modules["einops"] = v32_kernels.einops_module()
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.broadcast = lambda tensor, src=0, *a, **k: None  # 1-rank broadcast: identity
    sys.path.insert(0, os.path.abspath(model_dir))
    import model as official
    return official, v32_kernels


def make_weights(model, kernels, seed):
    """Random weights in the official state_dict layout (one CPU generator, state_dict order).

    FP8 linears (fp8 params): W = bf16(N(0,1)/sqrt(in)), 128x128 block scale
    ceil2(f32(max(amax,1e-4)*f32(1/448))) (fp32 ``.scale``), E4M3_RNE(W/scale).
    bf16 params: embed N(0,1), others N(0,1)/sqrt(in). fp32: norm weights bf16(1+0.1N),
    k_norm.bias bf16(0.1N), head and others bf16(N/sqrt(in)).
    """
    g = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float32)

    out = {}
    sd = model.state_dict()
    fp8 = torch.float8_e4m3fn
    for name, p in sd.items():
        shape = tuple(p.shape)
        if name.endswith(".scale") and name[:-6] + ".weight" in sd and sd[name[:-6] + ".weight"].element_size() == 1:
            continue  # made with its weight
        if p.element_size() == 1 and p.dtype == fp8:
            n_out, n_in = shape
            w = (randn(shape) / math.sqrt(n_in)).to(torch.bfloat16).float()
            q, s = quant_fp8_blocks(w, kernels)
            out[name] = q
            out[name[:-7] + ".scale"] = s
        elif p.dtype == torch.bfloat16:
            w = randn(shape) if name == "embed.weight" else randn(shape) / math.sqrt(shape[-1])
            out[name] = w.to(torch.bfloat16)
        else:
            assert p.dtype == torch.float32, (name, p.dtype)
            r = randn(shape)
            if name.endswith("k_norm.bias"):
                out[name] = (0.1 * r).to(torch.bfloat16).float()
            elif "norm" in name:
                out[name] = (1 + 0.1 * r).to(torch.bfloat16).float()
            else:
                out[name] = (r / math.sqrt(shape[-1])).to(torch.bfloat16).float()
    return out


def quant_fp8_blocks(w, kernels):
    n_out, n_in = w.shape
    bo, bi = (n_out + 127) // 128, (n_in + 127) // 128
    wp = torch.zeros(bo * 128, bi * 128, dtype=torch.float32)
    wp[:n_out, :n_in] = w
    blocks = wp.view(bo, 128, bi, 128)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    s = kernels.ceil2_bits(amax * torch.tensor(kernels.FP8_MAX_INV, dtype=torch.float32))
    q = (blocks / s.view(bo, 1, bi, 1)).clamp(-448, 448).view(bo * 128, bi * 128)[:n_out, :n_in]
    return q.to(torch.float8_e4m3fn).contiguous(), s.contiguous()


def load_weights(model, tensors):
    sd = model.state_dict()
    missing = [k for k in sd if k not in tensors]
    assert not missing, f"weights missing: {missing[:5]}"
    with torch.no_grad():
        for name, p in sd.items():
            t = tensors[name]
            assert tuple(t.shape) == tuple(p.shape), (name, t.shape, p.shape)
            p.copy_(t.to(p.device))


class Capture:
    """Collects the stages of one decode step, keyed L<l>.<stage>."""

    def __init__(self, official, model, args):
        self.o, self.model, self.args = official, model, args
        self.on = False
        self.layer = -1
        self.in_linear = 0
        self.in_mla = False
        self.rope_calls = self.had_calls = self.quant_calls = 0
        self.rec = {}
        self._install()

    def put(self, stage, t):
        self.rec[f"L{self.layer}.{stage}"] = t.detach().clone()

    def _install(self):
        o, args = self.o, self.args
        H, HI = args.n_heads, args.index_n_heads
        for l, blk in enumerate(self.model.layers):
            attn = blk.attn

            def pre(mod, inp, l=l):
                if self.on:
                    self.layer, self.in_mla = l, True
                    self.rope_calls = self.had_calls = self.quant_calls = 0
                    self.put("x", inp[0].reshape(-1))

            def post(mod, inp, out):
                if self.on:
                    self.in_mla = False

            attn.register_forward_pre_hook(pre)
            attn.register_forward_hook(post)

            def out_hook(name, shape=None):
                def h(mod, inp, out):
                    if self.on:
                        v = out.reshape(shape) if shape else out.reshape(-1)
                        self.put(name, v)
                return h

            attn.wq_a.register_forward_hook(out_hook("q_a"))
            attn.q_norm.register_forward_hook(out_hook("qr"))
            attn.wq_b.register_forward_hook(out_hook("q_b", (H, args.qk_nope_head_dim + args.qk_rope_head_dim)))
            attn.wkv_a.register_forward_hook(out_hook("kv_a"))
            attn.kv_norm.register_forward_hook(out_hook("kv_normed"))
            attn.wo.register_forward_hook(out_hook("y"))
            ix = attn.indexer
            ix.wq_b.register_forward_hook(out_hook("iq_b", (HI, args.index_head_dim)))
            ix.wk.register_forward_hook(out_hook("ik_raw"))
            ix.k_norm.register_forward_hook(out_hook("ik_normed"))

            def iw_hook(mod, inp, out):
                if self.on:
                    self.put("iw_raw", out.reshape(-1))
                    self.put("iw", (out * HI ** -0.5).reshape(-1))  # the official expression

            ix.weights_proj.register_forward_hook(iw_hook)

            def topk_hook(mod, inp, out):
                if self.on:
                    self.put("index_topk", out.reshape(-1).to(torch.int64))

            ix.register_forward_hook(topk_hook)

            # whole layer (Block.forward): its inputs (x, residual), the two
            # fused add-RMSNorms' outputs, the FFN output, the MoE gate's.
            def blk_pre(mod, inp, l=l):
                if self.on:
                    self.layer = l
                    self.put("x_in", inp[0].reshape(-1))
                    if inp[1] is not None:
                        self.put("res_in", inp[1].reshape(-1))

            def attn_norm_hook(mod, inp, out, l=l):
                if self.on and isinstance(out, tuple):
                    self.layer = l
                    self.put("h_in", out[1].reshape(-1))

            def ffn_norm_hook(mod, inp, out, l=l):
                if self.on:
                    self.layer = l
                    self.put("ffn_in", out[0].reshape(-1))
                    self.put("h_mid", out[1].reshape(-1))

            def ffn_hook(mod, inp, out, l=l):
                if self.on:
                    self.layer = l
                    self.put("ffn_out", out.reshape(-1))

            blk.register_forward_pre_hook(blk_pre)
            blk.attn_norm.register_forward_hook(attn_norm_hook)
            blk.ffn_norm.register_forward_hook(ffn_norm_hook)
            blk.ffn.register_forward_hook(ffn_hook)
            if hasattr(blk.ffn, "gate"):
                def gate_hook(mod, inp, out, l=l):
                    if self.on:
                        self.layer = l
                        self.put("moe_weights", out[0].reshape(-1).float())
                        self.put("moe_indices", out[1].reshape(-1).to(torch.int64))
                blk.ffn.gate.register_forward_hook(gate_hook)

        rope_names = ["q_pe", "k_pe", "iq_pe", "ik_pe"]
        f_rope = o.apply_rotary_emb

        def apply_rotary_emb(x, freqs_cis, *a, **k):
            y = f_rope(x, freqs_cis, *a, **k)
            if self.on and self.in_mla:
                name = rope_names[self.rope_calls]
                self.rope_calls += 1
                if name == "q_pe":
                    self.put("q_pe", y.reshape(H, -1))
                elif name == "k_pe":
                    self.put("k_pe", y.reshape(-1))
                elif name == "iq_pe":
                    iq_b = self.rec[f"L{self.layer}.iq_b"]
                    self.put("iq_roped", torch.cat([y.reshape(HI, -1), iq_b[:, y.size(-1):]], dim=-1))
                else:
                    ik = self.rec[f"L{self.layer}.ik_normed"]
                    self.put("ik_roped", torch.cat([y.reshape(-1), ik[y.size(-1):]], dim=-1))
            return y

        o.apply_rotary_emb = apply_rotary_emb

        f_had = o.rotate_activation

        def rotate_activation(x):
            y = f_had(x)
            if self.on and self.in_mla:
                if self.had_calls == 0:
                    self.put("iq_had", y.reshape(HI, -1))
                else:
                    self.put("ik_had", y.reshape(-1))
                self.had_calls += 1
            return y

        o.rotate_activation = rotate_activation

        f_lin = o.linear

        def linear(*a, **k):
            self.in_linear += 1
            try:
                return f_lin(*a, **k)
            finally:
                self.in_linear -= 1

        o.linear = linear

        f_aq = o.act_quant

        def act_quant(x, block_size=128, scale_fmt=None):
            q, s = f_aq(x, block_size, scale_fmt)
            if self.on and self.in_mla and self.in_linear == 0:
                if x.dim() == 3 and x.size(-1) == args.kv_lora_rank:
                    # the latent's FP8 round trip, the official expression of MLA.forward
                    kv = (q.view(-1, block_size).float() * s.view(-1, 1)).to(x.dtype).view_as(x)
                    self.put("kv_fq8", kv.reshape(-1))
                elif x.dim() == 4:
                    self.put("iq_fp8", q.float().reshape(HI, -1))
                    self.put("iq_scale", s.reshape(-1))
                else:
                    self.put("ik_fp8", q.float().reshape(-1))
                    self.put("ik_scale", s.reshape(-1))
                self.quant_calls += 1
            return q, s

        o.act_quant = act_quant

        f_idx = o.fp8_index

        def fp8_index(q, q_s, k, k_s):
            y = f_idx(q, q_s, k, k_s)
            if self.on and self.in_mla:
                self.put("index_weights", q_s.reshape(-1))
                self.put("index_score", y.reshape(-1))
            return y

        o.fp8_index = fp8_index

        f_einsum = torch.einsum
        names = {"bshd,hdc->bshc": "q_absorbed", "bsht,btc->bshc": "o_latent", "bshc,hdc->bshd": "o_v"}

        def einsum(eq, *ops):
            y = f_einsum(eq, *ops)
            if self.on and self.in_mla and eq in names:
                self.put(names[eq], y.reshape(H, -1))
            return y

        torch.einsum = einsum

    def state(self, end):
        """latent_cache, k_cache, k_scale_cache of every layer after `end` tokens."""
        out = {}
        for l, blk in enumerate(self.model.layers):
            a = blk.attn
            out[f"L{l}.latent_cache"] = torch.cat([a.kv_cache[0, :end], a.pe_cache[0, :end]], dim=-1).clone()
            out[f"L{l}.k_cache"] = a.indexer.k_cache[0, :end].float().clone()
            out[f"L{l}.k_scale_cache"] = a.indexer.k_scale_cache[0, :end, 0].float().clone()
        return out


def save_file(tensors, path, metadata=None):
    """safetensors.torch.save_file, or a minimal writer of the same format where the
    library is missing (the local smoke test)."""
    try:
        from safetensors.torch import save_file as st_save
    except ImportError:
        st_save = None
    if st_save is not None:
        return st_save(tensors, path, metadata=metadata)
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32"}
    hdr, blobs, off = {}, [], 0
    if metadata:
        hdr["__metadata__"] = metadata
    for k in sorted(tensors):
        t = tensors[k].contiguous().cpu()
        b = t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        hdr[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


def to_cpu(d):
    return {k: v.detach().contiguous().cpu() for k, v in d.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-len", type=int, default=10)
    ap.add_argument("--last-pos", type=int, default=29)
    ap.add_argument("--seed", type=int, default=WEIGHT_SEED)
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing test (no FP8 numerics)")
    opt = ap.parse_args()
    official, kernels = import_model(opt.model_dir, opt.smoke)
    os.makedirs(opt.out, exist_ok=True)
    dev = "cpu" if opt.smoke else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(0)
    cfg = dict(TINY_CONFIG)
    if opt.smoke:
        cfg["dtype"] = "bf16"
    args = official.ModelArgs(**cfg)
    if opt.smoke:
        model = official.Transformer(args)
    else:
        with torch.device(dev):
            model = official.Transformer(args)
    w = make_weights(model, kernels, opt.seed)
    load_weights(model, w)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(opt.out, "weights.safetensors"),
              metadata={"content": "random tiny DeepSeek-V3.2 weights; names = official model.state_dict()"})
    with open(os.path.join(opt.out, "config.json"), "w") as f:
        json.dump(TINY_CONFIG, f, indent=2)
    fc = model.freqs_cis
    save_file({"freqs_cis_r0": torch.view_as_real(fc).float().contiguous().cpu()},
              os.path.join(opt.out, "rope_tables.safetensors"))
    cap = Capture(official, model, args)
    gen = torch.Generator().manual_seed(7 + opt.prompt_len)
    tokens = torch.randint(0, args.vocab_size, (opt.last_pos + 1,), generator=gen).to(dev)
    S = opt.prompt_len
    log = []
    with torch.inference_mode():
        model(tokens[None, :S], 0)
        save_file(to_cpu(cap.state(S)), os.path.join(opt.out, "prefill_state.safetensors"),
                  metadata={"after_step": str(S - 1)})
        for p in range(S, opt.last_pos + 1):
            cap.rec, cap.on = {}, True
            logits = model(tokens[None, p:p + 1], p)
            cap.on = False
            rec = dict(cap.rec)
            rec.update(cap.state(p + 1))
            for l in range(args.n_layers):
                if f"L{l}.kv_fq8" not in rec:
                    # code without the latent's FP8 round trip (2305c7e): the latent it cached
                    rec[f"L{l}.kv_fq8"] = rec[f"L{l}.latent_cache"][p, :args.kv_lora_rank].clone()
            rec["logits"] = logits.reshape(-1).float()
            rec["pos"] = torch.tensor([p], dtype=torch.int64)
            rec["tok"] = tokens[p:p + 1].to(torch.int64)
            save_file(to_cpu(rec), os.path.join(opt.out, f"step_{p}.safetensors"))
            ks = sorted(k for k in rec if k.startswith("L0."))
            log.append(f"step {p}: {len(rec)} tensors; L0 stages {len(ks)}; greedy {int(logits.argmax())}; "
                       f"topk L1 {rec['L1.index_topk'].tolist() if 'L1.index_topk' in rec else None}")
    env = f"torch {torch.__version__}, cuda {torch.version.cuda}, device {torch.cuda.get_device_name() if not opt.smoke else 'cpu'}"
    with open(os.path.join(opt.out, "checks.txt"), "w") as f:
        f.write(env + "\n" + "\n".join(log) + "\n")
    print(env)
    print("\n".join(log[-3:]))


if __name__ == "__main__":
    main()
