package fault

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/head"
	"sparsemla/mhc"
	"sparsemla/quant"
	"sparsemla/replay"
)

// Kind names a GPU bug Synthesize can inject.
type Kind string

// The injectable faults. Each is applied the way a buggy GPU produces it: the
// faulty value replaces the stage's value and every later stage of the step
// (and later steps, through the cache) is computed from it.
const (
	// SplitKMerge: the split-K combine of sparse attention adds the second
	// split's partial output without rescaling it by 2^(LSE2_1 − L).
	SplitKMerge Kind = "splitk-merge"
	// WrongLSE: the combine's total LSE misses the attention-sink term, so every
	// head's output is the reference times 1 + e^(σ_h − lse_h).
	WrongLSE Kind = "wrong-lse"
	// FP8Scale: FQ8 of the window K picks its block scales by rounding
	// amax/448 down to a power of two instead of up (spec §9.4).
	FP8Scale Kind = "fp8-scale"
	// ScaleByte: bit 0 of one UE8M0 scale byte of an older window row's
	// cache page flips, so one 64-block of that row reads ×2 or ÷2.
	ScaleByte Kind = "scale-byte"
	// TopKOffByOne: the indexer's top-k returns its last row off by one (row j+1
	// or j−1 instead of j). As in a real off-by-one bug, the neighbour may
	// already be selected, so the list can name a row twice; the diagnosis
	// says so.
	TopKOffByOne Kind = "topk-off-by-one"
	// StalePrefix: window rows of the last four tokens are served from
	// another request's cache page (a stale prefix-cache page).
	StalePrefix Kind = "stale-prefix"
	// CompressorLate: the main compressor (CSA or HCA) writes its row one step
	// late: at the emission step the cache row is still zero, it appears at
	// the next step.
	CompressorLate Kind = "compressor-late"
	// WindowOrder: the window part of the index list puts its -1
	// padding first (the V4.1 layout, spec §11 item 9) in a V4 model; steps
	// p < W-1 only (later windows have no padding).
	WindowOrder Kind = "window-order"
	// ExpertNibble: the routed experts' FP4 GEMM reads the even column of
	// each packed byte from the HIGH nibble (float4_e2m1fn_x2 keeps it in the
	// low one): ffn_out is computed with every routed weight's nibbles
	// swapped. Needs the whole layer's weights.
	ExpertNibble Kind = "expert-nibble"
	// RouterBias: the router ranks the experts by their scores without the
	// selection bias (gate.bias), so moe_indices is top-k of the plain
	// scores. Score layers only (not the first n_hash_layers); refused where
	// the bias does not change the choice. Needs the whole layer's weights.
	RouterBias Kind = "router-bias"
	// HCPostTransposed: the attention-side hc_post mixes the residual
	// streams with comb transposed (out_j = post_j·y + Σ_k comb[j][k]·h_k):
	// h_mid. Needs the whole layer's weights.
	HCPostTransposed Kind = "hc-post-transposed"
	// RouterHashOff: on a hash layer (layer < n_hash_layers) the router
	// reads the tid2eid row of the token id one past the token fed
	// (tid2eid[tok+1]): moe_indices. Refused on score layers, at the last
	// token id, and where the two rows are equal.
	RouterHashOff Kind = "router-hash-off"
	// RouterUnnormalised: the router's weights are the chosen experts'
	// scores × route_scale without dividing by their sum (the selection is
	// right): moe_weights. Refused for softmax gates (they do not
	// normalise).
	RouterUnnormalised Kind = "router-unnormalised"
	// ExpertScaleBlock: the routed experts' FP4 GEMM indexes the UE8M0
	// scales per 128 columns (the FP8 weight block) instead of per 32:
	// column k reads the row's scale byte k/128, not k/32 (moe's
	// ScalePer128): ffn_out.
	ExpertScaleBlock Kind = "expert-scale-block"
	// ExpertNoClamp: the routed experts skip the swiglu_limit clamp (up to
	// ±limit, gate ≤ limit): ffn_out. Refused where no routed expert's gate
	// or up reaches the limit (the clamp would not act).
	ExpertNoClamp Kind = "expert-no-clamp"
	// SharedGateUp: the shared expert runs with its gate (w1) and up (w3)
	// weights exchanged, h = silu(w3·x)·(w1·x) (a name map swapping
	// gate_proj and up_proj of shared_experts): ffn_out.
	SharedGateUp Kind = "shared-gate-up-swapped"
	// HCSplitNoSigmoid: the FFN-side hc_split_sinkhorn leaves the sigmoid
	// out of post (post = 2·(mixes[hc:2hc]·scale[1] + base[hc:2hc])):
	// hc_ffn_post, and the h_out it weights.
	HCSplitNoSigmoid Kind = "hc-split-no-sigmoid"
	// HeadNoNorm: the head skips the final RMSNorm (norm.weight): the
	// logits are head · hc_head(h_out). The last layer only.
	HeadNoNorm Kind = "head-no-norm"
)

