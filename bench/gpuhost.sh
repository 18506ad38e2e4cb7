#!/bin/bash
# sparsemla against PyTorch on the GPU host's CPU (16-core Xeon), in one run.
#
# Here, on the development machine (Go needed, no PyTorch):
#
#   bash bench/gpuhost.sh build
#
# cross-builds the Go side statically (CGO_ENABLED=0, linux/amd64):
# bench/csastep and the test binaries of attention, engine and kvcache,
# packed into bench/bin/gpuhost.tgz (bench/bin is git-ignored, ≈ 8 MB; the
# device tool's working tree, tracked files plus carried paths, must stay
# under 64 MiB). The tracked tree alone is ≈ 102 MiB, most of it testdata
# that nothing here reads: session 9 moved the tracked files over 300 KB
# aside for its calls and back after them. Then, on the GPU host, with
# bench/bin carried:
#
#   bash bench/gpuhost.sh run [OUTDIR]        (default $OUT, else /tmp/gpuhost)
#
# runs, in about 6 minutes (each part has its own timeout; at most 9.5):
#  1. the V4-Flash CSA-layer step at context 65,536 (layer 2): csastep -serve
#     writes the inputs and stays up; bench/torch_step.py --go-server
#     interleaves, for 3 rounds × threads 16, 2, 8, 4, 1, 10 sparsemla steps
#     and 10 steps of each PyTorch variant (fp32 torch.mv, bf16 F.linear,
#     torch.compile of the bf16 step), then compares the outputs (sparsemla
#     bit-identical at every thread count; cosine to each PyTorch variant);
#  2. the whole 43-layer attention-path step at 64K (engine
#     BenchmarkPreparedModelStep, checkpoint-like FP8 codes) at 16 and 2
#     threads, and with uniform codes at 16, then checkpoint codes at 16
#     again — one process per run;
#  3. the FP8 GEMVs for each code distribution beside the streaming read of
#     the same process, at 2, 8 and 16 threads, one process per thread count
#     (%stream: target ≥ 80), and the streaming read done a call at a time
#     (StreamReadPerCall: the ceiling of a GEMV of 2, 4, 6 MiB), and where
#     a small GEMV's time goes (FP8CallTimeline: wkv and wq_a, the spans
#     of a call, the helpers that joined, the calls none joined);
#  4. the KV page decode on one core (target ≥ 2 GB/s);
#  5. the CSA-layer step at 64K with the wall time of each of its phases
#     (engine BenchmarkPreparedStepPhases) at 16, 1, 2 and 8 threads, one
#     process each (and, with GPUHOST_BEFORE, the earlier build's CSA step
#     after each: the same step without the phase clock).
# and writes OUTDIR/summary.md (the tables), OUTDIR/csastep.json (every timed
# run) and OUTDIR/raw.txt (every raw output).
# GPUHOST_QUICK=1 shrinks every part (threads 1,2; one round; no 43-layer
# step) to check the script itself on a small machine. GPUHOST_SHORT=1 is a
# ≈ 100 s run for a small device budget: checkpoint codes only, count 1, the
# 43-layer step at 16 only, the CSA step against PyTorch fp32 and bf16 (no
# torch.compile), one round of 5 steps, run last; no KV decode. GPUHOST_BIN names
# another packed build (default bench/bin/gpuhost.tgz); GPUHOST_BEFORE a
# second one (an earlier build: its attention.test and engine.test) whose
# checkpoint-code GEMVs and 43-layer steps run beside, for a before/after
# table in the same host run (kernels_before.txt, model_step_before.txt).
#  6. "avx512" (not in the default parts): the kernels on one core and the
#     CSA step's phases at 1 and 16 threads with SPARSEMLA_AVX512=0 (every
#     kernel in its AVX2 form) and without, alternated twice.
# GPUHOST_STEP_BRIEF=1 runs the 43-layer step at 16 and 2 threads only
# (checkpoint codes; no uniform codes, no second run).
# GPUHOST_PARTS picks parts ("csa", "step", "gemv", "kv", "phases", "avx512"; default all but avx512), to
# split a run over two device calls of at most 10 minutes each.
# (One process per thread count: a first round ran -test.cpu 16,2 in one
# process, and the first benchmark process after PyTorch kept only 2 Ps
# busy at either thread count, while separate processes ran normally.)
set -u
cmd=${1:-}
case "$cmd" in
build)
	set -e
	export CGO_ENABLED=0 GOOS=linux GOARCH=amd64 GOFLAGS=-mod=mod
	tmp=$(mktemp -d)
	go build -trimpath -ldflags='-s -w' -o "$tmp/csastep" ./bench/csastep
	for p in attention engine kvcache; do
		go test -c -trimpath -ldflags='-s -w' -o "$tmp/$p.test" ./$p
	done
	mkdir -p bench/bin
	tar -C "$tmp" -czf bench/bin/gpuhost.tgz csastep attention.test engine.test kvcache.test
	rm -rf "$tmp"
	ls -l bench/bin/gpuhost.tgz
	tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
	carried=$(du -cb bench/bin | tail -1 | cut -f1)
	echo "working tree that travels: $(( (tracked + carried) >> 20 )) MiB (limit 64)"
	;;
