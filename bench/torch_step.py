#!/usr/bin/python3
"""One DeepSeek-V4-Flash CSA-layer decode step (layer 2, context 65,536) in
PyTorch on the CPU, fp32, on the exact inputs bench/csastep wrote, timed.

This is the step a user would otherwise write: the FP8 weights dequantised to
fp32 once (W = E4M3(code) * 2^(scale-127), as the reference does), then
model.py's decode path with fp32 tensors and BLAS GEMVs (torch.mv, the
fastest of the forms measured here: F.linear on a vector, x @ W.T and a
batched bmm for wo_a were 1.5-3x slower): wq_a, q_norm, wq_b,
per-head RMS, RoPE; wkv, kv_norm, RoPE; the indexer (wq_b, RoPE, Hadamard,
its compressor's projections and state write, weights_proj, index scores over
every key, top-512); the main compressor's projections and state write; the
window write; sparse attention with the sink over the 640 selected rows;
inverse RoPE; wo_a (grouped) and wo_b. It leaves out the bf16 roundings and
the FP8/FP4 activation fake-quantisation (cheaper for PyTorch, so the
comparison favours it).

    /usr/bin/python3 bench/torch_step.py /tmp/csastep [--threads 2] [--runs 20]

With --go-server it starts `csastep -serve` itself and interleaves: for each
of --reps rounds and each thread count, N sparsemla steps, then N steps of
each PyTorch variant — fp32 torch.mv (above), bf16 weights with F.linear
(the FP8 weights are exact in bf16), and torch.compile of one of them —
and writes a table of medians, PyTorch's best per thread count, and the
outputs compared (bench/gpuhost.sh runs this on the GPU host's CPU).

Prints the median time, the ratio to sparsemla's median (from manifest.json)
and the cosine similarity of the two y (a check that both computed the same
step; they differ by the bf16/fp32 precision, not by the algorithm).
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F


def e4m3_table():
    t = np.zeros(256, dtype=np.float32)
    for c in range(256):
        s = -1.0 if c & 0x80 else 1.0
        e = (c >> 3) & 0xF
        m = c & 7
        if e == 0xF and m == 7:
            t[c] = np.nan
        elif e == 0:
            t[c] = s * m / 8 * 2.0 ** -6
        else:
            t[c] = s * (1 + m / 8) * 2.0 ** (e - 7)
    return t


def load(d):
    man = json.load(open(os.path.join(d, "manifest.json")))
    arrs = {}
    for t in man["tensors"]:
        dt = np.uint8 if t["dtype"] == "u8" else np.float32
        arrs[t["name"]] = np.fromfile(os.path.join(d, t["file"]), dtype=dt).reshape(t["shape"])
    return man, arrs


def dequant(arrs, name):
    codes, scale = arrs[name + ".codes"], arrs[name + ".scale"]
    w = E4M3[codes]
    s = np.exp2(scale.astype(np.float32) - 127).astype(np.float32)
    s = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[: w.shape[0], : w.shape[1]]
    return torch.from_numpy(np.ascontiguousarray(w * s))


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, cos, sin, inverse=False):
    """Rotate the last 64 dims of x (interleaved pairs) in place."""
    pe = x[..., -64:].view(*x.shape[:-1], 32, 2)
    x0, x1 = pe[..., 0].clone(), pe[..., 1].clone()
    s = -sin if inverse else sin
    pe[..., 0] = x0 * cos - x1 * s
    pe[..., 1] = x0 * s + x1 * cos


def hadamard(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * n ** -0.5


E4M3 = e4m3_table()


LINEARS = ["wq_a", "wq_b", "wkv", "wo_b", "idx.wq_b", "cmp.wkv", "cmp.wgate", "idx.weights_proj", "icmp.wkv", "icmp.wgate"]


def make_step(man, W, wo_a, had, cos, sin, icache, window, lin, guard=None):
    """model.py's decode step (see the module doc) with linear y = lin(W, x)."""
    eps, pos, topk = man["eps"], man["pos"], man["topk"]
    win, G = man["window"], wo_a.shape[0]

    def step(kv_cache, st, idx=None):
        if guard is not None and guard() < 0:  # a Python int torch.compile specialises on
            raise RuntimeError("bad guard")
        x = W["x"]
        cq = rms(lin(W["wq_a"], x), W["q_norm"], eps)
        q = lin(W["wq_b"], cq).view(64, 512)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps)
        rope(q, cos, sin)
        kv = rms(lin(W["wkv"], x), W["kv_norm"], eps)
        rope(kv, cos, sin)
        # indexer
        iq = lin(W["idx.wq_b"], cq).view(64, 128)
        rope(iq, cos, sin)
        iq = iq @ had
        r = 4 + pos % 4
        st["icmp_kv_state"][r] = lin(W["icmp.wkv"], x)
        st["icmp_score_state"][r] = lin(W["icmp.wgate"], x) + W["icmp.ape"][pos % 4]
        iw = lin(W["idx.weights_proj"], x) * man["index_weight_scale"]
        score = iw @ torch.relu(iq @ icache.T)
        sel = score.topk(min(topk, score.shape[0])).indices + win
        # main compressor
        st["cmp_kv_state"][r] = lin(W["cmp.wkv"], x)
        st["cmp_score_state"][r] = lin(W["cmp.wgate"], x) + W["cmp.ape"][pos % 4]
        # cache write, sparse attention with the sink
        kv_cache[pos % win] = kv
        kvs = kv_cache[torch.cat([window, sel]) if idx is None else idx]
        logits = (q @ kvs.T) * man["softmax_scale"]
        sink = W["attn_sink"]
        m = torch.maximum(logits.max(-1).values, sink)
        p = torch.exp(logits - m[:, None])
        l = p.sum(-1) + torch.exp(sink - m)
        o = (p @ kvs) / l[:, None]
        rope(o, cos, sin, inverse=True)
        og = o.reshape(G, -1)
        u = torch.cat([lin(wo_a[g], og[g]) for g in range(G)])
        return lin(W["wo_b"], u)

    return step