// Kinds lists every injectable fault.
func Kinds() []Kind {
	return []Kind{SplitKMerge, WrongLSE, FP8Scale, ScaleByte, TopKOffByOne, StalePrefix, CompressorLate, WindowOrder,
		ExpertNibble, RouterBias, HCPostTransposed, RouterHashOff, RouterUnnormalised, ExpertScaleBlock, ExpertNoClamp,
		SharedGateUp, HCSplitNoSigmoid, HeadNoNorm}
}

// NeedsBlock reports whether the fault lives around the attention sub-layer
// (hyper-connections, MoE): it needs a model with the whole layer's weights
// (a dump of the official layout with its weights), which synthetic models
// do not have.
func (f Fault) NeedsBlock() bool {
	switch f.Kind {
	case ExpertNibble, RouterBias, HCPostTransposed, RouterHashOff, RouterUnnormalised, ExpertScaleBlock, ExpertNoClamp,
		SharedGateUp, HCSplitNoSigmoid, HeadNoNorm, RouterGroupsIgnored, DenseGateUp:
		return true
	}
	return false
}

// Fault is one injected fault at decode step Step, layer Layer.
type Fault struct {
	Kind  Kind
	Step  int64
	Layer int
}

func (f Fault) String() string { return fmt.Sprintf("%s@%d,%d", f.Kind, f.Step, f.Layer) }

// Parse parses "KIND@step,layer".
func Parse(s string) (Fault, error) {
	kind, at, ok := strings.Cut(s, "@")
	if !ok {
		return Fault{}, fmt.Errorf("fault %q: want KIND@step,layer", s)
	}
	ps, ls, ok := strings.Cut(at, ",")
	if !ok {
		return Fault{}, fmt.Errorf("fault %q: want KIND@step,layer", s)
	}
	p, err1 := strconv.ParseInt(ps, 10, 64)
	l, err2 := strconv.Atoi(ls)
	if err1 != nil || err2 != nil {
		return Fault{}, fmt.Errorf("fault %q: step and layer must be integers", s)
	}
	f := Fault{Kind: Kind(kind), Step: p, Layer: l}
	all := append(Kinds(), V32Kinds()...)
	for _, k := range all {
		if k == f.Kind {
			return f, nil
		}
	}
	var names []string
	for _, k := range all {
		names = append(names, string(k))
	}
	return Fault{}, fmt.Errorf("fault %q: unknown kind %q (have %s)", s, kind, strings.Join(names, ", "))
}

// Stage is the stage where the fault first shows: the first divergence a
// local replay must report.
func (f Fault) Stage() string {
	switch f.Kind {
	case SplitKMerge, WrongLSE:
		return "o"
	case FP8Scale:
		return "kv"
	case TopKOffByOne:
		return "index_topk"
	case WindowOrder:
		return "topk_idxs"
	case ExpertNibble, ExpertScaleBlock, ExpertNoClamp, SharedGateUp:
		return "ffn_out"
	case RouterBias, RouterHashOff:
		return "moe_indices"
	case RouterUnnormalised:
		return "moe_weights"
	case HCPostTransposed:
		return "h_mid"
	case HCSplitNoSigmoid:
		return "hc_ffn_post"
	case HeadNoNorm:
		return "logits"
	}
	return "kv_cache"
}

// Diagnosis is the diagnosis kind a replay must give the fault.
func (f Fault) Diagnosis() string {
	switch f.Kind {
	case SplitKMerge, WrongLSE:
		return replay.KindAttention
	case FP8Scale, ScaleByte:
		return replay.KindFP8Cache
	case TopKOffByOne:
		return replay.KindIndexer
	case StalePrefix:
		return replay.KindPrefix
	case WindowOrder:
		return replay.KindIndexList
	case ExpertNibble, ExpertScaleBlock, ExpertNoClamp, SharedGateUp:
		return replay.KindExperts
	case RouterBias, RouterHashOff, RouterUnnormalised:
		return replay.KindRouter
	case HCPostTransposed, HCSplitNoSigmoid:
		return replay.KindHyperConn
	case HeadNoNorm:
		return replay.KindHead
	}
	return replay.KindCompressor
}

