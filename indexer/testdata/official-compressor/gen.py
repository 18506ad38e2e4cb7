# Runs the OFFICIAL DeepSeek-V4 Compressor (release-day inference/model.py,
# unmodified, placed next to this file as model.py) on a GPU with the tiny golden
# weights, through prefill + decode scenarios the official-v4-tiny golden does not
# reach: a prefill of S >= r tokens (the §2.4 hand-off with cutoff >= 4) and ratio-128
# rows (emitted at p = 127 and 255), and records torch.topk on tie-heavy scores.
#
#   python gen.py <repo root> <out dir>
#
# Output: compressor.safetensors, topk.safetensors (see README.md).
import json, sys, os
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import model  # the official model.py (not committed; see README.md)

root, out = sys.argv[1], sys.argv[2]
gold = os.path.join(root, "testdata", "official-v4-tiny")
cfg = json.load(open(os.path.join(gold, "config.json")))
args = model.ModelArgs(**cfg)
torch.set_default_dtype(torch.bfloat16)
dev = "cuda"
torch.set_default_device(dev)
W = load_file(os.path.join(gold, "weights.safetensors"), device=dev)
cis = load_file(os.path.join(gold, "rope_tables.safetensors"), device=dev)["freqs_cis_cmp"]
freqs_cis = torch.view_as_complex(cis.contiguous())  # [T, 32] complex64, the GPU's table

gen = torch.Generator(device="cpu").manual_seed(20261130)
N = 260
x_all = torch.randn(N, args.dim, generator=gen, device="cpu").to(torch.bfloat16).to(dev)
rec = {"x": x_all.float().cpu()}

# (name, layer, weight prefix, ratio, head_dim, rotate, prompt lengths S, tokens N)
cases = [
    ("main4", 1, "layers.1.attn.compressor.", 4, 512, False, [2, 10], 20),
    ("idx4", 1, "layers.1.attn.indexer.compressor.", 4, 128, True, [2, 10], 20),
    ("main128", 2, "layers.2.attn.compressor.", 128, 512, False, [2, 130], 260),
]
for name, layer, pre, r, d, rotate, Ss, n in cases:
    for S in Ss:
        c = model.Compressor(args, r, d, rotate).to(dev)
        c.wkv.weight.data.copy_(W[pre + "wkv.weight"])
        c.wgate.weight.data.copy_(W[pre + "wgate.weight"])
        c.ape.data.copy_(W[pre + "ape"])
        c.norm.weight.data.copy_(W[pre + "norm.weight"])
        c.kv_cache = torch.zeros(1, args.max_seq_len // r, d, dtype=torch.bfloat16)
        c.freqs_cis = freqs_cis
        pooled = []
        c.norm.register_forward_hook(lambda m, i, o: pooled.append(i[0].float().reshape(-1, d).cpu()))
        key = f"{name}.S{S}."
        x = x_all[:n].unsqueeze(0)
        # a, b recomputed with the very calls Compressor.forward makes (same shapes,
        # so the same cuBLAS kernels): prefill as one [1, S, dim] GEMM, decode per token.
        with torch.inference_mode():
            xs = x[:, :S].float()
            rec[key + "prefill_a"] = F.linear(xs, c.wkv.weight)[0].cpu()
            rec[key + "prefill_b"] = F.linear(xs, c.wgate.weight)[0].cpu()
            c(x[:, :S], 0)
            rec[key + "prefill_kv_state"] = c.kv_state[0].cpu().clone()
            rec[key + "prefill_score_state"] = c.score_state[0].cpu().clone()
            da, db = [], []
            for p in range(S, n):
                xp = x[:, p:p + 1].float()
                da.append(F.linear(xp, c.wkv.weight)[0, 0].cpu())
                db.append(F.linear(xp, c.wgate.weight)[0, 0].cpu())
                c(x[:, p:p + 1], p)
            rec[key + "decode_a"] = torch.stack(da)
            rec[key + "decode_b"] = torch.stack(db)
            rec[key + "kv_state"] = c.kv_state[0].cpu().clone()
            rec[key + "score_state"] = c.score_state[0].cpu().clone()
            rec[key + "rows"] = c.kv_cache[0, : n // r].float().cpu()
            rec[key + "pooled"] = torch.cat(pooled) if pooled else torch.zeros(0, d)
        print(key, "rows", n // r, "pooled", rec[key + "pooled"].shape[0])

os.makedirs(out, exist_ok=True)
save_file({k: v.contiguous() for k, v in rec.items()}, os.path.join(out, "compressor.safetensors"),
          metadata={"content": "official Compressor runs; see README.md"})

# torch.topk on CUDA over tie-heavy bf16 scores (ReLU-like: many exact zeros and
# repeated values), as the indexer calls it, at the tiny golden's k = 16 and at
# V4-Flash's k = 512 (contexts 4K and 64K: Tc = 1024, 16384).
tk = {}
for tc, k, rows in [(64, 16, 200), (1024, 512, 20), (16384, 512, 10)]:
    scores = (torch.randint(-6, 6, (rows, tc), generator=gen, device="cpu").clamp(min=0).float() / 4).to(torch.bfloat16)
    tk[f"scores_{tc}"] = scores
    tk[f"topk_{tc}"] = scores.to(dev).topk(min(k, tc), dim=-1)[1].cpu()
save_file(tk, os.path.join(out, "topk.safetensors"), metadata={"content": "torch.topk on CUDA; see README.md"})
print("ok")
