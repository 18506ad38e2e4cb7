#!/usr/bin/python3
"""Summarise the outputs bench/gpuhost.sh (or a local run) leaves in a
directory as Markdown tables of medians, with each target and the distance
to it:

    python3 bench/benchmed.py OUTDIR > OUTDIR/summary.md

It reads csastep.md (bench/torch_step.py --go-server), model_step.txt,
kernels.txt, kvcache.txt and phases.txt (go test -bench output); a missing
file is reported as not run.
"""
import os
import re
import statistics
import sys

LINE = re.compile(r"^(Benchmark\S+?)(?:-(\d+))?\s+\d+\s+(.*)$")


def parse(path):
    """{(name, procs): {unit: [values]}} of a go test -bench output."""
    res = {}
    if not os.path.exists(path):
        return None
    for line in open(path, errors="replace"):
        m = LINE.match(line.strip())
        if not m:
            continue
        name, procs, rest = m.group(1), int(m.group(2) or 1), m.group(3).split()
        d = res.setdefault((name, procs), {})
        for v, u in zip(rest[0::2], rest[1::2]):
            try:
                d.setdefault(u, []).append(float(v))
            except ValueError:
                pass
    return res


def med(d, unit):
    v = d.get(unit)
    return statistics.median(v) if v else None


def main(out):
    p = lambda f: os.path.join(out, f)
    print("# sparsemla on this machine\n")
    if os.path.exists(p("env.txt")):
        env = open(p("env.txt")).read().splitlines()
        print("```\n" + "\n".join(l for l in env if re.match(r"(Model name|nproc|torch|Socket|Core|Thread|NUMA)", l.strip())) + "\n```\n")
    print("## CSA-layer step, side by side with PyTorch\n")
    if os.path.exists(p("csastep.md")):
        print(open(p("csastep.md")).read())
    else:
        print("not run (see csastep.log)\n")
    kern = parse(p("kernels.txt")) or {}
    stream = {procs: med(d, "GB/s") for (n, procs), d in kern.items() if n == "BenchmarkStreamRead/scan/allcores"}
    print("## Whole 43-layer attention-path step, context 65,536\n")
    ms = parse(p("model_step.txt"))
    if not ms:
        print("not run\n")
    else:
        print("| FP8 codes | threads | ms/step | GB/s | cpu-ms/step | cores busy | Go procs busy | machine busy | steal | floor (bytes read / streaming read) | × floor | target |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        rows = [("uniform" if "/uniform/" in n else "checkpoint", procs, d)
                for (n, procs), d in sorted(ms.items(), key=lambda kv: ("/uniform/" in kv[0][0], -kv[0][1]))]
        # the checkpoint run repeated after the uniform one (bench/gpuhost.sh)
        rows += [("checkpoint, again", procs, d) for (n, procs), d in sorted((parse(p("model_step_again.txt")) or {}).items())]
        # the earlier build's steps (GPUHOST_BEFORE), same host run
        rows += [("checkpoint, earlier build", procs, d) for (n, procs), d in
                 sorted((parse(p("model_step_before.txt")) or {}).items(), key=lambda kv: -kv[0][1])]
        for codes, procs, d in rows:
            t, gbs = med(d, "ms/step"), med(d, "GB/s")
            target = {16: 75, 2: 450}.get(procs)
            floor = ""
            x = ""
            if stream.get(procs) and gbs:
                fl = t * gbs / stream[procs]
                floor, x = f"{fl:.1f} ms ({stream[procs]:.1f} GB/s)", f"{t / fl:.2f}×"
            tg = f"≤ {target} ms: {'met' if t <= target else 'missed'}" if target else ""
            cpu, cores = med(d, "cpu-ms/step"), med(d, "cores")
            cpu = f"{cpu:.0f}" if cpu is not None else ""
            cores = f"{cores:.1f}" if cores is not None else ""
            extra = [med(d, u) for u in ("procs", "syscores", "stealcores")]
            extra = " | ".join(f"{v:.1f}" if v is not None else "" for v in extra)
            print(f"| {codes} | {procs} | {t:.1f} | {gbs:.1f} | {cpu} | {cores} | {extra} | {floor} | {x} | {tg} |")
        print("\nTarget at 16 threads: within 1.2× of the floor. cores busy = process CPU seconds per wall second. "
              "Go procs busy = Ps that had a goroutine to run (runtime/metrics): ≪ threads, the step left cores idle; "
              "≈ threads with cores busy ≪ threads, the OS or the hypervisor did not run the ready threads. "
              "machine busy = all processes' busy cores (/proc/stat), steal = cores the hypervisor took (/proc/stat).\n")
    gemvs(kern, "## FP8 GEMVs (GB/s of weight bytes; %stream = share of the same process's streaming read)")
    timelines(kern)
    before = parse(p("kernels_before.txt"))
    if before:
        gemvs(before, "## The earlier build's FP8 GEMVs, same host run (GPUHOST_BEFORE)")
    kvtable(p)
    phasetable(p)
    avx512table(p)