def setup(d):
    man, arrs = load(d)
    T = lambda n: torch.from_numpy(np.ascontiguousarray(arrs[n]))
    W = {n: dequant(arrs, n) for n in ["wq_a", "wq_b", "wkv", "wo_b", "idx.wq_b"]}
    for n in ["wo_a", "q_norm", "kv_norm", "attn_sink", "cmp.wkv", "cmp.wgate", "cmp.ape",
              "idx.weights_proj", "icmp.wkv", "icmp.wgate", "icmp.ape", "x", "cos", "sin"]:
        W[n] = T(n)
    win = man["window"]
    env = dict(man=man, W=W, T=T, had=hadamard(128), cos=W["cos"], sin=W["sin"], icache=T("icache"),
               window=torch.tensor([(man["pos"] - win + 1 + i) % win for i in range(win)], dtype=torch.long),
               kv0=T("kv_cache"),
               states0={n: T(n) for n in ["cmp_kv_state", "cmp_score_state", "icmp_kv_state", "icmp_score_state"]})
    return env


def variant(env, kind, guard=None):
    """The step with fp32 torch.mv linears ("fp32") or bf16 weights and F.linear ("bf16")."""
    W = dict(env["W"])
    wo_a = W["wo_a"].view(8, -1, W["wo_a"].shape[1])
    if kind == "fp32":
        lin = torch.mv
    else:
        for n in LINEARS:
            W[n] = W[n].to(torch.bfloat16)  # exact for the FP8-dequantised weights
        wo_a = wo_a.to(torch.bfloat16).contiguous()
        lin = lambda w, x: F.linear(x.to(torch.bfloat16), w).float()
    return make_step(env["man"], W, wo_a, env["had"], env["cos"], env["sin"], env["icache"], env["window"], lin, guard)


def fresh(env):
    return env["kv0"].clone(), {k: v.clone() for k, v in env["states0"].items()}


