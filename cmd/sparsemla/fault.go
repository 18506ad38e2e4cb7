package main

import (
	"cmp"
	"flag"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"

	"sparsemla/dump"
	"sparsemla/fault"
	"sparsemla/replay"
)

func init() {
	register(&command{
		name:    "fault",
		summary: "write a copy of any dump with a GPU fault injected (replays to that fault)",
		run:     runFault,
	})
}

const faultDoc = `Writes into DIR a copy of the dump DUMP (any format replay reads: a native dump,
a GPU safetensors directory such as testdata/official-v4-tiny, ...) with one GPU
fault injected at decode step P, layer L, the way a buggy GPU would have
produced it: the faulty stage's dumped value is corrupted, and every stage
downstream of it is recomputed from it with the reference as the GPU would
have: the rest of the layer, the layers above it (their input streams are the
layer's output), the logits, and the later steps through the caches and states
the fault changed (so a local replay names exactly the injected stage and
nothing after it fails). The tokens fed stay as dumped. What the dump does not
let it recompute (steps or layers it does not hold, a layer of the attention
path only) stays as dumped and is printed under "not recomputed". Everything
else is copied unchanged. DIR gets
dump.smd (native), config.json and a copy of the weights, so
'sparsemla replay DIR' needs no flags. Fault kinds (KIND@P,L):
  splitk-merge     sparse-attention split-K combine adds a partial unscaled
  wrong-lse        the combine's LSE misses the attention sink
  fp8-scale        FQ8 block scale rounded down instead of up (window K)
  scale-byte       one UE8M0 scale byte of an older cache row has a bit flipped (--seed picks the block)
  topk-off-by-one  the indexer's last top-k row is off by one (CSA layers, Tc > index_topk)
  stale-prefix     the last four window rows come from another request's page (--seed picks its tokens)
  compressor-late  the compressed row is written one step late (CSA/HCA layers, emission steps)
  window-order     the window index list puts its -1 padding first (the V4.1 layout; steps < window-1)
  expert-nibble    the routed experts' FP4 GEMM reads the even column from the high nibble (ffn_out)
  router-bias      the router ranks the experts without the selection bias (moe_indices; score layers)
  hc-post-transposed  the attention hc_post mixes the residual streams with comb transposed (h_mid)
  router-hash-off  the hash router reads tid2eid of token id tok+1 (moe_indices; hash layers)
  router-unnormalised  the router's weights are not divided by their sum (moe_weights)
  expert-scale-block  the routed experts' FP4 scales are read per 128 columns, not 32 (ffn_out)
  expert-no-clamp  the routed experts skip the swiglu_limit clamp (ffn_out; where it would act)
  shared-gate-up-swapped  the shared expert runs with w1 and w3 exchanged (ffn_out)
  hc-split-no-sigmoid  the FFN hc_split_sinkhorn leaves the sigmoid out of post (hc_ffn_post)
  head-no-norm     the head skips the final RMSNorm (logits; the last layer)
The kinds from expert-nibble on need the whole layer's weights
(hyper-connections, MoE, head), as the official layout's weights file holds them.
A DeepSeek-V3.2 dump takes splitk-merge, scale-byte (an index-key scale) and
topk-off-by-one, and with the layer's norm and FFN weights router-bias (a gate
with a bias), router-unnormalised, shared-gate-up-swapped, head-no-norm and two
kinds of its own:
  router-groups-ignored  the router's top-k ignores the expert groups (moe_indices; n_expert_groups > 1)
  dense-gate-up-swapped  the dense MLP runs with w1 and w3 exchanged (ffn_out; layer < n_dense_layers)
the other kinds are refused with the reason. router-bias and router-groups-ignored
need a gate with a bias and a group limit: testdata/v32-tiny has neither (refused),
a dump of 'sparsemla synth --config v32-tiny-grouped --whole' has both.
A fault that cannot happen at P, L (or would not change its stage beyond
tolerance there) is refused with exit status 2. DIR must be new, empty or an
earlier copy (replaced). Replay DUMP first: if it already diverges before P, its
copy reports that earlier divergence first.
A DeepSeek-V4.1 dump directory (its config.json) takes window-order (there the
V4 order, -1 padding last, is the fault; steps < window-1) and topk-off-by-one
(index-source layers, Tc > index_topk); the other kinds are refused. The copy
keeps the V4.1 layout: the step file of P is rewritten, the rest copied (in a
whole dump the later steps are left out, their state would follow from the
fault; in a dump of the attention sub-layers the later layers' inputs x stay as
dumped: both printed under "not recomputed").`

