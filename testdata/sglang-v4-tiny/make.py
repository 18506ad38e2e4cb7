"""Run SGLang's real dumper.py (unmodified, fetched; not committed) on the tensors of the
official DeepSeek-V4 tiny GPU run (testdata/official-v4-tiny), through its non-intrusive
forward hooks, and its older per-pass tensor dump hook.

    FETCHED=<dir with dumper.py and tensor_dump_forward_hook.py> python3 testdata/sglang-v4-tiny/make.py

A module tree with the official model.py attention names (layers.N.attn.wq_a, q_norm, wq_b,
wkv, kv_norm, wo_a, wo_b) replays, step by step, the tensors the official model computed on
the GPU (each module returns its recorded output, shaped [tokens=1, ...] as SGLang's are), so
the dumper's hooks see what they would see in a server running that model. Writes
sglang/ (DUMPER_DIR/exp_name) and tensor_dump/ (TP0_PP0_Rank0_pid0/Pass*.pt).
"""
import json
import os
import shutil
import struct
import sys
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GOLD = os.path.join(HERE, "..", "official-v4-tiny")
FETCHED = os.environ["FETCHED"]
STEPS = [2, 3, 4]
STAGES = {"wq_a": "q_a", "q_norm": "cq", "wq_b": "q_b", "wkv": "kv_raw", "kv_norm": "kv_normed",
          "wo_a": "u", "wo_b": "y"}
DT = {"BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


def load_st(path):
    with open(path, "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    hdr = json.loads(b[8:8 + n])
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        s, e = v["data_offsets"]
        raw = bytearray(b[8 + n + s: 8 + n + e])
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out[k] = t.view(DT[v["dtype"]]).reshape(v["shape"])
    return out


steps = {p: load_st(os.path.join(GOLD, "step_%d.safetensors" % p)) for p in STEPS}
cur = {"p": None}


class Replay(torch.nn.Module):
    """Returns the recorded output of its stage at the current step, [1, ...]."""

    def __init__(self, layer, stage):
        super().__init__()
        self.layer, self.stage = layer, stage

    def forward(self, x):
        if cur["p"] is None:  # prefill: two tokens, any values
            return torch.zeros(2, 4)
        return steps[cur["p"]]["L%d.%s" % (self.layer, self.stage)].unsqueeze(0).clone()


class Attn(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        for m, st in STAGES.items():
            setattr(self, m, Replay(layer, st))

    def forward(self, x):
        cq = self.q_norm(self.wq_a(x))
        self.wq_b(cq)
        self.kv_norm(self.wkv(x))
        if cur["p"] is None:
            o = torch.zeros(2, 4)
        else:
            o = steps[cur["p"]]["L%d.o_inv" % self.layer].unsqueeze(0).clone()
        return self.wo_b(self.wo_a(o))


class Block(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.attn = Attn(layer)

    def forward(self, x):  # returns None: the dumper's layer output hook dumps nothing
        self.attn(x)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(i) for i in range(4)])

    def forward(self, input_ids, positions):
        for i, b in enumerate(self.layers):
            x = torch.zeros(2, 4) if cur["p"] is None else steps[cur["p"]]["L%d.x" % i].unsqueeze(0).clone()
            b(x)
        return None


def run(dumper, model, hook_step):
    toks = steps[STEPS[0]]["tok"]
    # prefill of the two prompt tokens, then the decode steps
    for p in [None] + STEPS:
        cur["p"] = p
        pos = torch.tensor([0, 1]) if p is None else steps[p]["pos"].clone()
        ids = torch.tensor([1, 2]) if p is None else steps[p]["tok"].clone()
        if dumper is not None:
            dumper.dump("positions", pos)
            dumper.dump("input_ids", ids)
        model(ids, pos)
        hook_step()
    del toks


out = os.path.join(HERE, "sglang")
shutil.rmtree(out, ignore_errors=True)
os.environ.update(DUMPER_ENABLE="1", DUMPER_DIR=HERE, DUMPER_EXP_NAME="sglang", DUMPER_NON_INTRUSIVE_MODE="all",
                  DUMPER_ENABLE_OUTPUT_CONSOLE="0",
                  DUMPER_FILTER="search(r'attn\\.(wq_a|q_norm|wq_b|wkv|kv_norm|wo_a|wo_b)\\.output$|attn\\.(wo_a\\.)?inputs\\.0$', name) "
                                "or name in ('positions', 'input_ids')")
sys.path.insert(0, FETCHED)
import dumper as sgl  # noqa: E402  the fetched SGLang dumper.py, unmodified

if torch.__version__ < "2":
    # torch 1.x has no register_forward_pre_hook(with_kwargs=True) (dumper.py needs torch 2);
    # the modules here are called positionally, so kwargs are always {}.
    _orig_pre = torch.nn.Module.register_forward_pre_hook

    def _pre(self, hook, *, prepend=False, with_kwargs=False):
        if with_kwargs:
            return _orig_pre(self, lambda m, a: hook(m, a, {}))
        return _orig_pre(self, hook)
    torch.nn.Module.register_forward_pre_hook = _pre
if not hasattr(torch.Tensor, "untyped_storage"):  # torch 1.x spelling
    torch.Tensor.untyped_storage = lambda self: self.storage().untyped()

model = Model()
ni = sgl.dumper.register_non_intrusive_dumper(model)
run(sgl.dumper, model, sgl.dumper.step)
ni.remove()
sgl.dumper.configure(enable=False)

# the older --debug-tensor-dump-output-folder hook: needs three sglang classes (isinstance
# checks only), stubbed as empty classes
for modname in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.logits_processor",
                "sglang.srt.model_executor", "sglang.srt.model_executor.forward_batch_info"):
    sys.modules.setdefault(modname, types.ModuleType(modname))
sys.modules["sglang.srt.layers.logits_processor"].LogitsProcessorOutput = type("LogitsProcessorOutput", (), {})
fb = sys.modules["sglang.srt.model_executor.forward_batch_info"]
fb.ForwardBatch = type("ForwardBatch", (), {})
fb.PPProxyTensors = type("PPProxyTensors", (), {})
import tensor_dump_forward_hook as tdh  # noqa: E402

td = os.path.join(HERE, "tensor_dump")
shutil.rmtree(td, ignore_errors=True)


class Top(torch.nn.Module):  # the hook wants the layers under a top-level module named "model"
    def __init__(self):
        super().__init__()
        self.model = Model()

    def forward(self, ids, pos):
        # SGLang passes a ForwardBatch to the model; the hook records its positions / input_ids
        batch = fb.ForwardBatch()
        batch.input_ids, batch.positions, batch.seq_lens = ids, pos, torch.tensor([pos.numel()])
        return self.model(batch)


class ModelFB(Model):
    def forward(self, batch):
        return Model.forward(self, batch.input_ids, batch.positions)


top = Top()
top.model = ModelFB()
os.getpid = lambda: 0  # stable directory name TP0_PP0_Rank0_pid0
tdh.register_forward_hook_for_model(top, td, dump_layers=None, tp_size=1, tp_rank=0, pp_rank=0)
run(None, top, lambda: None)
print("torch", torch.__version__, "files:", len(os.listdir(out)), sorted(os.listdir(td)))