def avx512table(p):
    """The "avx512" part: each benchmark with SPARSEMLA_AVX512=0 (AVX2) and 1,
    per round (one process per round, form and thread count)."""
    path = p("avx512.txt")
    if not os.path.exists(path):
        return
    print("## AVX-512 kernels against their AVX2 forms, same build (SPARSEMLA_AVX512=0 / 1)\n")
    runs = {}  # (name, procs, unit) -> {z: [values, one per round]}
    z = None
    for line in open(path, errors="replace"):
        m = re.match(r"### SPARSEMLA_AVX512=(\d)", line)
        if m:
            z = int(m.group(1))
            continue
        m = LINE.match(line.strip())
        if not m or z is None:
            continue
        name, procs, rest = m.group(1), int(m.group(2) or 1), m.group(3).split()
        pairs = list(zip(rest[0::2], rest[1::2]))
        # the step's phases: its total; GEMVs: GB/s and %stream; the rest: the first unit
        want = [u for u in ("step-µs", "GB/s-cpu", "%stream", "GB/s", "GFLOP/s") if u in [q[1] for q in pairs]]
        for v, u in pairs:
            if u in want[:2]:
                runs.setdefault((name.removeprefix("Benchmark"), procs, u), {}).setdefault(z, []).append(float(v))
    print("| benchmark | threads | unit | AVX2 (each round) | AVX-512 (each round) | AVX-512 / AVX2 (medians) |")
    print("|---|---|---|---|---|---|")
    for (name, procs, u), d in sorted(runs.items()):
        a, b = d.get(0, []), d.get(1, [])
        ratio = ""
        if a and b and statistics.median(a):
            r = statistics.median(b) / statistics.median(a)
            ratio = f"{1 / r:.2f}× faster" if u == "step-µs" else f"{r:.2f}"
        fmt = lambda v: " / ".join(f"{x:.1f}" for x in v)
        print(f"| {name} | {procs} | {u} | {fmt(a)} | {fmt(b)} | {ratio} |")
    print()


PHASES = ["wq_a+wkv", "branches", "branch.q", "branch.compressor", "branch.indexer", "indexer.wq_b", "indexer.query",
          "indexer.compressor", "indexer.weights", "indexer.scores", "indexer.topk", "attn", "wo_a", "wo_b"]


def phasetable(p):
    print("## CSA-layer step at 64K, phase by phase (µs, medians)\n")
    ph = parse(p("phases.txt"))
    if not ph:
        print("not run\n")
        return
    before = parse(p("phases_before.txt")) or {}
    procs = sorted({pr for (n, pr) in ph if n.startswith("BenchmarkPreparedStepPhases/CSA")})
    print("| phase | " + " | ".join(f"{pr} threads" for pr in procs) + " |")
    print("|---|" + "---|" * len(procs))
    get = lambda pr, u: med(ph.get(("BenchmarkPreparedStepPhases/CSA/ctx=65536", pr), {}), u)
    for name in ["step"] + PHASES:
        cells = [get(pr, name + "-µs") for pr in procs]
        label = "&nbsp;" * (2 * name.startswith(("branch.", "indexer.")) + 2 * name.startswith("indexer.")) + name
        print(f"| {label} | " + " | ".join("" if v is None else f"{v:.0f}" for v in cells) + " |")
    if before:
        cells = [med(before.get(("BenchmarkPreparedLayerStep/CSA/ctx=65536", pr), {}), "ms/step") for pr in procs]
        print("| earlier build's step (GPUHOST_BEFORE) | " + " | ".join("" if v is None else f"{v * 1e3:.0f}" for v in cells) + " |")
    print("\nThe phases in sequence (wq_a+wkv, branches, attn, wo_a, wo_b) add up to about the step; the branches "
          "(branch.*) run concurrently inside \"branches\", the indexer's phases (indexer.*) in order inside branch.indexer.\n")