func runFault(args []string, stdout, stderr io.Writer) int {
	fs := rpFlagSet("fault", "fault --in DUMP --out DIR --fault KIND@step,layer [--seed S] [--weights W] [--map FILE] [--request R] [--reference]", faultDoc, stdout, stderr)
	in := fs.String("in", "", "the dump to copy (or give it as the argument)")
	out := fs.String("out", "", "output directory (required; new, empty, or an earlier copy to replace)")
	faultFlag := fs.String("fault", "", "the fault, KIND@step,layer (required; see above)")
	seed := fs.Uint64("seed", 1, "seed of what the fault leaves to chance (scale-byte block, stale-prefix donor tokens)")
	var f replayFlags
	fs.StringVar(&f.weights, "weights", "", "weights of DUMP: a safetensors file or a directory with weights.safetensors (default: beside the dump); copied into DIR")
	fs.StringVar(&f.mapFile, "map", "", "name map for non-native dumps: a JSON file or a built-in name (default: detected)")
	fs.StringVar(&f.request, "request", "", "request to fault when the dump holds several (default: the one replay picks)")
	fs.BoolVar(&f.reference, "reference", false, referenceUsage)
	pos, err := rpParseArgs(fs, args)
	if err == flag.ErrHelp {
		return exitOK
	}
	if err != nil {
		return exitError
	}
	if len(pos) == 1 && *in == "" {
		*in = pos[0]
		pos = nil
	}
	if len(pos) != 0 || *in == "" || *out == "" || *faultFlag == "" {
		rpUsageError(fs, "want one input dump, --out DIR and --fault KIND@STEP,LAYER")
		return exitError
	}
	flt, err := fault.Parse(*faultFlag)
	if err != nil {
		return rpFail(stderr, "fault", err)
	}
	if replay.IsV41(*in) {
		return runFaultV41(*in, *out, flt, &f, stdout, stderr)
	}
	o, err := rpOpenDump(*in, &f, modelRequired)
	if err != nil {
		return rpFail(stderr, "fault", err)
	}
	defer o.Close()
	res, err := fault.WriteFaulted(o.d, o.src, o.model, *out, fault.Options{
		Fault: flt, Seed: *seed, Weights: f.weights,
	})
	if err != nil {
		return rpFail(stderr, "fault", err)
	}
	fmt.Fprintf(stdout, "wrote %s: %s with fault %s (%d records)\n", res.Dir, *in, flt, res.Records)
	fmt.Fprintf(stdout, "  first divergence expected: decode step %d, layer %d, stage %s — %s\n", flt.Step, flt.Layer, flt.StageIn(o.model.Cfg), flt.DiagnosisIn(o.model.Cfg))
	var site, down []replay.StageKey
	for _, k := range res.Changed {
		if k.Step == flt.Step && (k.Layer == flt.Layer || (k.Layer == dump.Global && k.Stage == flt.StageIn(o.model.Cfg))) {
			site = append(site, k)
		} else {
			down = append(down, k)
		}
	}
	fmt.Fprintf(stdout, "  changed: %s\n", stageKeys(site))
	if len(down) > 0 {
		fmt.Fprintf(stdout, "  recomputed downstream from the faulty values: %d record%s (%s)\n", len(down), plural(len(down)), downstream(down))
	}
	if len(res.Dropped) > 0 {
		fmt.Fprintf(stdout, "  left out (not computed by the faulty GPU): %s\n", stageKeys(res.Dropped))
	}
	for _, n := range res.NotRecomputed {
		fmt.Fprintf(stdout, "  not recomputed (kept as dumped): %s\n", n)
	}
	if res.Pages > 0 {
		fmt.Fprintf(stdout, "  KV page records re-encoded: %d\n", res.Pages)
	}
	if res.Donor != "" {
		fmt.Fprintf(stdout, "  prefix-cache hit of %d tokens from request %q added, with its kv_cache at step %d\n", flt.Step, res.Donor, flt.Step)
	}
	if res.Unmapped > 0 {
		fmt.Fprintf(stdout, "  note: %d tensors of the input matched no name-map rule and are not in the copy\n", res.Unmapped)
	}
	fmt.Fprintf(stdout, "replay it: sparsemla replay %s\n", res.Dir)
	return exitOK
}

// downstream summarises stage keys (sorted by step, then layer) by step:
// "step 6: layers 2, 3, logits; step 7: layers 1, 2, 3, logits" (a global
// stage by its name).
func downstream(keys []replay.StageKey) string {
	var parts []string
	for i := 0; i < len(keys); {
		var what []string
		seen := map[string]bool{}
		j := i
		for ; j < len(keys) && keys[j].Step == keys[i].Step; j++ {
			w := fmt.Sprint(keys[j].Layer)
			if keys[j].Layer == dump.Global {
				w = keys[j].Stage
			}
			if !seen[w] {
				seen[w] = true
				what = append(what, w)
			}
		}
		// Layers first, global stages after them (sorted keys put the
		// global layer first).
		var layers, globals []string
		for _, w := range what {
			if w[0] >= '0' && w[0] <= '9' {
				layers = append(layers, w)
			} else {
				globals = append(globals, w)
			}
		}
		var s []string
		if len(layers) == 1 {
			s = append(s, "layer "+layers[0])
		} else if len(layers) > 1 {
			s = append(s, "layers "+strings.Join(layers, ", "))
		}
		s = append(s, globals...)
		parts = append(parts, fmt.Sprintf("step %d: %s", keys[i].Step, strings.Join(s, ", ")))
		i = j
	}
	return strings.Join(parts, "; ")
}

// stageKeys prints stage keys grouped by step and layer:
// "p5/L1: o, o_inv, u, y; p6/L1: ..."; the stages of no layer (layer -1:
// the head's logits) as "p5/head: logits", after the step's layers.
func stageKeys(keys []replay.StageKey) string {
	if len(keys) == 0 {
		return "nothing"
	}
	layerOrder := func(l int) int {
		if l < 0 {
			return math.MaxInt // the head comes after the last layer
		}
		return l
	}
	keys = slices.Clone(keys)
	slices.SortStableFunc(keys, func(a, b replay.StageKey) int {
		return cmp.Or(cmp.Compare(a.Step, b.Step), cmp.Compare(layerOrder(a.Layer), layerOrder(b.Layer)))
	})
	var parts []string
	for i := 0; i < len(keys); {
		j := i
		var names []string
		for j < len(keys) && keys[j].Step == keys[i].Step && keys[j].Layer == keys[i].Layer {
			names = append(names, keys[j].Stage)
			j++
		}
		where := fmt.Sprintf("L%d", keys[i].Layer)
		if keys[i].Layer < 0 {
			where = "head"
		}
		parts = append(parts, fmt.Sprintf("p%d/%s: %s", keys[i].Step, where, strings.Join(names, ", ")))
		i = j
	}
	return strings.Join(parts, "; ")
}

// plural is "s" unless n is 1.
func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}
