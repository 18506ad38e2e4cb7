"""CPU tests of sparsemla_capture (torch >= 1.13, msgpack; no GPU): environment switch,
hooks that never raise, a module run twice, batch split by request, tensor-parallel file names
and shard records, the graph-capture buffering path (without CUDA: buffers are filled at dump
time, written at graph_replayed). Run: python3 capture/tests/test_capture_cpu.py [OUTDIR]
(OUTDIR keeps the TP dump for dump/capture_tp_test.go: testdata/dump/capture-tp)."""
import logging
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sparsemla_capture as sc  # noqa: E402
from sparsemla_capture import Dumper, hook_modules, read  # noqa: E402

logging.basicConfig(level=logging.ERROR)


class Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq_a = torch.nn.Linear(4, 3, bias=False)

    def forward(self, x):
        return self.wq_a(x)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()


class Model(torch.nn.Module):
    def __init__(self, twice=False):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(), Layer()])
        self.twice = twice

    def forward(self, x):
        for l in self.layers:
            y = l.attn(x)
            if self.twice:
                l.attn(x)
        return y


torch.manual_seed(0)
RULES = [(r"layers\.(?P<layer>\d+)\.attn\.wq_a", "q_a"), (r"layers\.(?P<layer>\d+)\.attn", "x", "input")]


def records(path):
    out = {}
    for root, _, files in os.walk(path):
        for f in sorted(files):
            if f.endswith(".smd"):
                hdr, recs, hits, complete = read(os.path.join(root, f))
                assert complete, f
                for m, t in recs:
                    out[(f, m["request"], m["step"], m["layer"], m["stage"])] = (m, t)
    return out


def test_env(tmp):
    os.environ.pop(sc.ENV_ENABLE, None)
    os.environ[sc.ENV_DIR] = os.path.join(tmp, "env")
    d = Dumper.from_env()
    assert not d.enabled
    hook_modules(Model(), d, RULES)
    with d.at(step=3):
        d.dump("q", torch.ones(2))
    d.close()
    assert not os.path.exists(os.path.join(tmp, "env")), "a disabled dumper wrote files"
    os.environ[sc.ENV_ENABLE] = "1"
    os.environ[sc.ENV_FILTER] = r"^L1\."
    d = Dumper.from_env()
    m = Model()
    hook_modules(m, d, RULES)
    with torch.no_grad(), d.at(step=3):
        m(torch.ones(1, 1, 4))
    d.close()
    got = records(os.path.join(tmp, "env"))
    assert sorted((k[3], k[4]) for k in got) == [(1, "q_a"), (1, "x")], got.keys()
    for k in (sc.ENV_ENABLE, sc.ENV_FILTER, sc.ENV_DIR):
        del os.environ[k]


def test_never_raises(tmp):
    d = Dumper(os.path.join(tmp, "bad.smd"))
    m = Model()
    hook_modules(m, d, [(r"layers\.(?P<layer>\d+)\.attn\.wq_a", "q_a", "output", lambda t: t.reshape(7, 7))])
    with torch.no_grad(), d.at(step=1):
        y = m(torch.ones(1, 1, 4))       # the transform raises inside the hook
    assert y.shape == (1, 1, 3) and not d.enabled and len(d.errors) == 1, d.errors
    d.close()


def test_twice(tmp):
    d = Dumper(os.path.join(tmp, "twice.smd"))
    m = Model(twice=True)
    hook_modules(m, d, RULES)
    with torch.no_grad(), d.at(step=1):
        m(torch.ones(1, 1, 4))
    assert d.enabled and not d.errors
    d.close()
    got = records(tmp)
    n = [k for k in got if k[0] == "twice.smd"]
    assert len(n) == 4, n                # q_a and x of 2 layers, once each


def test_batch(tmp):
    d = Dumper(os.path.join(tmp, "batch"), split="step")
    m = Model()
    hook_modules(m, d, RULES)
    x = torch.randn(2, 1, 4)
    with torch.no_grad(), d.at(requests=["rA", "rB"], steps=[7, 9]):
        y = m(x)
    d.close()
    got = records(os.path.join(tmp, "batch"))
    a = got[("step_7.smd", "rA", 7, 1, "q_a")][1]
    b = got[("step_9.smd", "rB", 9, 1, "q_a")][1]
    assert torch.equal(a, y[0, 0]) and torch.equal(b, y[1, 0]), (a, b, y)
    assert torch.equal(got[("step_9.smd", "rB", 9, 0, "x")][1], x[1, 0])


def test_tp(outdir):
    full = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    for r in range(2):
        d = Dumper(os.path.join(outdir, "capture-tp"), split="step", tp_rank=r, tp_size=2,
                   producer={"engine": "test_capture_cpu.py"})
        with d.at(step=5):
            d.dump("q", full[2 * r:2 * r + 2], layer=0, shard_dim=0)        # heads split across ranks
            d.dump("u", full[:, 3 * r:3 * r + 3], layer=0, shard_dim=1)
            d.dump("x", torch.tensor([1.5, -2.0]), layer=0)                   # replicated
        d.close()
    names = sorted(os.listdir(os.path.join(outdir, "capture-tp")))
    assert names == ["step_5.tp0.smd", "step_5.tp1.smd"], names
    hdr, recs, _, _ = read(os.path.join(outdir, "capture-tp", "step_5.tp1.smd"))
    assert hdr["producer"]["tp_rank"] == "1" and hdr["producer"]["tp_size"] == "2"
    sh = {m["stage"]: m.get("shard") for m, _ in recs}
    assert sh == {"q": {"rank": 1, "size": 2, "dim": 0}, "u": {"rank": 1, "size": 2, "dim": 1}, "x": None}, sh


def test_graph_path(tmp):
    d = Dumper(os.path.join(tmp, "graph"), split="step")
    m = Model()
    hook_modules(m, d, RULES)
    with torch.no_grad():
        with d.graph_capture("decode"):
            m(torch.ones(1, 1, 4))
        assert not os.path.exists(os.path.join(tmp, "graph", "step_4.smd"))
        assert len(d._graph_bufs["decode"]) == 4
        d.graph_replayed("decode", step=4)
        d.graph_replayed("decode", step=5)
    d.close()
    got = records(os.path.join(tmp, "graph"))
    assert len(got) == 8 and ("step_5.smd", "", 5, 1, "q_a") in got, sorted(got)


if __name__ == "__main__":
    outdir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in sorted(globals().items()):
            if name.startswith("test_"):
                fn(outdir if name == "test_tp" else tmp)
                print("ok", name)
    print("torch", torch.__version__, "all passed")
