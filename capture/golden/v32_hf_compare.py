"""Second implementation: Hugging Face transformers' deepseek_v32 on the v32-tiny golden.

Loads the golden's weights (official names; FP8 linears dequantised exactly to bf16, as
transformers runs a bf16 checkpoint), builds DeepseekV32ForCausalLM with the same tiny
config (eager attention, bf16), feeds the same token stream (prefill of 10, then one token
per step) and compares, at every dumped decode step, the stages both codes name the same way
with the official model.py's dump: the layer input x (attn_norm / input_layernorm), q_a, qr,
q_b, kv_a, kv_normed, the indexer's top-k set, y (wo / o_proj) and the greedy token. Both
chains run on their own (a chained comparison): a difference in layer 0 reaches layer 1.

Usage: python v32_hf_compare.py --golden DIR_OF_v32-tiny --out report.json
"""

import argparse
import json
import math
import os
import struct

import torch


def read_st(path):
    from safetensors.torch import load_file
    return load_file(path)


def dequant(w, s):
    n, k = w.shape
    sf = s.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (w.float() * sf).to(torch.bfloat16)


def hf_state(off, n_layers, n_experts):
    """Official state_dict -> transformers deepseek_v32 names (bf16 values)."""
    def lin(name):
        if name + ".scale" in off:
            return dequant(off[name + ".weight"], off[name + ".scale"])
        return off[name + ".weight"].to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": off["embed.weight"], "model.norm.weight": off["norm.weight"],
          "lm_head.weight": off["head.weight"]}
    for l in range(n_layers):
        p, q = f"layers.{l}.", f"model.layers.{l}."
        sd[q + "input_layernorm.weight"] = off[p + "attn_norm.weight"]
        sd[q + "post_attention_layernorm.weight"] = off[p + "ffn_norm.weight"]
        a, b = p + "attn.", q + "self_attn."
        for o, h in [("wq_a", "q_a_proj"), ("wq_b", "q_b_proj"), ("wkv_a", "kv_a_proj_with_mqa"),
                     ("wkv_b", "kv_b_proj"), ("wo", "o_proj"), ("indexer.wq_b", "indexer.wq_b"),
                     ("indexer.wk", "indexer.wk")]:
            sd[b + h + ".weight"] = lin(a + o)
        sd[b + "q_a_layernorm.weight"] = off[a + "q_norm.weight"]
        sd[b + "kv_a_layernorm.weight"] = off[a + "kv_norm.weight"]
        sd[b + "indexer.k_norm.weight"] = off[a + "indexer.k_norm.weight"]
        sd[b + "indexer.k_norm.bias"] = off[a + "indexer.k_norm.bias"]
        sd[b + "indexer.weights_proj.weight"] = off[a + "indexer.weights_proj.weight"]
        f = p + "ffn."
        if f + "w1.weight" in off:  # dense layer
            sd[q + "mlp.gate_proj.weight"] = lin(f + "w1")
            sd[q + "mlp.up_proj.weight"] = lin(f + "w3")
            sd[q + "mlp.down_proj.weight"] = lin(f + "w2")
        else:
            sd[q + "mlp.gate.weight"] = off[f + "gate.weight"]
            sd[q + "mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([lin(f + f"experts.{e}.w1"), lin(f + f"experts.{e}.w3")], 0) for e in range(n_experts)])
            sd[q + "mlp.experts.down_proj"] = torch.stack([lin(f + f"experts.{e}.w2") for e in range(n_experts)])
            sd[q + "mlp.shared_experts.gate_proj.weight"] = lin(f + "shared_experts.w1")
            sd[q + "mlp.shared_experts.up_proj.weight"] = lin(f + "shared_experts.w3")
            sd[q + "mlp.shared_experts.down_proj.weight"] = lin(f + "shared_experts.w2")
    return sd


def compare(ref, got):
    ref, got = ref.float().flatten(), got.float().flatten()
    if ref.shape != got.shape:
        return {"shape": [list(ref.shape), list(got.shape)]}
    d = (ref - got).abs()
    cos = 1 - torch.nn.functional.cosine_similarity(ref, got, dim=0).item()
    return {"bit_exact": float((d == 0).float().mean().item()), "max_rel": float((d.max() / ref.abs().max().clamp_min(1e-30)).item()),
            "cos_diff": cos}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--golden", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--first", type=int, default=10)
    ap.add_argument("--last", type=int, default=21)
    opt = ap.parse_args()
    import transformers
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
    cfgj = json.load(open(os.path.join(opt.golden, "config.json")))
    torch.backends.cuda.matmul.allow_tf32 = False
    rope = {"rope_type": "yarn", "rope_theta": cfgj["rope_theta"], "factor": float(cfgj["rope_factor"]),
            "original_max_position_embeddings": cfgj["original_seq_len"], "beta_fast": cfgj["beta_fast"],
            "beta_slow": cfgj["beta_slow"], "mscale": cfgj["mscale"], "mscale_all_dim": cfgj["mscale"]}
    cfg = DeepseekV32Config(
        vocab_size=cfgj["vocab_size"], hidden_size=cfgj["dim"], intermediate_size=cfgj["inter_dim"],
        moe_intermediate_size=cfgj["moe_inter_dim"], num_hidden_layers=cfgj["n_layers"],
        num_attention_heads=cfgj["n_heads"], num_key_value_heads=cfgj["n_heads"],
        n_shared_experts=cfgj["n_shared_experts"], n_routed_experts=cfgj["n_routed_experts"],
        routed_scaling_factor=cfgj["route_scale"], kv_lora_rank=cfgj["kv_lora_rank"], q_lora_rank=cfgj["q_lora_rank"],
        qk_rope_head_dim=cfgj["qk_rope_head_dim"], v_head_dim=cfgj["v_head_dim"], qk_nope_head_dim=cfgj["qk_nope_head_dim"],
        n_group=cfgj["n_expert_groups"], topk_group=cfgj["n_limited_groups"], num_experts_per_tok=cfgj["n_activated_experts"],
        norm_topk_prob=True, max_position_embeddings=cfgj["max_seq_len"], rms_norm_eps=1e-6,
        index_topk=cfgj["index_topk"], index_head_dim=cfgj["index_head_dim"], index_n_heads=cfgj["index_n_heads"],
        first_k_dense_replace=cfgj["n_dense_layers"], rope_parameters=rope, attn_implementation="eager")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = DeepseekV32ForCausalLM(cfg)
    model.eval()
    off = read_st(os.path.join(opt.golden, "weights.safetensors"))
    sd = hf_state(off, cfgj["n_layers"], cfgj["n_routed_experts"])
    own = model.state_dict()
    for k, v in sd.items():
        assert k in own, f"transformers has no {k}"
        assert tuple(own[k].shape) == tuple(v.shape), (k, own[k].shape, v.shape)
    missing = [k for k in own if k not in sd]
    res = model.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()}, strict=False)
    report = {"transformers": transformers.__version__, "torch": torch.__version__, "not_loaded": missing,
              "steps": {}}
    cap = {}

    def hook(name, l):
        def h(mod, inp, out):
            o = out[0] if isinstance(out, tuple) else out
            cap[f"L{l}.{name}"] = o.detach().float().reshape(-1).cpu()
        return h

    for l, layer in enumerate(model.model.layers):
        at = layer.self_attn
        layer.input_layernorm.register_forward_hook(hook("x", l))
        at.q_a_proj.register_forward_hook(hook("q_a", l))
        at.q_a_layernorm.register_forward_hook(hook("qr", l))
        at.q_b_proj.register_forward_hook(hook("q_b", l))
        at.kv_a_proj_with_mqa.register_forward_hook(hook("kv_a", l))
        at.kv_a_layernorm.register_forward_hook(hook("kv_normed", l))
        at.indexer.register_forward_hook(hook("index_topk", l))
        at.o_proj.register_forward_hook(hook("y", l))
    greedy = {}
    for line in open(os.path.join(opt.golden, "checks.txt")):
        if line.startswith("step ") and "greedy " in line:
            greedy[int(line.split()[1].rstrip(":"))] = int(line.split("greedy ")[1].split(";")[0])
    gen = torch.Generator().manual_seed(7 + opt.first)
    tokens = torch.randint(0, cfgj["vocab_size"], (30,), generator=gen).cuda()
    with torch.inference_mode():
        out = model(input_ids=tokens[None, :opt.first], use_cache=True)
        cache = out.past_key_values
        for p in range(opt.first, opt.last + 1):
            cap.clear()
            out = model(input_ids=tokens[None, p:p + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            ref = read_st(os.path.join(opt.golden, f"step_{p}.safetensors"))
            step = {"greedy_hf": int(out.logits[0, -1].argmax()), "greedy_official": greedy.get(p)}
            for k, v in cap.items():
                if k not in ref:
                    continue
                if k.endswith("index_topk"):
                    a, b = set(ref[k].tolist()), set(int(i) for i in v.tolist())
                    step[k] = {"jaccard": len(a & b) / len(a | b), "k": len(a)}
                else:
                    step[k] = compare(ref[k], v)
            report["steps"][p] = step
    with open(opt.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in ("transformers", "not_loaded")}))
    last = report["steps"][opt.last]
    print(json.dumps(last)[:3000])


if __name__ == "__main__":
    main()