// Check reports whether the fault can be injected at its position in cfg
// with a dump of steps first..last.
func (f Fault) Check(cfg *engine.Config, first, last int64) error {
	if f.Layer < 0 || f.Layer >= cfg.NLayers {
		return fmt.Errorf("fault %s: layer outside 0..%d", f, cfg.NLayers-1)
	}
	if f.Step < first || f.Step > last {
		return fmt.Errorf("fault %s: step outside the dumped steps %d..%d", f, first, last)
	}
	if cfg.V32() {
		return f.checkV32(cfg)
	}
	if err := v32OnlyRefusal(f); err != nil {
		return err
	}
	r := cfg.Ratio(f.Layer)
	switch f.Kind {
	case TopKOffByOne:
		if r != 4 {
			return fmt.Errorf("fault %s: layer %d has no indexer (r = %d)", f, f.Layer, r)
		}
		if (f.Step+1)/4 < 2 {
			return fmt.Errorf("fault %s: needs at least 2 compressed rows (step >= 7)", f)
		}
	case CompressorLate:
		if r == 0 {
			return fmt.Errorf("fault %s: needs a compressed layer (CSA r = 4 or HCA r = 128), layer %d has no compressor", f, f.Layer)
		}
		if !attention.EmitsRow(f.Step, r) {
			return fmt.Errorf("fault %s: step %d is not an emission step of r = %d", f, f.Step, r)
		}
	case ScaleByte, StalePrefix:
		if f.Step < 1 {
			return fmt.Errorf("fault %s: needs an earlier token in the window", f)
		}
	case WindowOrder:
		if f.Step >= int64(cfg.WindowSize-1) {
			return fmt.Errorf("fault %s: the window list has no -1 padding at step >= %d", f, cfg.WindowSize-1)
		}
	case RouterBias:
		if cfg.HashLayer(f.Layer) {
			return fmt.Errorf("fault %s: layer %d routes by token id (hash, layer < n_hash_layers = %d): it has no selection bias", f, f.Layer, cfg.NHashLayers)
		}
	case RouterHashOff:
		if !cfg.HashLayer(f.Layer) {
			return fmt.Errorf("fault %s: layer %d routes by score (top-k of score + bias; layer >= n_hash_layers = %d): it has no tid2eid lookup", f, f.Layer, cfg.NHashLayers)
		}
	case RouterUnnormalised:
		if cfg.ScoreFunc == "softmax" {
			return fmt.Errorf("fault %s: score_func softmax does not normalise the chosen weights: nothing to leave out", f)
		}
	case ExpertNoClamp:
		if cfg.SwigluLimit <= 0 {
			return fmt.Errorf("fault %s: the model has no swiglu_limit clamp to leave out", f)
		}
	case HeadNoNorm:
		if f.Layer != cfg.NLayers-1 {
			return fmt.Errorf("fault %s: the head runs after the last layer (%d) only", f, cfg.NLayers-1)
		}
	}
	return nil
}

// SynthOptions configure Synthesize.
type SynthOptions struct {
	Config string // preset name (default "tiny")
	// Cfg, when set, is the configuration instead of a preset (validated;
	// copied): e.g. the smallest model the engine allows, for a fuzzer.
	// Config then only names it in the dump's source name (default "custom").
	Cfg *engine.Config
	// PageBlock is the entries per KV page Write encodes (0: SynthPageBlock,
	// the engines' 64; a fuzzer's small model takes 4).
	PageBlock int
	Prefill   int // positions 0..Prefill-1 run before the dump (the start state is valid after Prefill-1)
	Steps     int // decode steps dumped: Prefill .. Prefill+Steps-1
	Seed      uint64
	Fault     *Fault
	// Whole makes the whole model (engine.BlockStages): every layer's
	// hyper-connections, norms and MoE (engine.RandomBlockWeights), the
	// embedding and the head (engine.RandomHead), a seeded random token
	// stream, and every whole-step stage in the dump (h_in, hc_attn_*,
	// attn_norm_in, x, …, h_mid, hc_ffn_*, ffn_norm_in, ffn_in, moe_indices,
	// moe_weights, ffn_out, h_out, and the global tok and logits). Its
	// swiglu_limit is SynthWholeSwigluLimit (the preset's 10 is out of reach
	// of the synthetic activations), so the clamp acts and expert-no-clamp
	// can be injected. Without it the model is the attention path only.
	// On a V3.2 config it is the whole V3.2 layer instead
	// (engine.V32BlockStages with engine.RandomV32FFNWeights): a seeded
	// random x_in for layer 0, x_in / res_in = ffn_out / h_mid of the layer
	// below, and the norms, FFN and logits in the dump.
	Whole bool
}