def gemvs(kern, title):
    print(title + "\n")
    if not kern:
        print("not run\n")
    else:
        procs = sorted({pr for (_, pr) in kern})
        print("| benchmark | " + " | ".join(f"{pr} threads" for pr in procs) + " |")
        print("|---|" + "---|" * len(procs))
        for name in sorted({n for (n, _) in kern if not n.startswith(TIMELINE)}, key=lambda n: (not n.startswith("BenchmarkStream"), n)):
            cells = []
            for pr in procs:
                d = kern.get((name, pr))
                if not d:
                    cells.append("")
                    continue
                g, s, c, sg = med(d, "GB/s"), med(d, "%stream"), med(d, "GB/s-cpu"), med(d, "stream-GB/s")
                lp, lg = med(d, "%load"), med(d, "load-GB/s")
                pct = ""
                if s is not None:
                    pct = f" ({s:.0f} % of {sg:.1f}" if sg is not None else f" ({s:.0f} %"
                    if lp is not None and lg is not None:
                        pct += f"; {lp:.0f} % of {lg:.1f} loaded"
                    pct += ")"
                cells.append(f"{g:.1f}" + pct + (f", {c:.1f} per CPU-s" if c is not None else ""))
            print(f"| {name.removeprefix('Benchmark')} | " + " | ".join(cells) + " |")
        print("\nTarget: every FP8 GEMV ≥ 80 % of the streaming read at 2, 8 and 16 threads: \"(P % of S)\" is the median ratio over")
        print("64 MiB windows (8 MiB per thread above 8 threads) alternating the benchmark's calls with a streaming read of as many bytes on the same worker pool (S: its median GB/s).")
        print("\"L % of LL loaded\" is the same against a read of as many bytes more in 32-byte vector loads (AVX2), the stricter floor: bytes.IndexByte, the")
        print("streaming read, spends a compare and a mask move on every 32 bytes and can be bound by them, not by the memory.")
        print("StreamReadPerCall/N is the streaming read done N bytes a call on the same pool, paired the same way: what a GEMV of N")
        print("bytes would reach if its kernel cost nothing (the per-call fork/join and imbalance included).")
        print("FP8PanelsInCache is one core on a")
        print("cache-resident weight: the kernel's own rate (GB/s of codes per second of thread CPU time).\n")


TIMELINE = "BenchmarkFP8CallTimeline"
SPANS = ["call-µs", "quant-µs", "list-µs", "join-µs", "lanes-µs", "spread-µs", "wait-µs", "helpers", "alone-%"]


def timelines(kern):
    """BenchmarkFP8CallTimeline: one row per weight and thread count, the
    medians of its spans (µs) over the -count runs."""
    rows = sorted(((n, pr, d) for (n, pr), d in kern.items() if n.startswith(TIMELINE)), key=lambda r: (r[0], -r[1]))
    if not rows:
        return
    print("## Where a small GEMV's time goes (FP8CallTimeline, µs; medians over the calls)\n")
    print("| weight | threads | " + " | ".join(SPANS) + " |")
    print("|---|---|" + "---|" * len(SPANS))
    for n, pr, d in rows:
        cells = [med(d, u) for u in SPANS]
        cells = [f"{v:.2f}" if v is not None else "" for v in cells]
        print(f"| {n.removeprefix(TIMELINE + '/')} | {pr} | " + " | ".join(cells) + " |")
    print("\nquant: call start → activation quantised; list: → job listed; join: listed → the last helper joined;")
    print("lanes: listed → the later lane end; spread: |caller's lane end − last helper's|; wait: later lane end → the call")
    print("sees its last helper done (join, spread, wait over the calls some helper joined); helpers: mean joined;")
    print("alone-%: calls no helper joined (its helpers were not running, or parked and woke too late).\n")


def kvtable(p):
    print("## KV page decode (one core)\n")
    kv = parse(p("kvcache.txt"))
    if not kv:
        print("not run\n")
    else:
        print("| benchmark | MB/s | MB/s per CPU-second |\n|---|---|---|")
        for (n, _), d in sorted(kv.items()):
            c = med(d, "MB/s-cpu")
            print(f"| {n.removeprefix('Benchmark')} | {med(d, 'MB/s'):.0f} | {'' if c is None else f'{c:.0f}'} |")
        print("\nTarget: v4-model1 ≥ 2000 MB/s (fast).\n")


if __name__ == "__main__":
    main(sys.argv[1])
