package replay

import (
	"sparsemla/engine"

	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"

	"sparsemla/userfile"
)

// TolMode is how one stage's reference and GPU values are judged.
type TolMode string

const (
	// TolExact: every element equal (±0 equal, NaN equals NaN). Used where the
	// spec makes the value exact: FQ8/FQ4 grids, cache rows, index lists, states.
	TolExact TolMode = "exact"
	// TolULP: bf16 ulp distance at most MaxULP on every element (MaxULPNoTable
	// for RoPE stages when the dump carries no GPU cos/sin table).
	TolULP TolMode = "ulp"
	// TolClose: FlashMLA's check_is_allclose: every element has
	// |gpu-ref| < Abs or |gpu-ref|/(|ref|+1e-6) < Rel, and cos_diff <= Cos.
	TolClose TolMode = "close"
	// TolSet: a top-k selection compared as a set; a difference that lies
	// entirely inside an exact score tie at the k-th place is a tie, not a
	// divergence.
	TolSet TolMode = "set"
)

// StageTol is the tolerance of one stage. Zero fields mean "not allowed": an
// ulp stage with MaxULP 0 must be bit-exact in bf16.
type StageTol struct {
	Mode          TolMode `json:"mode"`
	MaxULP        int     `json:"max_ulp,omitempty"`
	MaxULPNoTable int     `json:"max_ulp_no_gpu_table,omitempty"` // RoPE stages without a dumped GPU table
	Abs           float64 `json:"abs,omitempty"`
	Rel           float64 `json:"rel,omitempty"`
	Cos           float64 `json:"cos,omitempty"`
	Why           string  `json:"why,omitempty"` // where the numbers come from
}

// allowedULP is MaxULP, or MaxULPNoTable when larger and the RoPE table is not
// the GPU's own.
func (t StageTol) allowedULP(gpuTable bool) int {
	if !gpuTable && t.MaxULPNoTable > t.MaxULP {
		return t.MaxULPNoTable
	}
	return t.MaxULP
}

// elementClose is FlashMLA's per-element test: abs error below Abs or relative
// error (against |ref| + 1e-6) below Rel. Stages not in close mode pass.
func (t StageTol) elementClose(ref, gpu float64) bool {
	if t.Mode != TolClose {
		return true
	}
	d := math.Abs(gpu - ref)
	return d < t.Abs || d/(math.Abs(ref)+1e-6) < t.Rel
}

// FlashMLA's published sparse-decode thresholds (deepseek-ai/FlashMLA
// tests/test_flash_mla_sparse_decoding.py, checked with kernelkit
// check_is_allclose, whose default cos_diff_tol is 1e-7):
//
//	out: abs 1e-3, rel 2.01/128,    cos_diff 5e-6
//	lse: abs 1e-6, rel 8.01/65536,  cos_diff 1e-7
const (
	flashMLAOutAbs = 1e-3
	flashMLAOutRel = 2.01 / 128
	flashMLAOutCos = 5e-6
	flashMLALSEAbs = 1e-6
	flashMLALSERel = 8.01 / 65536
	flashMLALSECos = 1e-7
)

// Tolerance is the whole policy: a default per canonical stage name, plus
// overrides. Stages it does not name are compared with Fallback.
type Tolerance struct {
	Stages   map[string]StageTol `json:"stages"`
	Fallback StageTol            `json:"fallback"`
	// Overrides describes each tolerance a user set over the defaults
	// (Override: --tol-stage, a --tol file), "stage=mode,key=value…" in
	// the order set ("*=…": the fallback). Reports carry it
	// (Report.TolOverrides) and say it beside their verdict.
	Overrides []string `json:"-"`
}

// Override sets the tolerance of one stage (name "*": Fallback), as Set,
// and records it among the Overrides a report names.
func (t *Tolerance) Override(stage string, st StageTol) {
	t.Set(stage, st)
	t.Overrides = append(t.Overrides, stage+"="+st.String())
}

// String is the tolerance as --tol-stage writes it: the mode, then its
// bounds ("close,abs=0.002,rel=0.02,cos=1e-05", "ulp,max_ulp=3", "exact").
func (t StageTol) String() string {
	parts := []string{string(t.Mode)}
	switch t.Mode {
	case TolULP:
		parts = append(parts, fmt.Sprintf("max_ulp=%d", t.MaxULP))
		if t.MaxULPNoTable != 0 {
			parts = append(parts, fmt.Sprintf("max_ulp_no_gpu_table=%d", t.MaxULPNoTable))
		}
	case TolClose:
		parts = append(parts, fmt.Sprintf("abs=%g", t.Abs), fmt.Sprintf("rel=%g", t.Rel), fmt.Sprintf("cos=%g", t.Cos))
	}
	return strings.Join(parts, ",")
}