run)
	dest=${2:-${OUT:-/tmp/gpuhost}}
	mkdir -p "$dest" && dest=$(cd "$dest" && pwd)
	out=$(mktemp -d) # the raw outputs; dest gets summary.md, csastep.json and raw.txt (the device tool returns ≤ 8 files)
	B=/tmp/sparsemla-bin
	here=$(cd "$(dirname "$0")" && pwd) # torch_step.py and benchmed.py sit beside this script
	mkdir -p $B
	if ! tar -C $B -xzf "${GPUHOST_BIN:-bench/bin/gpuhost.tgz}"; then
		echo "bench/bin/gpuhost.tgz missing: run 'bash bench/gpuhost.sh build' on the development machine and carry bench/bin" >&2
		exit 2
	fi
	export PYTHONUNBUFFERED=1
	PY=${PY:-python3} # the GPU host's python3 holds PyTorch
	threads=16,2,8,4,1 reps=3 runs=10 cpus=2,8,16 big=1 count=${GPUHOST_COUNT:-3} # 16 and 2 first: torch.compile compiles in that order within its budget
	compile=bf16 dists='' csatime=230 parts="csa step gemv kv phases" before_cpus=2,8,16 phase_cpus=16,1,2,8
	# time-based: %stream is the median over 16 MiB windows (attention's streamPair)
	gemvtime=${GPUHOST_GEMVTIME:-300ms}
	if [ "${GPUHOST_QUICK:-}" = 1 ]; then
		threads=1,2 reps=1 runs=2 cpus=1,2 big=0 count=1
	fi
	if [ "${GPUHOST_SHORT:-}" = 1 ]; then
		# about 100 s: checkpoint codes only, one round of 5 PyTorch steps
		# without torch.compile, the CSA comparison last
		reps=1 runs=5 compile='' dists=checkpoint count=1 csatime=45 parts="gemv step csa" before_cpus=2,16
	fi
	parts=${GPUHOST_PARTS:-$parts} # e.g. "csa" or "step gemv kv": a run split over two device calls
	{
		date -u
		echo "nproc $(nproc)"
		lscpu 2>/dev/null | grep -E 'Model name|Socket|Core|Thread|NUMA|MHz|L3|Flags' | cut -c1-400
		$PY -c 'import torch; print("torch", torch.__version__); print(torch.__config__.parallel_info())'
		free -g
		echo "uname -r $(uname -r)" # 4.4.0: gVisor; *-fc-*: Firecracker
		grep -h Cpus_allowed_list /proc/self/status
		cat /sys/fs/cgroup/cpu.max 2>/dev/null | sed 's/^/cgroup cpu.max /'
		# transparent huge pages (the packed weights are on base pages: bench/README.md round 17)
		cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null | sed 's/^/thp enabled /'
	} >"$out/env.txt" 2>&1
	t0=$(date +%s)
	# one process per run; each test binary runs in its package's directory, as go test does
	step() { # step BINARY BENCH CPU FILE
		(cd engine && SPARSEMLA_BENCH_BIG=$big timeout 90 "$1" -test.run '^$' -test.bench "$2" \
			-test.cpu $3 -test.benchtime 5x -test.count 1 -test.timeout 0 >>"$4" 2>&1)
		echo "exit $? after $(( $(date +%s) - t0 )) s"
	}
	gemv() { # gemv BINARY CPUS FILE: one process per thread count
		for c in ${2//,/ }; do
			(cd attention && timeout 100 "$1" -test.run '^$' -test.bench "StreamRead/(scan|load)/allcores|StreamReadPerCall|FP8PanelsLinear/$dists|FP8PanelsLinearShared/$dists|FP8PanelsWoA/$dists|FP8CallTimeline" \
				-test.cpu $c -test.benchtime $gemvtime -test.count $count -test.timeout 0 >>"$3" 2>&1)
			echo "exit $? after $(( $(date +%s) - t0 )) s"
		done
	}
	for part in $parts; do
		case $part in
		csa)
			echo "=== 1. CSA-layer step side by side ($(date -u +%T))"
			timeout $csatime $PY "$here/torch_step.py" /tmp/csastep \
				--go-server "$B/csastep -serve -out /tmp/csastep -runs 5" \
				--threads-list $threads --reps $reps --runs $runs --compile "$compile" --compile-budget 90 \
				--out "$out/csastep" >"$out/csastep.log" 2>&1
			echo "exit $? after $(( $(date +%s) - t0 )) s"; tail -15 "$out/csastep.log"
			;;
		step)
			echo "=== 2. 43-layer step at 64K ($(date -u +%T))"
			: >"$out/model_step.txt"
			step $B/engine.test 'PreparedModelStep/ctx=65536' 16 "$out/model_step.txt"
			if [ "${GPUHOST_SHORT:-}" != 1 ] && [ "${GPUHOST_STEP_BRIEF:-}" = 1 ]; then
				step $B/engine.test 'PreparedModelStep/ctx=65536' 2 "$out/model_step.txt"
			elif [ "${GPUHOST_SHORT:-}" != 1 ]; then
				# (its setup, 43 layers generated at 2 threads, takes long)
				step $B/engine.test 'PreparedModelStep/ctx=65536' 2 "$out/model_step.txt"
				# the uniform codes the earlier runs drew, 16 threads (a worse case for the widening)
				step $B/engine.test 'PreparedModelStep/uniform/ctx=65536' 16 "$out/model_step.txt"
				# checkpoint codes again, after uniform: tells the code's doing from the moment's
				: >"$out/model_step_again.txt"
				step $B/engine.test 'PreparedModelStep/ctx=65536' 16 "$out/model_step_again.txt"
			fi
			grep -h Benchmark "$out/model_step.txt" "$out/model_step_again.txt" 2>/dev/null
			if [ -n "${GPUHOST_BEFORE:-}" ]; then
				O=/tmp/sparsemla-before
				mkdir -p $O && tar -C $O -xzf "$GPUHOST_BEFORE" attention.test engine.test
				: >"$out/model_step_before.txt"
				step $O/engine.test 'PreparedModelStep/ctx=65536' 16 "$out/model_step_before.txt"
				grep Benchmark "$out/model_step_before.txt"
			fi
			;;
		gemv)
			echo "=== 3. FP8 GEMVs and the streaming read ($(date -u +%T))"
			: >"$out/kernels.txt"
			gemv $B/attention.test $cpus "$out/kernels.txt"
			# the kernel's own speed, one core, cache-resident weight
			(cd attention && timeout 20 $B/attention.test -test.run '^$' -test.bench "FP8PanelsInCache/$dists" -test.cpu 1 -test.count $count \
				-test.benchtime 200ms >>"$out/kernels.txt" 2>&1)
			if [ -n "${GPUHOST_BEFORE:-}" ]; then
				echo "=== 3b. the earlier build's checkpoint-code GEMVs ($(date -u +%T))"
				O=/tmp/sparsemla-before
				mkdir -p $O && tar -C $O -xzf "$GPUHOST_BEFORE" attention.test engine.test
				: >"$out/kernels_before.txt"
				dists=checkpoint gemv $O/attention.test $before_cpus "$out/kernels_before.txt"
			fi
			;;
		phases)
			echo "=== 5. CSA-layer step phases at 64K ($(date -u +%T))"
			: >"$out/phases.txt"
			for c in ${phase_cpus//,/ }; do
				(cd engine && timeout 120 $B/engine.test -test.run '^$' -test.bench 'PreparedStepPhases/CSA' \
					-test.cpu $c -test.benchtime 40x -test.count $count -test.timeout 0 >>"$out/phases.txt" 2>&1)
				echo "exit $? after $(( $(date +%s) - t0 )) s"
				if [ -n "${GPUHOST_BEFORE:-}" ]; then
					# the earlier build's whole CSA step, same thread count, next process
					O=/tmp/sparsemla-before
					mkdir -p $O && tar -C $O -xzf "$GPUHOST_BEFORE" engine.test
					(cd engine && timeout 120 $O/engine.test -test.run '^$' -test.bench 'PreparedLayerStep/CSA/ctx=65536$' \
						-test.cpu $c -test.benchtime 40x -test.count $count -test.timeout 0 >>"$out/phases_before.txt" 2>&1)
				fi
			done
			;;
		avx512)
			echo "=== 6. the AVX-512 kernels against their AVX2 forms, same build ($(date -u +%T))"
			# SPARSEMLA_AVX512=0 runs every kernel in its AVX2 form; two
			# alternations, one process each: the kernels on one core
			# (in cache: FP8PanelsInCache; out of memory: FP8PanelsLinear
			# with its paired one-thread streaming read, Panels; the
			# attention and the index scoring at 64K), then the CSA step's
			# phases at 1 and 16 threads
			: >"$out/avx512.txt"
			for r in 1 2; do
				for z in 0 1; do
					echo "### SPARSEMLA_AVX512=$z round $r kernels" >>"$out/avx512.txt"
					(cd attention && SPARSEMLA_AVX512=$z timeout 60 $B/attention.test -test.run '^$' \
						-test.bench 'FP8PanelsInCache|FP8PanelsLinear/checkpoint|Panels$|SparseAttnFast/fast|IndexScoresFast/ctx=65536' \
						-test.cpu 1 -test.benchtime 200ms -test.count 1 -test.timeout 0 >>"$out/avx512.txt" 2>&1)
					echo "exit $? after $(( $(date +%s) - t0 )) s"
				done
			done
			for r in 1 2; do
				for c in 1 16; do
					for z in 0 1; do
						echo "### SPARSEMLA_AVX512=$z round $r step cpu $c" >>"$out/avx512.txt"
						(cd engine && SPARSEMLA_AVX512=$z timeout 60 $B/engine.test -test.run '^$' -test.bench 'PreparedStepPhases/CSA' \
							-test.cpu $c -test.benchtime 40x -test.count 1 -test.timeout 0 >>"$out/avx512.txt" 2>&1)
					done
				done
				echo "exit $? after $(( $(date +%s) - t0 )) s"
			done
			;;
		kv)
			echo "=== 4. KV page decode ($(date -u +%T))"
			(cd kvcache && timeout 20 $B/kvcache.test -test.run '^$' -test.bench 'DecodePage' -test.cpu 1 -test.count 3 \
				-test.benchtime 200ms >"$out/kvcache.txt" 2>&1)
			echo "exit $? after $(( $(date +%s) - t0 )) s"
			;;
		esac
	done
	$PY "$here/benchmed.py" "$out" >"$dest/summary.md"
	cp "$out/csastep.json" "$dest/" 2>/dev/null
	for f in env.txt csastep.log model_step.txt model_step_again.txt kernels.txt kvcache.txt kernels_before.txt model_step_before.txt phases.txt phases_before.txt avx512.txt; do
		echo "===== $f"
		cat "$out/$f" 2>/dev/null
	done >"$dest/raw.txt"
	cat "$dest/summary.md"
	;;
*)
	echo "usage: bash bench/gpuhost.sh build | run [OUTDIR]" >&2
	exit 2
	;;
esac
