// Command csastep times one V4-Flash CSA-layer decode step (layer 2, real
// dims, context 65,536 tokens) with sparsemla's prepared fast path and writes
// the step's exact inputs (FP8 codes + scales, bf16/fp32 weights, caches,
// compressor states, x, RoPE cos/sin) and its output y to a directory, so that
// bench/torch_step.py can time the same step in PyTorch on the same inputs.
// bench/compare.sh runs both.
//
//	go run ./bench/csastep -out /tmp/csastep [-ctx 65536] [-runs 20]
//
// It prints the median step time and writes manifest.json beside the inputs.
//
// With -serve it then stays up for bench/torch_step.py --go-server, which
// interleaves sparsemla's and PyTorch's runs: each line "run T N" on stdin
// sets GOMAXPROCS to T, runs one untimed and N timed steps from the same
// state and answers one JSON line {"threads", "ms", "same_bits"} (same_bits:
// y is bit-identical to the first step's y, whatever T); "quit" ends it.
package main