// DefaultTolerance is the documented default policy (docs/replay-json.md,
// "Tolerance policy"). The numbers were measured on the GPU dumps of the
// official model.py (testdata/official-v4-tiny, testdata/gpu-v4-tiny-long):
// with them both replay with zero divergences.
func DefaultTolerance() *Tolerance {
	exact := func(why string) StageTol { return StageTol{Mode: TolExact, Why: why} }
	ulp := func(n int, why string) StageTol { return StageTol{Mode: TolULP, MaxULP: n, Why: why} }
	rope := func(why string) StageTol {
		return StageTol{Mode: TolULP, MaxULP: 0, MaxULPNoTable: 1, Why: why}
	}
	gemm32 := StageTol{Mode: TolClose, Abs: 1e-4, Rel: 2e-3, Cos: 1e-6,
		Why: "fp32 GEMM, summation order differs (spec §14: relative error up to ~1e-3)"}
	hcSplit := StageTol{Mode: TolClose, Abs: 1e-7, Rel: 2e-6, Cos: 1e-9,
		Why: "hc_split_sinkhorn fp32: CUDA expf, 20 Sinkhorn iterations (measured ≤ 2 fp32 ulps pre/post, ≤ 8 comb)"}
	t := &Tolerance{Stages: map[string]StageTol{
		// Q path.
		"q_a":          ulp(1, "FP8 linear, bf16 out; GEMM summation order (§9.1)"),
		"cq":           ulp(1, "RMSNorm, mean(x²) order (§9.2, §14)"),
		"q_b":          ulp(1, "FP8 linear, bf16 out (§9.1)"),
		"q_pe_prerope": ulp(0, "per-head RMS norm, every op rounds to bf16 (§3.7, §14: 100%)"),
		"q":            rope("RoPE at p (§3.6, §14: GPU table + fused form reproduce 100%)"),
		// Window K.
		"kv_raw":    ulp(1, "FP8 linear, bf16 out (§9.1)"),
		"kv_normed": ulp(1, "RMSNorm (§9.2, §14)"),
		"kv_roped":  rope("RoPE at p (§3.6)"),
		"kv":        exact("FQ8 of kv_roped, exact on the E4M3 grid (§3.3)"),
		"topk_idxs": exact("window order, -1 padding, 128+topk (§4, §14: exact)"),
		// Attention and output.
		"o": {Mode: TolClose, Abs: flashMLAOutAbs, Rel: flashMLAOutRel, Cos: flashMLAOutCos,
			Why: "FlashMLA sparse-decode 'out' thresholds"},
		"lse": {Mode: TolClose, Abs: flashMLALSEAbs, Rel: flashMLALSERel, Cos: flashMLALSECos,
			Why: "FlashMLA sparse-decode 'lse' thresholds"},
		"o_inv":    rope("inverse RoPE at p (§3.6)"),
		"u":        ulp(2, "wo_a bf16 GEMM, fp32 accumulate (§14: within 2 ulps)"),
		"y":        ulp(1, "FP8 linear wo_b (§9.1)"),
		"kv_cache": exact("cache rows are written, never recomputed (§14: exact)"),
		// Main compressor.
		"cmp_a":           gemm32,
		"cmp_b":           gemm32,
		"cmp_kv_state":    exact("state rows stored as computed (§5, §14)"),
		"cmp_score_state": exact("state rows stored as computed, + ape (§5, §14)"),
		"cmp_pooled":      ulp(1, "softmax pooling in fp32 then bf16 (§5, §14: 1 ulp)"),
		"cmp_normed":      ulp(1, "RMSNorm (§9.2)"),
		"cmp_roped":       rope("RoPE at j·r (§3.6)"),
		"cmp_row":         exact("FQ8 of cmp_roped (§3.3)"),
		// Indexer.
		"iq_b":             ulp(1, "FP8 linear (§9.1)"),
		"iq_roped":         rope("RoPE at p (§3.6)"),
		"iq_had":           ulp(1, "Hadamard butterfly vs matrix order in fp32 (§9.10)"),
		"iq":               exact("FQ4 of iq_had (§3.4)"),
		"iw_raw":           ulp(1, "bf16 linear weights_proj"),
		"iw":               ulp(0, "bf16(iw_raw·scale), one rounding (§6, §14: 100%)"),
		"index_qk":         ulp(1, "bf16 dot, fp32 accumulate (§6)"),
		"index_score":      ulp(1, "bf16 head sum of rounded products (§6, §14)"),
		"index_topk":       {Mode: TolSet, Why: "torch.topk order among ties is unspecified (§9.6, §14)"},
		"index_sel":        {Mode: TolSet, Why: "index_topk + 128, compared as a set"},
		"icache":           exact("indexer key rows are written, never recomputed"),
		"icmp_a":           gemm32,
		"icmp_b":           gemm32,
		"icmp_kv_state":    exact("state rows stored as computed"),
		"icmp_score_state": exact("state rows stored as computed, + ape"),
		"icmp_pooled":      ulp(1, "softmax pooling in fp32 then bf16"),
		"icmp_normed":      ulp(1, "RMSNorm"),
		"icmp_roped":       rope("RoPE at j·r"),
		"icmp_had":         ulp(1, "Hadamard order (§9.10)"),
		"icmp_row":         exact("FQ4 of icmp_had (§3.4)"),
		// Block (mHC) and MoE, measured on official-v4-tiny (every step and
		// layer) and gpu-v4-tiny-long (attention side): packages mhc, moe, head.
		"h_in":          exact("embedding row copied into the hc_mult streams (layer 0; measured 100 %)"),
		"hc_attn_mixes": gemm32,
		"hc_ffn_mixes":  gemm32,
		"hc_attn_pre":   hcSplit,
		"hc_attn_post":  hcSplit,
		"hc_attn_comb":  hcSplit,
		"hc_ffn_pre":    hcSplit,
		"hc_ffn_post":   hcSplit,
		"hc_ffn_comb":   hcSplit,
		"attn_norm_in":  ulp(0, "hc_pre collapse, fp32 sum over the copies in order (measured 100 %)"),
		"ffn_norm_in":   ulp(0, "hc_pre collapse, fp32 sum over the copies in order (measured 100 %)"),
		"x":             ulp(1, "RMSNorm attn_norm, mean(x²) order (§9.2; measured 100 %)"),
		"ffn_in":        ulp(1, "RMSNorm ffn_norm, mean(x²) order (§9.2; measured 100 %)"),
		"h_mid":         ulp(0, "hc_post, fp32 (measured 100 %)"),
		"h_out":         ulp(0, "hc_post, fp32 (measured 100 %)"),
		"moe_indices":   exact("router top-k of score + bias, or tid2eid[tok] on hash layers (measured 100 %)"),
		"moe_weights":   {Mode: TolClose, Abs: 1e-7, Rel: 1e-6, Cos: 1e-9, Why: "gate fp32 GEMV order, CUDA expf/log1pf (measured ≤ 2 fp32 ulps)"},
		"ffn_out":       ulp(1, "FP4 routed + FP8 shared experts, GEMM order (§9.1; measured 100 %)"),
		"logits":        {Mode: TolClose, Abs: 1e-5, Rel: 1e-4, Cos: 1e-9, Why: "head fp32 GEMV order after hc_head and norm (measured |Δ| ≤ 1e-6)"},
	}, Fallback: ulp(1, "any other bf16 stage: one rounding, one ulp")}
	for name, st := range v32Tol() { // V3.2 stage names (replay/v32.go)
		t.Stages[name] = st
	}
	return t
}