def time_steps(fn, env, n):
    kv, st = fresh(env)
    times = []
    with torch.no_grad():
        for _ in range(n):
            t0 = time.perf_counter()
            y = fn(kv, st)
            times.append((time.perf_counter() - t0) * 1e3)
    return times, y


def cosine(a, b):
    return float(F.cosine_similarity(a.float(), b.float(), dim=0))


def side_by_side(a):
    """Interleaved runs of sparsemla (a --go-server process) and PyTorch's variants."""
    import subprocess
    threads = [int(t) for t in a.threads_list.split(",")]
    go = subprocess.Popen(a.go_server, shell=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    while True:  # csastep generates and writes the inputs, then says "ready"
        line = go.stdout.readline()
        if not line:
            raise SystemExit("csastep --serve ended before it was ready")
        print("go:", line.rstrip(), flush=True)
        if line.strip() == "ready":
            break
    env = setup(a.dir)
    nt = {"n": threads[0]}
    kinds = ["fp32", "bf16"]
    fns = {k: variant(env, k) for k in kinds}
    compiled, compile_s, compile_err = None, {}, None
    if a.compile:
        # one compiled step; the thread count is a guard, so each count gets
        # (and keeps) its own compiled code, compiled at its first call
        try:
            compiled = torch.compile(variant(env, a.compile, guard=lambda: nt["n"]), dynamic=False)
        except Exception as e:  # torch < 2.0
            compile_err = f"{type(e).__name__}: {e}"[:300]
    res = {"go": {}, "same_bits": True}
    ys = {}
    t_start = time.time()
    for rep in range(a.reps):
        for t in threads:
            go.stdin.write(f"run {t} {a.runs}\n")
            r = json.loads(go.stdout.readline())
            res["go"].setdefault(t, []).extend(r["ms"])
            res["same_bits"] = res["same_bits"] and r["same_bits"]
            torch.set_num_threads(t)
            nt["n"] = t
            for k in kinds:
                time_steps(fns[k], env, 1)
                ms, ys[k] = time_steps(fns[k], env, a.runs)
                res.setdefault(k, {}).setdefault(t, []).extend(ms)
            if compiled is not None and compile_err is None and t not in compile_s and time.time() - t_start > a.compile_budget:
                compile_s[t] = None  # over the budget: not compiled for this count
            if compiled is not None and compile_err is None and compile_s.get(t, 0) is not None:
                try:
                    if t not in compile_s:
                        t0 = time.perf_counter()
                        time_steps(compiled, env, 2)
                        compile_s[t] = time.perf_counter() - t0
                        print(f"torch.compile at {t} threads: {compile_s[t]:.0f} s", flush=True)
                    time_steps(compiled, env, 1)
                    ms, ys["compile"] = time_steps(compiled, env, a.runs)
                    res.setdefault("compile", {}).setdefault(t, []).extend(ms)
                except Exception as e:  # no C++ compiler, an unsupported op, …
                    compile_err = f"{type(e).__name__}: {e}"[:300]
                    print("torch.compile failed:", compile_err, flush=True)
            print(f"rep {rep} threads {t}: go {statistics.median(r['ms']):.2f} ms, " +
                  ", ".join(f"{k} {statistics.median(res[k][t][-a.runs:]):.2f}" for k in res if k not in ("go", "same_bits") and t in res[k]), flush=True)
        report(a, env, threads, res, ys, fns, kinds, compile_s, compile_err, final=False)
    report(a, env, threads, res, ys, fns, kinds, compile_s, compile_err, final=True)
    go.stdin.write("quit\n")
    go.wait()


def report(a, env, threads, res, ys, fns, kinds, compile_s, compile_err, final):
    """Write the table (and OUT.json/OUT.md): after every round, so that a run
    stopped by its time limit still leaves the rounds it finished."""
    y_go = env["T"]("y_go")
    idx_go = env["T"]("topk_idxs").long()
    cos_own, cos_idx = {}, {}
    if final:
        with torch.no_grad():
            for k in kinds:
                kv, st = fresh(env)
                cos_own[k] = cosine(fns[k](kv, st), y_go)
                kv, st = fresh(env)
                cos_idx[k] = cosine(fns[k](kv, st, idx_go), y_go)
            if "compile" in ys:
                cos_own["compile"] = cosine(ys["compile"], y_go)
    impls = [k for k in ["fp32", "bf16", "compile"] if k in res]
    rows = []
    for t in sorted(threads):
        if t not in res["go"]:
            continue
        gm = statistics.median(res["go"][t])
        tm = {k: statistics.median(res[k][t]) for k in impls if t in res[k]}
        best = min(tm, key=tm.get)
        rows.append(dict(threads=t, go_ms=gm, torch_ms=tm, best=best, ratio=tm[best] / gm))
    n = len(res["go"][threads[0]]) // a.runs
    out = dict(rows=rows, runs=res, cosine_own_topk=cos_own, cosine_go_index_list=cos_idx,
               go_same_bits_all_threads=res["same_bits"], compile_s=compile_s, compile_error=compile_err,
               torch=torch.__version__, rounds=n, runs_per_round=a.runs, final=final)
    lines = [f"CSA-layer step (V4-Flash layer 2, context {env['man']['pos'] - 1}), medians of {n}×{a.runs} interleaved runs"
             + ("" if final else " (partial: the run was stopped)") + f"; PyTorch {torch.__version__}",
             "", "| threads | sparsemla | torch fp32 mv | torch bf16 F.linear | torch.compile (" + str(a.compile) + ") | best torch | ratio | target ≥ 2× |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda k: f"{r['torch_ms'][k]:.2f} ms" if k in r["torch_ms"] else "—"
        lines.append(f"| {r['threads']} | {r['go_ms']:.2f} ms | {f('fp32')} | {f('bf16')} | {f('compile')} | {r['best']} | "
                     f"{r['ratio']:.2f}× | {'met' if r['ratio'] >= 2 else 'missed'} |")
    lines += ["", f"sparsemla's y bit-identical at every thread count: {res['same_bits']}"]
    if final:
        lines += ["cosine(y_torch, y_sparsemla), own top-k: " + ", ".join(f"{k} {v:.5f}" for k, v in cos_own.items()),
                  "cosine with sparsemla's index list: " + ", ".join(f"{k} {v:.5f}" for k, v in cos_idx.items())]
    lines += [f"torch.compile seconds per thread count (None: not compiled, over the budget): {compile_s}; error: {compile_err}"]
    md = "\n".join(lines)
    if final:
        print(md)
    if a.out:
        json.dump(out, open(a.out + ".json", "w"), indent=1)
        open(a.out + ".md", "w").write(md + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--go-server", help="command line of `csastep -serve -out DIR`: interleave its runs with PyTorch's")
    ap.add_argument("--threads-list", default="1,2,4,8,16", help="with --go-server: the thread counts")
    ap.add_argument("--reps", type=int, default=3, help="with --go-server: rounds over the thread counts")
    ap.add_argument("--compile", default="bf16", help="with --go-server: the variant torch.compile compiles (fp32, bf16, or '' for none)")
    ap.add_argument("--compile-budget", type=float, default=240, help="with --go-server: seconds after which no new thread count is compiled")
    ap.add_argument("--out", help="with --go-server: write OUT.json and OUT.md")
    a = ap.parse_args()
    if a.go_server:
        side_by_side(a)
        return
    torch.set_num_threads(a.threads)
    man, arrs = load(a.dir)
    T = lambda n: torch.from_numpy(np.ascontiguousarray(arrs[n]))
    eps, pos, win, topk = man["eps"], man["pos"], man["window"], man["topk"]
    W = {n: dequant(arrs, n) for n in ["wq_a", "wq_b", "wkv", "wo_b", "idx.wq_b"]}
    for n in ["wo_a", "q_norm", "kv_norm", "attn_sink", "cmp.wkv", "cmp.wgate", "cmp.ape",
              "idx.weights_proj", "icmp.wkv", "icmp.wgate", "icmp.ape", "x", "cos", "sin"]:
        W[n] = T(n)
    G = 8
    wo_a = W["wo_a"].view(G, -1, W["wo_a"].shape[1])
    had = hadamard(128)
    kv_cache0, icache = T("kv_cache"), T("icache")
    states0 = {n: T(n) for n in ["cmp_kv_state", "cmp_score_state", "icmp_kv_state", "icmp_score_state"]}
    cos, sin = W["cos"], W["sin"]
    window = torch.tensor([(pos - win + 1 + i) % win for i in range(win)], dtype=torch.long)

    lin = torch.mv  # y = W x

    def step(kv_cache, st, idx=None):
        x = W["x"]
        cq = rms(lin(W["wq_a"], x), W["q_norm"], eps)
        q = lin(W["wq_b"], cq).view(64, 512)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps)
        rope(q, cos, sin)
        kv = rms(lin(W["wkv"], x), W["kv_norm"], eps)
        rope(kv, cos, sin)
        # indexer
        iq = lin(W["idx.wq_b"], cq).view(64, 128)
        rope(iq, cos, sin)
        iq = iq @ had
        r = 4 + pos % 4
        st["icmp_kv_state"][r] = lin(W["icmp.wkv"], x)
        st["icmp_score_state"][r] = lin(W["icmp.wgate"], x) + W["icmp.ape"][pos % 4]
        iw = lin(W["idx.weights_proj"], x) * man["index_weight_scale"]
        score = iw @ torch.relu(iq @ icache.T)
        sel = score.topk(min(topk, score.shape[0])).indices + win
        # main compressor
        st["cmp_kv_state"][r] = lin(W["cmp.wkv"], x)
        st["cmp_score_state"][r] = lin(W["cmp.wgate"], x) + W["cmp.ape"][pos % 4]
        # cache write, sparse attention with the sink
        kv_cache[pos % win] = kv
        kvs = kv_cache[torch.cat([window, sel]) if idx is None else idx]
        logits = (q @ kvs.T) * man["softmax_scale"]
        sink = W["attn_sink"]
        m = torch.maximum(logits.max(-1).values, sink)
        p = torch.exp(logits - m[:, None])
        l = p.sum(-1) + torch.exp(sink - m)
        o = (p @ kvs) / l[:, None]
        rope(o, cos, sin, inverse=True)
        og = o.reshape(G, -1)
        u = torch.cat([lin(wo_a[g], og[g]) for g in range(G)])
        return lin(W["wo_b"], u)

    kv_cache = kv_cache0.clone()
    st = {k: v.clone() for k, v in states0.items()}
    times = []
    with torch.no_grad():
        for i in range(3 + a.runs):
            t0 = time.perf_counter()
            y = step(kv_cache, st)
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median(times)
    y_go = T("y_go")
    cosim = float(F.cosine_similarity(y, y_go, dim=0))
    # the same step on sparsemla's index list: separates the algorithm from the
    # top-k (whose scores sparsemla computes on the FP4-quantised query and keys)
    idx_go = T("topk_idxs").long()
    with torch.no_grad():
        y2 = step(kv_cache0.clone(), {k: v.clone() for k, v in states0.items()}, idx_go)
    cosim2 = float(F.cosine_similarity(y2, y_go, dim=0))
    print(f"cosine(y_torch, y_sparsemla) with sparsemla's index list = {cosim2:.5f}")
    go = man["go_median_ms"]
    print(f"pytorch {torch.__version__} fp32 step ({a.threads} threads): median {med:.1f} ms over {a.runs} runs")
    print(f"cosine(y_torch, y_sparsemla) = {cosim:.5f}")
    print(f"sparsemla {go:.1f} ms vs pytorch {med:.1f} ms: sparsemla is {med / go:.2f}x PyTorch's speed")
    json.dump({"torch_median_ms": med, "torch_runs": times, "go_median_ms": go, "ratio": med / go,
               "cosine": cosim, "cosine_same_index_list": cosim2, "threads": a.threads, "torch": torch.__version__},
              open(os.path.join(a.dir, "torch.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