// SynthWholeSwigluLimit is the swiglu_limit of a whole synthetic model
// (SynthOptions.Whole), written into its config: the routed experts' gate
// and up projections of the synthetic model are about N(0, 1) (weights
// N(0, 1/in) on RMS-normed inputs), so a limit of 2 clamps a few percent of
// them, as the preset's 10 does to a real model's outliers.
const SynthWholeSwigluLimit = 2

// Synth is a synthetic model and the dump a GPU running it would write.
type Synth struct {
	Cfg     *engine.Config
	Weights map[int]*engine.LayerWeights
	Rope    map[int]*engine.RopeTable
	Head    *engine.HeadWeights // the embedding and the head (whole models only; nil otherwise)
	Src     *replay.MemSource   // request "B" (the replayed one)
	Fault   *Fault
	Seed    uint64
	// PageBlock is the entries per KV page Write encodes (0: SynthPageBlock).
	PageBlock int
}

// Model returns the reference model of the synthetic dump (its RoPE tables
// are the ones the "GPU" used, so they count as the GPU's own).
func (s *Synth) Model() *engine.Model {
	return &engine.Model{Cfg: s.Cfg, Weights: s.Weights, Rope: s.Rope, Head: s.Head, GPURope: true}
}

// ErrInvisible is returned when a fault, injected at the position asked
// for, does not change its stage beyond tolerance (e.g. a rescaling by a
// factor too close to 1); pick another position.
var ErrInvisible = errors.New("the injected fault does not change its stage beyond tolerance here")

// Request names used by synthetic dumps: B is replayed; A is the other request
// whose pages a stale prefix-cache hit serves.
const (
	SynthRequest      = "B"
	SynthOtherRequest = "A"
)