// PropagatedTolerance is the default policy of a propagated replay, where the
// reference runs its own chain from each layer's x and carries its own state:
// summation-order noise (≤ 2 bf16 ulps in one stage, ~1e-6 relative in the fp32
// compressor state) then reaches stages that are exact in a local replay, and
// an FQ8/FQ4 value can move by one grid step. Every float stage is judged by
// cos_diff ≤ 1e-4 (and NaN/inf patterns); index lists stay exact, top-k sets
// stay sets. Measured on the official-v4-tiny GPU dump: the largest propagated
// cos_diff is below 1e-13.
func PropagatedTolerance() *Tolerance {
	t := DefaultTolerance()
	for name, st := range t.Stages {
		if st.Mode == TolSet {
			continue
		}
		if name == "moe_indices" {
			continue // expert ids stay exact: the chain's own routing must pick the GPU's experts
		}
		if name == "topk_idxs" {
			t.Stages[name] = StageTol{Mode: TolSet, Why: "window part exact; compressed part (128 + index_topk) a set: the chain's own top-k orders ties by its own rule"}
			continue
		}
		t.Stages[name] = StageTol{Mode: TolClose, Abs: 1e30, Cos: 1e-4,
			Why: "propagated chain: cos_diff only (" + st.Why + ")"}
	}
	t.Fallback = StageTol{Mode: TolClose, Abs: 1e30, Cos: 1e-4, Why: "propagated chain: cos_diff only"}
	return t
}

