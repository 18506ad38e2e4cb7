"""GPU smoke test of sparsemla_capture (run on the CUDA machine).

Writes into $OUT (default ./out):
  capture_smoke.smd   native dump: hooked module outputs/inputs at steps 5, 6
                      (layers 0, 1), bf16/fp8/e8m0/fp4/i64 tensors with known
                      values, a state, a RoPE-like table, a KV page, a prefix hit
  capture_smoke.npz   the same hooked tensors saved by numpy (np.savez, stored),
                      bf16 as uint16 bits, names L<layer>.<stage> per step
                      prefix s<p>/, taken BEFORE the in-place op that follows
                      the hook, so the Go test can check the clone-at-dump rule
  capture_split/      the same dump split per step (split="step")
  st_ref.safetensors  the known tensors written by safetensors.torch.save_file
The Go test dump/capture_test.go checks the values.
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsemla_capture import Dumper, hook_modules  # noqa: E402

out = os.environ.get("OUT", "out")
os.makedirs(out, exist_ok=True)
dev = "cuda"
torch.manual_seed(0)


class Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq_a = torch.nn.Linear(16, 8, bias=False)
        self.q_norm = torch.nn.RMSNorm(8)

    def forward(self, x):
        cq = self.q_norm(self.wq_a(x))
        res = cq * 2
        cq.mul_(0)  # in-place op after the hook: a lazily copied dump would see zeros
        return res


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        for l in self.layers:
            x = torch.cat([l.attn(x), l.attn(x)], dim=-1)
        return x


model = Model().to(dev).to(torch.bfloat16)
config = {"dim": 16, "n_layers": 2, "compress_ratios": [0, 4]}
keep = {}


def tap_cq(out, li):
    # A forward hook that returns a value REPLACES the module output: return None.
    keep.setdefault((cur[0], li, "cq"), out.detach().clone())


d = Dumper(os.path.join(out, "capture_smoke.smd"), config=config,
           dtype_policy={"activations": "bf16"}, producer={"engine": "capture-smoke", "torch": torch.__version__,
                                                            "gpu": torch.cuda.get_device_name()})
ds = Dumper(os.path.join(out, "capture_split"), config=config, split="step")
rules = [(r"layers\.(?P<layer>\d+)\.attn\.wq_a", "q_a"),
         (r"layers\.(?P<layer>\d+)\.attn\.q_norm", "cq"),
         (r"layers\.(?P<layer>\d+)\.attn", "x", "input"),
         (r"layers\.(?P<layer>\d+)\.attn", "y")]       # same module, output
hook_modules(model, d, rules)
hook_modules(model, ds, rules)
taps = []
for li in range(2):
    for nm in ("q_norm",):
        taps.append(model.layers[li].attn.q_norm.register_forward_hook(
            lambda m, a, o, li=li: tap_cq(o, li)))
cur = [0]
x0 = (torch.arange(16, device=dev, dtype=torch.float32) / 8 - 1).to(torch.bfloat16)[None, None, :]
with torch.no_grad():
    for p in (5, 6):
        cur[0] = p
        with d.at(step=p), ds.at(step=p):
            # each layer's attn runs twice per forward; dump only the first call
            calls = {}
            # Dumper refuses duplicates, so disable after the first attn call of a layer
            def gate(mod, args, li):
                calls[li] = calls.get(li, 0) + 1
                d.enabled = ds.enabled = calls[li] == 1
            gh = [model.layers[li].attn.register_forward_pre_hook(lambda m, a, li=li: gate(m, a, li), prepend=True)
                  for li in range(2)]
            model(x0 + p)
            for h in gh:
                h.remove()
            d.enabled = ds.enabled = True
            # known values of every dtype
            d.dump("known_bf16", torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16, device=dev))
            d.dump("known_e4m3", torch.tensor([448.0, 1.0, -0.5, 0.001953125], device=dev).to(torch.float8_e4m3fn))
            d.dump("known_e8m0", torch.tensor([1.0, 8.0, 2.0 ** -10], device=dev).to(torch.float8_e8m0fnu))
            d.dump("known_fp4", torch.tensor([0x92, 0x07], dtype=torch.uint8, device=dev), dtype="fp4")
            d.dump("pos", torch.tensor([p], dtype=torch.int64, device=dev))
for t in taps:
    t.remove()
d.dump_state("kv_cache", torch.arange(8 * 4, device=dev, dtype=torch.float32).reshape(8, 4).to(torch.bfloat16), layer=0, valid_after=4)
d.dump_table("freqs_cis_r0", torch.polar(torch.ones(4, 2, device=dev), torch.arange(8, device=dev, dtype=torch.float32).reshape(4, 2)))
d.dump_page("kv_page", torch.arange(2 * 584, device=dev).to(torch.uint8), layer=0, layout="v4-model1", page_id=3,
            block_size=2, block_table=[3], step=6)
d.prefix_hit("r1", "", 5)
d.close()
ds.close()

arrs = {}
for (p, li, st), t in keep.items():
    if (p, li, st) in arrs:
        continue
    while t.dim() > 1 and t.shape[0] == 1:
        t = t[0]
    arrs["s%d/L%d.%s" % (p, li, st)] = t.float().cpu().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
np.savez(os.path.join(out, "capture_smoke.npz"), **arrs)

# The same known tensors through the reference safetensors writer, to check
# the Go safetensors reader against an independent producer.
from safetensors.torch import save_file  # noqa: E402
st = {
    "known_bf16": torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16),
    "known_e4m3": torch.tensor([448.0, 1.0, -0.5, 0.001953125]).to(torch.float8_e4m3fn),
    "known_i64": torch.tensor([5, -6], dtype=torch.int64),
    "known_f16": torch.tensor([65504.0, -1.0], dtype=torch.float16),
}
try:
    st["known_e8m0"] = torch.tensor([1.0, 8.0, 2.0 ** -10]).to(torch.float8_e8m0fnu)
    save_file(st, os.path.join(out, "st_ref.safetensors"), metadata={"producer": "safetensors.torch"})
except Exception as e:  # older safetensors: no e8m0
    print("e8m0 not supported by safetensors:", e)
    del st["known_e8m0"]
    save_file(st, os.path.join(out, "st_ref.safetensors"), metadata={"producer": "safetensors.torch"})
import safetensors  # noqa: E402
print("safetensors", safetensors.__version__)

# Python reader: our own capture, and the Go-written golden of every dtype.
from sparsemla_capture import read  # noqa: E402
hdr, recs, hits, complete = read(os.path.join(out, "capture_smoke.smd"))
byk = {(m["step"], m["layer"], m["stage"], m["kind"]): t for m, t in recs}
assert complete and hdr["producer"]["engine"] == "capture-smoke" and hits == [{"request": "r1", "source": "", "tokens": 5}]
assert byk[(5, -1, "known_bf16", "stage")].tolist() == [1.0, -2.5, 3.140625]
assert byk[(5, -1, "known_e4m3", "stage")].float().tolist() == [448.0, 1.0, -0.5, 0.001953125]
assert torch.equal(byk[(5, 0, "cq", "stage")], keep[(5, 0, "cq")].reshape(-1).cpu())
golden = os.path.join(os.path.dirname(__file__), "..", "..", "testdata", "dump", "native", "all_dtypes.smd")
hdr, recs, hits, complete = read(golden)
want = {"f32": [1.5, -2, float("inf")], "f64": [0.25, -3], "bf16": [[3.5, -0.125]], "f16": [65504, -1],
        "e4m3": [448, 1, -1], "e5m2": [1, float("inf")], "e8m0": [1, 8], "i8": [-1, 5], "i16": [-32768],
        "i32": [-1, 130], "i64": 1 << 40, "u8": [255, 0], "bool": [True], "empty": []}
got = {m["name"]: t for m, t in recs}
for k, v in want.items():
    t = got[k]
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        t = t.float()
    if k == "empty":
        assert list(t.shape) == [4, 0], t.shape
        continue
    assert t.tolist() == v, (k, t.tolist(), v)
fp4 = got["fp4"]
print("fp4 read back as", fp4.dtype, list(fp4.shape), "bytes", fp4.view(torch.uint8).tolist())
assert fp4.view(torch.uint8).tolist() == [0x92, 0x07]
assert complete and hits == [{"request": "r1", "source": "r0", "tokens": 12}], (complete, hits)
pg = [m for m, _ in recs if "page" in m][0]["page"]
assert pg["layout"] == "v4-model1" and pg["block_table"] == [7, 3], pg
print("python reader: ok (capture + Go golden of", len(recs), "records)")
print("wrote", sorted(os.listdir(out)), "npz keys", sorted(arrs))