// Synthesize builds a seeded random model of the preset and runs the
// reference over a seeded random sequence as a GPU would, recording every stage
// of the dumped steps, the start state, and (with a fault) the faulty values.
//
// The attention input x of layer l is a weightless RMS norm of a residual
// stream h (h₀ = a random bf16 embedding per token, h_{l+1} = bf16(h_l + y_l)):
// synthetic glue standing in for the mHC block, so that an error in one
// layer's output reaches the next layer's input as it would on a GPU. With
// opt.Whole the model is the whole one instead: layer 0's h_in is the
// embedding of a seeded random token, each later layer's h_in the h_out of
// the layer below, every stage of engine.BlockStages computed by the
// reference (and the last layer's logits).
func Synthesize(opt SynthOptions) (*Synth, error) {
	if opt.Config == "" {
		opt.Config = "tiny"
		if opt.Cfg != nil {
			opt.Config = "custom"
		}
	}
	if opt.Steps <= 0 || opt.Prefill < 1 {
		return nil, fmt.Errorf("synth: need steps >= 1 and prefill >= 1")
	}
	var cfg *engine.Config
	var err error
	if opt.Cfg != nil {
		c := *opt.Cfg
		c.CompressRatios = append([]int(nil), c.CompressRatios...)
		cfg, err = &c, c.Validate()
	} else {
		cfg, err = engine.Preset(opt.Config)
	}
	if err != nil {
		return nil, err
	}
	if cfg.IsV41() {
		return nil, fmt.Errorf("synth: config %q is DeepSeek-V4.1 (CSA2): V4.1 dumps are made by SynthesizeV41 ('sparsemla synth --config %s')", opt.Config, opt.Config)
	}
	if hd := max(cfg.HeadDim, cfg.KVLoraRank); cfg.Dim*cfg.NHeads*hd*cfg.NLayers > 1<<28 { // KVLoraRank: V3.2
		return nil, fmt.Errorf("synth: preset %q would need several GB of synthetic weights; use the tiny preset", opt.Config)
	}
	first, last := int64(opt.Prefill), int64(opt.Prefill+opt.Steps-1)
	if last >= int64(cfg.MaxSeqLen) {
		return nil, fmt.Errorf("synth: %d positions exceed max_seq_len %d", last+1, cfg.MaxSeqLen)
	}
	if opt.Whole && !cfg.V32() { // V3.2: the whole layer is engine.V32BlockStages (RandomV32FFNWeights)
		cfg.SwigluLimit = SynthWholeSwigluLimit
		if err := cfg.ValidateBlock(); err != nil {
			return nil, fmt.Errorf("synth: the whole model of config %q: %w", opt.Config, err)
		}
	}
	if opt.Fault != nil {
		if opt.Fault.NeedsBlock() && !opt.Whole && cfg.V32() && opt.Fault.checkV32(cfg) == nil {
			return nil, fmt.Errorf("fault %s: needs the whole V3.2 layer (norms, FFN, head); this synthetic model holds the attention path only: make the whole model (synth --whole) or inject it into a copy of a dump with the layer's FFN weights (fault --in)", *opt.Fault)
		}
		if opt.Fault.NeedsBlock() && !opt.Whole && !cfg.V32() { // V3.2: checkV32 refuses them with its reason
			return nil, fmt.Errorf("fault %s: needs the whole layer (hyper-connections, MoE); this synthetic model holds the attention path only: make the whole model (synth --whole) or inject it into a copy of a dump of the official layout (fault --in)", *opt.Fault)
		}
		if err := opt.Fault.Check(cfg, first, last); err != nil {
			return nil, err
		}
	}
	if opt.PageBlock < 0 {
		return nil, fmt.Errorf("synth: page block %d", opt.PageBlock)
	}
	s := &Synth{Cfg: cfg, Weights: map[int]*engine.LayerWeights{}, Rope: map[int]*engine.RopeTable{}, Fault: opt.Fault, Seed: opt.Seed, PageBlock: opt.PageBlock}
	for l := 0; l < cfg.NLayers; l++ {
		s.Weights[l] = engine.RandomLayerWeights(cfg, l, opt.Seed)
		if opt.Whole && cfg.V32() {
			s.Weights[l].V32.FFN = engine.RandomV32FFNWeights(cfg, l, opt.Seed)
		} else if opt.Whole {
			s.Weights[l].Block = wholeBlockWeights(cfg, l, opt.Seed)
		}
		s.Rope[l] = engine.LayerRope(cfg, l, cfg.MaxSeqLen)
	}
	if opt.Whole && !cfg.V32() {
		s.Head = &engine.HeadWeights{Embed: engine.RandomEmbedding(cfg, opt.Seed), Head: wholeHead(cfg, opt.Seed)}
	}
	s.Src = replay.NewMemSource(fmt.Sprintf("synth(%s, seed %d)", opt.Config, opt.Seed))
	s.Src.StartAfter = first - 1

	// Request A: only needed as the source of stale pages.
	var other map[int]engine.Tensor // layer -> A's kv_cache at the fault step
	if opt.Fault != nil && opt.Fault.Kind == StalePrefix {
		other = map[int]engine.Tensor{}
		g := &gpuRun{s: s, seed: opt.Seed ^ 0xa5a5a5a5, last: opt.Fault.Step}
		g.onStep = func(p int64, l int, vals map[string]engine.Tensor) {
			if p == opt.Fault.Step {
				other[l] = vals["kv_cache"]
			}
		}
		if err := g.run(); err != nil {
			return nil, err
		}
		s.Src.Hit = &replay.PrefixHit{From: SynthOtherRequest, Tokens: opt.Fault.Step}
		s.Src.Others = map[string]map[replay.StageKey]engine.Tensor{SynthOtherRequest: {}}
		for l, t := range other {
			s.Src.Others[SynthOtherRequest][replay.StageKey{Step: opt.Fault.Step, Layer: l, Stage: "kv_cache"}] = t
		}
	}
	g := &gpuRun{s: s, seed: opt.Seed, last: last}
	if opt.Fault != nil {
		g.inj = newFaultInjector(*opt.Fault, opt.Seed, other, cfg)
	}
	g.onStep = func(p int64, l int, vals map[string]engine.Tensor) {
		if p < first {
			return
		}
		for name, t := range vals {
			if g.inj != nil && g.inj.hides(p, l, name) {
				continue
			}
			if base, ok := strings.CutPrefix(name, engine.GlobalPrefix); ok {
				s.Src.Put(p, dump.Global, base, t) // tok, logits
				continue
			}
			s.Src.Put(p, l, name, t)
		}
	}
	g.onState = func(p int64, l int, st map[string]engine.Tensor) {
		if p == first-1 {
			s.Src.Start[l] = st
		}
	}
	if err := g.run(); err != nil {
		return nil, err
	}
	return s, nil
}