// ChainedTolerance is the default policy of a chained replay (the whole
// model end to end): PropagatedTolerance with cos_diff ≤ 1e-2 on every float
// stage. Across layers the FP8 and FP4 activation quantisation of every
// linear turns last-bit drift into a visible change (a flipped E4M3 code
// moves its element by up to 1/16): on the official-v4-tiny GPU dump the
// largest chained cos_diff is 1.2e-3 (ffn_out of the last layer), against
// ~1e-7 within one layer. Index lists stay exact, top-k sets sets, and
// moe_indices exact.
func ChainedTolerance() *Tolerance {
	t := PropagatedTolerance()
	for name, st := range t.Stages {
		if st.Mode == TolClose && st.Abs == 1e30 {
			st.Cos = 1e-2
			st.Why = strings.Replace(st.Why, "propagated chain:", "chained across layers:", 1)
			t.Stages[name] = st
		}
	}
	t.Fallback.Cos = 1e-2
	return t
}

// For returns the tolerance of a stage: its override or default, else Fallback.
func (t *Tolerance) For(stage string) StageTol {
	if s, ok := t.Stages[stage]; ok {
		return s
	}
	return t.Fallback
}

// Clone returns a deep copy.
func (t *Tolerance) Clone() *Tolerance {
	c := &Tolerance{Stages: make(map[string]StageTol, len(t.Stages)), Fallback: t.Fallback, Overrides: slices.Clone(t.Overrides)}
	for k, v := range t.Stages {
		c.Stages[k] = v
	}
	return c
}

// Set replaces the tolerance of one stage (name "*" sets Fallback).
func (t *Tolerance) Set(stage string, st StageTol) {
	if stage == "*" {
		t.Fallback = st
		return
	}
	t.Stages[stage] = st
}

func (m TolMode) valid() bool {
	return m == TolExact || m == TolULP || m == TolClose || m == TolSet
}

// LoadToleranceFile reads a JSON override file and applies it over t:
//
//	{"stages": {"o": {"mode": "close", "abs": 2e-3, "rel": 0.02, "cos": 1e-5}},
//	 "fallback": {"mode": "ulp", "max_ulp": 2}}
//
// Each named stage's tolerance is replaced as a whole. Unknown fields are errors.
func (t *Tolerance) LoadToleranceFile(path string) error {
	b, err := userfile.ReadFile(path, MaxToleranceFile)
	if err != nil {
		return fmt.Errorf("tolerance file: %w", err)
	}
	var f struct {
		Stages   map[string]StageTol `json:"stages"`
		Fallback *StageTol           `json:"fallback"`
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return fmt.Errorf("tolerance file %s: %w", path, userfile.JSONError(err))
	}
	names := make([]string, 0, len(f.Stages))
	for n := range f.Stages {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		st := f.Stages[n]
		if !KnownStage(n) {
			return fmt.Errorf("tolerance file %s: unknown stage %s (%s)", path, userfile.Quote(n), knownStagesHint(n))
		}
		if !st.Mode.valid() {
			return fmt.Errorf("tolerance file %s: stage %q: unknown mode %s (exact, ulp, close, set)", path, n, userfile.Quote(string(st.Mode)))
		}
		if err := st.Validate(); err != nil {
			return fmt.Errorf("tolerance file %s: stage %q: %w", path, n, err)
		}
		t.Override(n, st)
	}
	if f.Fallback != nil {
		if !f.Fallback.Mode.valid() {
			return fmt.Errorf("tolerance file %s: fallback: unknown mode %s", path, userfile.Quote(string(f.Fallback.Mode)))
		}
		if err := f.Fallback.Validate(); err != nil {
			return fmt.Errorf("tolerance file %s: fallback: %w", path, err)
		}
		t.Override("*", *f.Fallback)
	}
	return nil
}

// unusedOverrides lists, in the order set and once each, the stages of the
// overrides ("stage=mode,…") that judged nothing: no result of that stage
// was compared (pass, fail or tie) — a stage the model has not (o of a V3.2
// dump), or one the dump does not hold at the steps replayed. Such an
// override changed no verdict, and a report that only listed it would have
// the user believe the stage was judged by it. The fallback ("*") is not
// listed; lse, the tolerance of the split-K partials' LSE, counts as used
// where o was compared.
func unusedOverrides(overrides []string, results []StageResult) []string {
	compared := map[string]bool{}
	for _, s := range results {
		switch s.Status {
		case StatusPass, StatusFail, StatusTie:
			compared[s.Stage] = true
		}
	}
	compared["lse"] = compared["o"]
	var out []string
	for _, o := range overrides {
		name, _, _ := strings.Cut(o, "=")
		if name == "*" || compared[name] || slices.Contains(out, name) {
			continue
		}
		out = append(out, name)
	}
	return out
}

// KnownStage reports whether name is a stage a tolerance can apply to: a
// stage of the reference's stage graph (any layer kind, emitting or not), a
// stage DefaultTolerance names (lse), or "*" (the fallback). Tolerance
// inputs naming anything else are refused: a typo would otherwise leave the
// stage on its default tolerance while the user believes it overridden.
func KnownStage(name string) bool {
	if name == "*" {
		return true
	}
	if _, ok := DefaultTolerance().Stages[name]; ok {
		return true
	}
	return graphStages()[name] || slices.Contains(V41StageNames(), name)
}

// graphStages is the set of stage names of the stage graph over every layer
// kind (the tiny preset has r = 0, 4 and 128) at emitting and non-emitting
// positions.
func graphStages() map[string]bool {
	set := map[string]bool{}
	cfg, err := engine.Preset("tiny")
	if err != nil {
		return set
	}
	for l := 0; l < cfg.NLayers; l++ {
		for _, p := range []int64{5, 127} {
			for _, d := range engine.Stages(cfg, l, p) {
				set[d.Name] = true
			}
		}
	}
	return set
}

// knownStagesHint names the closest known stage (by edit distance) for an
// error message, or lists where the names are documented.
func knownStagesHint(name string) string {
	var all, v32 []string
	v32Names := v32Tol()
	for n := range DefaultTolerance().Stages {
		if _, ok := v32Names[n]; ok {
			v32 = append(v32, n)
		} else {
			all = append(all, n)
		}
	}
	for n := range graphStages() {
		all = append(all, n)
	}
	sort.Strings(all)
	sort.Strings(v32)
	best, bd := "", 1<<30
	// V4 names first; a V3.2 stage name only when strictly closer. A name
	// whose length differs by more than 3 is more than 3 edits away, so the
	// O(len·len) distance runs only on names of about the same length (a
	// hostile 4 MiB name costs nothing).
	for _, n := range append(all, v32...) {
		if abs(len(name)-len(n)) > 3 {
			continue
		}
		if d := editDistance(name, n); d < bd {
			best, bd = n, d
		}
	}
	if best != "" && bd <= 3 {
		return fmt.Sprintf("did you mean %q? stage names: docs/replay-json.md", best)
	}
	return "stage names: docs/replay-json.md"
}

func abs(n int) int {
	if n < 0 {
		return -n
	}
	return n
}

// editDistance is the Levenshtein distance of a and b (bytes).
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			c := 1
			if a[i-1] == b[j-1] {
				c = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+c)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// ParseStageTol parses the --tol-stage flag form