// wholeBlockWeights is engine.RandomBlockWeights with the hyper-connection
// parameters at the magnitudes of the official-v4-tiny golden's weights
// (measured: hc_*_fn rms 0.031 = 1/sqrt(hc·dim), hc_*_base rms 0.5–0.6,
// hc_*_scale about 0.7–1.5): fn ×10 (N(0, 1)/sqrt(hc·dim)), base ×5
// (0.5·N), scale ×2 (1 + 0.2·N). RandomBlockWeights' own (fn 0.1/sqrt,
// base 0.1·N, scale 0.5 + 0.1·N) make every comb nearly uniform and the
// hc_mult streams nearly equal, so that a transposed comb or a wrong split
// would barely show — unlike on the GPU's model.
func wholeBlockWeights(cfg *engine.Config, layer int, seed uint64) *engine.BlockWeights {
	b := engine.RandomBlockWeights(cfg, layer, seed)
	for _, s := range []*mhc.Site{b.AttnSite, b.FFNSite} {
		scaleAll(s.Fn, 10)
		scaleAll(s.Base, 5)
		scaleAll(s.Scale, 2)
	}
	return b
}

// wholeHead is engine.RandomHead with hc_head_base and hc_head_scale at the
// golden's magnitudes (rms 0.2 and 1.15): base ×2, scale ×2.
func wholeHead(cfg *engine.Config, seed uint64) *head.Head {
	h := engine.RandomHead(cfg, seed)
	scaleAll(h.HCFn, 10)
	scaleAll(h.HCBase, 2)
	h.HCScale *= 2
	return h
}

func scaleAll(v []float32, f float32) {
	for i := range v {
		v[i] *= f
	}
}

// gpuRun runs the stage graph like a GPU: each stage from the values the
// "GPU" itself produced (faulty ones included), state carried across steps.
type gpuRun struct {
	s       *Synth
	seed    uint64
	last    int64
	inj     *faultInjector // nil: a clean run
	onStep  func(p int64, l int, vals map[string]engine.Tensor)
	onState func(p int64, l int, st map[string]engine.Tensor)
}

func (g *gpuRun) run() error {
	cfg := g.s.Cfg
	rng := rand.New(rand.NewPCG(g.seed, 0x5eed))
	states := make([]map[string]engine.Tensor, cfg.NLayers)
	for l := range states {
		states[l] = engine.NewLayerState(cfg, l).StateTensors()
	}
	if g.s.Head != nil {
		return g.runWhole(rng, states)
	}
	if w := g.s.Weights[0]; cfg.V32() && w != nil && w.V32 != nil && w.V32.FFN != nil {
		return g.runV32Whole(rng, states)
	}
	for p := int64(0); p <= g.last; p++ {
		h := make([]float32, cfg.Dim)
		for i := range h {
			h[i] = quant.BF16Round(float32(rng.NormFloat64()))
		}
		for l := 0; l < cfg.NLayers; l++ {
			x := synthNorm(h)
			vals, err := g.layerStep(p, l, map[string]engine.Tensor{"x": x}, states[l])
			if err != nil {
				return fmt.Errorf("synth: step %d layer %d: %w", p, l, err)
			}
			for name := range states[l] {
				if t, ok := vals[name]; ok {
					states[l][name] = t
				}
			}
			g.report(p, l, vals, states[l])
			y := vals["y"].F
			for i := range h {
				h[i] = quant.BF16Round(h[i] + y[i])
			}
		}
	}
	return nil
}

// report hands one layer's step to onStep and its state after it to
// onState.
func (g *gpuRun) report(p int64, l int, vals, st map[string]engine.Tensor) {
	if g.onStep != nil {
		g.onStep(p, l, vals)
	}
	if g.onState != nil {
		cp := make(map[string]engine.Tensor, len(st))
		for k, v := range st {
			cp[k] = v
		}
		g.onState(p, l, cp)
	}
}