//
//	STAGE=MODE[,max_ulp=N][,max_ulp_no_gpu_table=N][,abs=X][,rel=X][,cos=X]
//
// e.g. "o=close,abs=2e-3,rel=0.02,cos=1e-5" or "u=ulp,max_ulp=3".
func ParseStageTol(s string) (string, StageTol, error) {
	name, spec, ok := strings.Cut(s, "=")
	if !ok || name == "" {
		return "", StageTol{}, fmt.Errorf("tolerance %s: want STAGE=MODE[,key=value...]", userfile.Quote(s))
	}
	if !KnownStage(name) {
		return "", StageTol{}, fmt.Errorf("tolerance %s: unknown stage %s (%s)", userfile.Quote(s), userfile.Quote(name), knownStagesHint(name))
	}
	parts := strings.Split(spec, ",")
	st := StageTol{Mode: TolMode(parts[0]), Why: "command line"}
	if !st.Mode.valid() {
		return "", StageTol{}, fmt.Errorf("tolerance %s: unknown mode %s (exact, ulp, close, set)", userfile.Quote(s), userfile.Quote(parts[0]))
	}
	for _, kv := range parts[1:] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return "", StageTol{}, fmt.Errorf("tolerance %s: %s is not key=value", userfile.Quote(s), userfile.Quote(kv))
		}
		var err error
		switch k {
		case "max_ulp":
			st.MaxULP, err = strconv.Atoi(v)
		case "max_ulp_no_gpu_table":
			st.MaxULPNoTable, err = strconv.Atoi(v)
		case "abs":
			st.Abs, err = strconv.ParseFloat(v, 64)
		case "rel":
			st.Rel, err = strconv.ParseFloat(v, 64)
		case "cos":
			st.Cos, err = strconv.ParseFloat(v, 64)
		default:
			return "", StageTol{}, fmt.Errorf("tolerance %s: unknown key %s", userfile.Quote(s), userfile.Quote(k))
		}
		if err != nil {
			return "", StageTol{}, fmt.Errorf("tolerance %s: %s: %w", userfile.Quote(s), k, err)
		}
	}
	if err := st.Validate(); err != nil {
		return "", StageTol{}, fmt.Errorf("tolerance %s: %w", userfile.Quote(s), err)
	}
	return name, st, nil
}

// MaxToleranceFile bounds the size of a --tol file (a real one is a few KiB).
const MaxToleranceFile = 4 << 20

// Validate checks the numbers of a tolerance: ulp counts non-negative, abs,
// rel and cos finite and non-negative (a negative or NaN bound would make
// every comparison fail, or pass, silently).
func (t StageTol) Validate() error {
	if t.MaxULP < 0 {
		return fmt.Errorf("max_ulp = %d must be >= 0", t.MaxULP)
	}
	if t.MaxULPNoTable < 0 {
		return fmt.Errorf("max_ulp_no_gpu_table = %d must be >= 0", t.MaxULPNoTable)
	}
	for _, f := range []struct {
		name string
		v    float64
	}{{"abs", t.Abs}, {"rel", t.Rel}, {"cos", t.Cos}} {
		if math.IsNaN(f.v) || math.IsInf(f.v, 0) || f.v < 0 {
			return fmt.Errorf("%s = %v must be finite and >= 0", f.name, f.v)
		}
	}
	return nil
}

// Judge decides whether metrics m pass under st. gpuTable says whether the RoPE
// stages ran on the GPU's own cos/sin table. The reason is empty when it passes.
func (st StageTol) Judge(m Metrics, gpuTable bool) (bool, string) {
	// Non-finite patterns first: a NaN or inf the reference does not have (or
	// the other way round) is a divergence whatever the mode.
	if m.RefNaN != m.GPUNaN || m.RefInf != m.GPUInf || len(m.NonFiniteRows) > 0 {
		return false, fmt.Sprintf("NaN/inf pattern differs: GPU %d NaN %d inf, reference %d NaN %d inf (rows %v)",
			m.GPUNaN, m.GPUInf, m.RefNaN, m.RefInf, m.NonFiniteRows)
	}
	switch st.Mode {
	case TolExact:
		if m.Mismatch > 0 {
			return false, fmt.Sprintf("%d of %d values differ (exact stage), first at %v", m.Mismatch, m.N, m.First)
		}
	case TolULP:
		allow := st.allowedULP(gpuTable)
		if m.MaxULP > int64(allow) {
			return false, fmt.Sprintf("max %d bf16 ulps (allowed %d) at %v: GPU %g, reference %g", m.MaxULP, allow, m.MaxULPAt, float64(m.MaxULPGPU), float64(m.MaxULPRef))
		}
	case TolClose:
		if m.CloseFail > 0 {
			return false, fmt.Sprintf("%d of %d elements beyond abs %.3g / rel %.3g; max abs %.3g at %v",
				m.CloseFail, m.N, st.Abs, st.Rel, m.MaxAbs, m.MaxAbsAt)
		}
		if m.CosDiff > st.Cos {
			return false, fmt.Sprintf("cos_diff %.3g > %.3g", m.CosDiff, st.Cos)
		}
	case TolSet:
		// Sets are judged by the caller (see compareSelection); the element
		// metrics only inform.
	}
	return true, ""
}
