package engine

import (
	"math"
	"math/rand/v2"

	"sparsemla/attention"
	"sparsemla/indexer"
	"sparsemla/moe"
	"sparsemla/quant"
)

// This file is the DeepSeek-V4.1 ("CSA2") attention sub-layer (spec §11;
// V41-M = the official inference/model.py, revision dba1be0a, read through a
// vendored copy; docs/v41.md says what was confirmed there). It has its own
// weights, state and stage graph beside V4's: cross-layer sharing means a
// layer's step reads what earlier layers of the SAME step published, which
// V4's per-layer Stages cannot express.
//
// One decode step of layer l at position p, input x bf16 [dim]:
//
//	q_a = FP8Lin32(wq_a, x); cq = RMSNorm(q_a)·q_norm; q_b = FP8Lin32(wq_b, cq) [H][D]
//	q   = q_b with RoPE(last 64 of each head, p)                 no per-head RMS (V4 has one)
//	kv  = FQ8(RoPE(RMSNorm(FP8Lin32(wkv, x))·kv_norm, p), 32)     over ALL D dims (V4: nope dims, 64)
//	window[p mod win] = kv
//	KV source (owns compressor.*):                               r = 1: every step; r = 2: at odd p
//	  latent = RMSNorm(BF16Lin(wkv, x))·norm                      r = 1 (bf16 wkv, no gate, no state)
//	  latent = RMSNorm(bf16(Σ_s softmax_s(score)·kv))·norm        r = 2 (fp32 wkv/wgate, state [2][D], no ape)
//	  index key j = FQ4(RoPE(RMSNorm(BF16Lin(indexer.wk, latent))·k_norm, j·r), 32)   from the PRE-RoPE latent
//	  ckv[j] = FQ4E4M3(RoPE(latent, j·r), 16)                    FP4 with E4M3 scales over all D dims
//	  publishes ckv (compress_kv) and icache (index_k)
//	index source (owns indexer.*), when Tc = (p+1) div r > 0:
//	  iq = FQ4(RoPE(FP8Lin32(indexer.wq_b, cq), p), 32) per head  no Hadamard
//	  iw = bf16(bf16(weights_proj·x)·f32(128^-0.5·H_I^-0.5))
//	  score[j] = bf16(Σ_h bf16(ReLU(bf16(iq_h·icache[j]))·iw_h))
//	  candidate source: cand_mask = top candidate_topk_blocks blocks of
//	    candidate_block_size rows (block max; the newest row's block forced in); publishes it
//	  later index sources: score = −∞ outside the published cand_mask
//	  index_sel = top min(index_topk, Tc) rows, sorted ascending, + win; publishes it
//	topk_idxs = V41WindowIdx(p) (−1 first) ++ index_sel (own, or the last published)
//	kv_cache  = window ++ ckv of the layer's KV source
//	o = SparseAttn(q, kv_cache[topk_idxs], attn_sink, τ); o_inv = RoPE⁻¹(o, p)
//	u = bf16(wo_a[g]·o_inv[group g]); y = FP8Lin32(wo_b, u)
//
// FP8Lin32 is attention.V41FP8Linear (32×32 weight blocks, activations per
// 32); every RMSNorm uses rms_norm_eps (1e-20 in V4.1-Flash).

// V41LayerWeights are the attention-path weights of one V4.1 layer, named as
// the official state_dict (layers.N.attn.*).
type V41LayerWeights struct {
	Layer, Ratio       int
	WqA, WqB, Wkv, WoB *attention.V41FP8Weight
	QNorm, KVNorm      []float32                // fp32
	WoA                []float32                // [o_groups·o_lora_rank][H·D/o_groups], bf16 values (convert.py dequantises it)
	AttnSink           []float32                // [H] fp32
	Compressor         *attention.V41Compressor // KV sources only
	Indexer            *indexer.V41Indexer      // index sources only
	// Block and MoE are the rest of the layer (hc_attn_*, hc_ffn_*,
	// attn_norm, ffn_norm; ffn.*): nil for a model of the attention
	// sub-layer only (V41Model.Whole).
	Block *V41BlockWeights
	MoE   *moe.V41MoE
}

// RandomV41LayerWeights makes seeded synthetic weights of layer l (N(0, 1/cols)
// matrices on the FP8 grid with 32×32 UE8M0 blocks, norms ~ N(1, 0.1), sinks
// ~ N(0, 1)), for tests, explain and synthetic dumps. One random stream per
// matrix, so the weights do not depend on GOMAXPROCS.
func RandomV41LayerWeights(cfg *Config, l int, seed uint64) *V41LayerWeights {
	r := cfg.Ratio(l)
	H, D, dim := cfg.NHeads, cfg.HeadDim, cfg.Dim
	var id uint64
	stream := func() *rand.Rand {
		id++
		return rand.New(rand.NewPCG(seed^0x41, uint64(l)<<32|id))
	}
	mat := func(rows, cols int) []float32 {
		rng, s := stream(), 1/math.Sqrt(float64(cols))
		w := make([]float32, rows*cols)
		for i := range w {
			w[i] = quant.BF16Round(float32(rng.NormFloat64() * s))
		}
		return w
	}
	fp8 := func(rows, cols int) *attention.V41FP8Weight {
		return attention.QuantizeV41FP8Weight(mat(rows, cols), rows, cols)
	}
	vec := func(n int, mean, sd float64) []float32 {
		rng := stream()
		v := make([]float32, n)
		for i := range v {
			v[i] = quant.BF16Round(float32(mean + sd*rng.NormFloat64()))
		}
		return v
	}
	eps := float32(cfg.NormEps)
	w := &V41LayerWeights{Layer: l, Ratio: r,
		WqA: fp8(cfg.QLoraRank, dim), QNorm: vec(cfg.QLoraRank, 1, 0.1),
		WqB: fp8(H*D, cfg.QLoraRank), Wkv: fp8(D, dim), KVNorm: vec(D, 1, 0.1),
		WoA: fp8(cfg.OGroups*cfg.OLoraRank, H*D/cfg.OGroups).W, WoB: fp8(dim, cfg.OGroups*cfg.OLoraRank),
		AttnSink: vec(H, 0, 1)}
	if cfg.IsKVSource(l) {
		c := &attention.V41Compressor{Ratio: r, HeadDim: D, Dim: dim, Wkv: mat(D, dim), Norm: vec(D, 1, 0.1), Eps: eps}
		if r == 2 {
			c.Wgate = mat(D, dim)
		}
		w.Compressor = c
	}
	if cfg.IsIndexSource(l) {
		ix := &indexer.V41Indexer{NHeads: cfg.IndexNHeads, HeadDim: cfg.IndexHeadDim, TopK: cfg.IndexTopK,
			WqB: fp8(cfg.IndexNHeads*cfg.IndexHeadDim, cfg.QLoraRank), WeightsProj: mat(cfg.IndexNHeads, dim), Eps: eps}
		if cfg.IsKVSource(l) {
			ix.OwnsK, ix.Wk, ix.KNorm = true, mat(cfg.IndexHeadDim, D), vec(cfg.IndexHeadDim, 1, 0.1)
		}
		w.Indexer = ix
	}
	return w
}

// V41LayerState is what one V4.1 layer carries between decode steps:
//
//	Window  bf16 [win][D]   ring: slot t mod win holds token t's K (= V)
//	CKV     bf16 [Tc][D]    compressed rows (compress_kv_cache), KV sources only
//	Cmp     fp32 [2][D] ×2  open group of an r = 2 compressor (kv, score = −∞ at start)
//	ICache  bf16 [Tc][128]  index keys (indexer.k_cache), KV sources that run an indexer
//
// Consumers keep only their window: their compressed rows, index keys and
// top-k list are the sources'.
type V41LayerState struct {
	Layer, Ratio, Window, HeadDim, IndexHeadDim int
	Win                                         []float32
	CKV, ICache                                 []float32
	Cmp                                         *attention.V41CompressorState
}

// NewV41LayerState is the state of a fresh sequence: zero window, no rows.
func NewV41LayerState(cfg *Config, l int) *V41LayerState {
	st := &V41LayerState{Layer: l, Ratio: cfg.Ratio(l), Window: cfg.WindowSize, HeadDim: cfg.HeadDim,
		IndexHeadDim: cfg.IndexHeadDim, Win: make([]float32, cfg.WindowSize*cfg.HeadDim)}
	if cfg.IsKVSource(l) && st.Ratio == 2 {
		st.Cmp = (&attention.V41Compressor{Ratio: 2, HeadDim: cfg.HeadDim}).NewState()
	}
	return st
}

// Clone is a deep copy.
func (s *V41LayerState) Clone() *V41LayerState {
	c := *s
	c.Win = append([]float32(nil), s.Win...)
	c.CKV = append([]float32(nil), s.CKV...)
	c.ICache = append([]float32(nil), s.ICache...)
	c.Cmp = s.Cmp.Clone()
	return &c
}

// StateTensors names the state as stage tensors: window [win, D]; for KV
// sources ckv [Tc, D] and (r = 2) cmp_kv_state / cmp_score_state F32 [2, D];
// icache [Tc, 128] when the layer keeps index keys.
func (s *V41LayerState) StateTensors(cfg *Config) map[string]Tensor {
	D := s.HeadDim
	m := map[string]Tensor{"window": FromF(KindBF16, append([]float32(nil), s.Win...), s.Window, D)}
	if cfg.IsKVSource(s.Layer) {
		m["ckv"] = FromF(KindBF16, append([]float32(nil), s.CKV...), len(s.CKV)/D, D)
		if s.Cmp != nil {
			m["cmp_kv_state"] = FromF(KindF32, append([]float32(nil), s.Cmp.KV...), 2, D)
			m["cmp_score_state"] = FromF(KindF32, append([]float32(nil), s.Cmp.Score...), 2, D)
		}
		if cfg.IsIndexSource(s.Layer) {
			m["icache"] = FromF(KindBF16, append([]float32(nil), s.ICache...), len(s.ICache)/s.IndexHeadDim, s.IndexHeadDim)
		}
	}
	return m
}

// V41Model is what a V4.1 decode step needs besides its inputs: the config,
// every layer's weights and RoPE table.
type V41Model struct {
	Cfg     *Config
	Layers  []*V41LayerWeights
	Rope    []*RopeTable
	Options V41Options
	// Head holds embed, norm and head: with every layer's Block and MoE it
	// makes the model whole (V41Model.Whole), and V41Step then runs the
	// whole decode step from the token (V41WholeStages).
	Head *V41HeadWeights
}

// V41Options selects behaviour where the official code and the architecture
// disagree.
type V41Options struct {
	// OwnerIndexKeys makes every index source read the index keys of its
	// own KV source — the contract SharedAttentionRuntime's docstring states
	// ("every source writes before its consumers read") and what several
	// ports implement. The default (false) is the released model.py, which
	// the reference follows (confirmed on the GPU, testdata/v41-tiny):
	// Indexer.forward republishes `shared_attn.index_k` only when its layer's
	// compressor emitted a latent, so on a decode step where an r = 2 KV
	// source's group is still open its own indexer (and the index sources it
	// serves) score against the cache published last — in V4.1-Flash layer
	// 20's r = 1 keys of the previous step, sliced to (p+1) div 2 rows.
	OwnerIndexKeys bool
}

// NewRandomV41Model builds a V4.1 model with seeded synthetic weights of every
// layer and RoPE tables of T positions.
func NewRandomV41Model(cfg *Config, seed uint64, T int) *V41Model {
	m := &V41Model{Cfg: cfg}
	for l := 0; l < cfg.NLayers; l++ {
		m.Layers = append(m.Layers, RandomV41LayerWeights(cfg, l, seed))
		m.Rope = append(m.Rope, LayerRope(cfg, l, T))
	}
	return m
}

// V41State is the state of every layer plus the index-key slot model.py
// carries between forwards (unused with OwnerIndexKeys): the layer
// whose index keys were published last, −1 at the start.
type V41State struct {
	Layers   []*V41LayerState
	IndexKAt int
	Next     int64 // position of the next token to decode
}

// NewV41State is the state of a fresh sequence.
func NewV41State(cfg *Config) *V41State {
	s := &V41State{IndexKAt: -1}
	for l := 0; l < cfg.NLayers; l++ {
		s.Layers = append(s.Layers, NewV41LayerState(cfg, l))
	}
	return s
}

// Clone is a deep copy.
func (s *V41State) Clone() *V41State {
	c := &V41State{IndexKAt: s.IndexKAt, Next: s.Next}
	for _, l := range s.Layers {
		c.Layers = append(c.Layers, l.Clone())
	}
	return c
}

// V41StageDef is one stage of a V4.1 layer's step: Inputs are stages of the
// same layer and step, "x", "prev:<state>" (the layer's state before the step)
// or "shared:<name>" (what an earlier layer of the same step published:
// shared:ckv and shared:icache from the KV source, shared:index_sel from the
// index source, shared:cand_mask from the candidate source).
type V41StageDef struct {
	Name     string
	Inputs   []string
	Equation string
	Compute  func(ctx *V41Context, in map[string]Tensor) (Tensor, error)
	// Global marks a stage of no layer (the head's): dumped as <name>, not
	// L<l>.<name>.
	Global bool
}

// SharedPrefix marks an input published by an earlier layer of the step.
const SharedPrefix = "shared:"

// V41Context is what a V4.1 stage reads besides its inputs.
type V41Context struct {
	Cfg   *Config
	Layer int
	Pos   int64
	W     *V41LayerWeights
	Rope  *RopeTable
	Head  *V41HeadWeights // the whole step's embed / norm / head; nil for the attention sub-layer only
}

// V41Publishes lists the shared names layer l publishes at a step (in the
// order model.py writes shared_attn): ckv and icache from a KV source,
// cand_mask from the candidate source, index_sel from an index source.
func V41Publishes(cfg *Config, l int) []string {
	var p []string
	if cfg.IsKVSource(l) {
		p = append(p, "ckv")
		if cfg.IsIndexSource(l) {
			p = append(p, "icache")
		}
	}
	if l == cfg.CandidateSource() {
		p = append(p, "cand_mask")
	}
	if cfg.IsIndexSource(l) {
		p = append(p, "index_sel")
	}
	return p
}

// V41Stages lists the stages of layer l at step pos in model.py's order:
// query, window K, (KV source) compressor → index key → compressed row,
// (index source) indexer, the index list, the attention cache, attention and
// the output projections.
func V41Stages(cfg *Config, l int, pos int64) []V41StageDef {
	r := cfg.Ratio(l)
	var defs []V41StageDef
	add := func(name, eq string, f func(*V41Context, map[string]Tensor) (Tensor, error), in ...string) {
		defs = append(defs, V41StageDef{Name: name, Inputs: in, Equation: eq, Compute: f})
	}
	add("q_a", "q_a = FP8Lin32(wq_a, x)", v41QA, "x")
	add("cq", "cq = RMSNorm(q_a) ⊙ q_norm  (eps rms_norm_eps)", v41CQ, "q_a")
	add("q_b", "q_b = FP8Lin32(wq_b, cq) viewed [H][head_dim]", v41QB, "cq")
	add("q", "q = q_b with RoPE(last 64 dims of each head, p)  (no per-head RMS in V4.1)", v41Q, "q_b")
	add("kv_raw", "kv_raw = FP8Lin32(wkv, x)", v41KVRaw, "x")
	add("kv_normed", "kv_normed = RMSNorm(kv_raw) ⊙ kv_norm", v41KVNormed, "kv_raw")
	add("kv_roped", "kv_roped = kv_normed with RoPE(last 64 dims, p)", v41KVRoped, "kv_normed")
	add("kv", "kv = FQ8(kv_roped, 32) over all head_dim dims  (window K = V)", v41KV, "kv_roped")
	add("window", "window = prev:window with slot p mod win ← kv", v41Window, PrevPrefix+"window", "kv")
	kvSrc, idxSrc := cfg.IsKVSource(l), cfg.IsIndexSource(l)
	emit := r > 0 && (pos+1)%int64(r) == 0
	if kvSrc {
		if r == 1 {
			add("cmp_raw", "cmp_raw = BF16Lin(compressor.wkv, x)  (r = 1: bf16 weight, no gate)", v41CmpRaw, "x")
			add("cmp_latent", "cmp_latent = RMSNorm(cmp_raw) ⊙ compressor.norm  (pre-RoPE latent)", v41CmpLatent1, "cmp_raw")
		} else {
			add("cmp_a", "cmp_a = compressor.wkv · f32(x)  (fp32)", v41CmpA, "x")
			add("cmp_b", "cmp_b = compressor.wgate · f32(x)  (fp32, no ape)", v41CmpB, "x")
			add("cmp_kv_state", "cmp_kv_state = prev with slot p mod 2 ← cmp_a", v41CmpState(true), PrevPrefix+"cmp_kv_state", "cmp_a")
			add("cmp_score_state", "cmp_score_state = prev with slot p mod 2 ← cmp_b", v41CmpState(false), PrevPrefix+"cmp_score_state", "cmp_b")
			if emit {
				add("cmp_pooled", "cmp_pooled = bf16(Σ_s softmax_s(cmp_score_state) ⊙ cmp_kv_state)  (per channel, 2 slots)", v41CmpPooled, "cmp_kv_state", "cmp_score_state")
				add("cmp_latent", "cmp_latent = RMSNorm(cmp_pooled) ⊙ compressor.norm  (pre-RoPE latent)", v41CmpLatent2, "cmp_pooled")
			}
		}
		// model.py: the indexer turns the pre-RoPE latent into its key and
		// writes k_cache first; then Attention rotates and quantises the latent.
		if idxSrc {
			icIn := []string{PrevPrefix + "icache"}
			if emit {
				add("ik_raw", "ik_raw = BF16Lin(indexer.wk, cmp_latent)", v41IKRaw, "cmp_latent")
				add("ik_normed", "ik_normed = RMSNorm(ik_raw) ⊙ indexer.k_norm", v41IKNormed, "ik_raw")
				add("ik_row", "ik_row = FQ4(ik_normed with RoPE(last 64, j·r), 32)  (index key j = p div r; no Hadamard)", v41IKRow, "ik_normed")
				icIn = append(icIn, "ik_row")
			}
			add("icache", "icache = prev:icache ++ ik_row (if emitted)  (published: index_k)", v41ICache, icIn...)
		}
		ckvIn := []string{PrevPrefix + "ckv"}
		if emit {
			add("cmp_roped", "cmp_roped = cmp_latent with RoPE(last 64 dims, j·r)", v41CmpRoped, "cmp_latent")
			add("cmp_row", "cmp_row = FQ4E4M3(cmp_roped, 16)  (FP4 E2M1, E4M3 scale per 16, all dims)", v41CmpRow, "cmp_roped")
			ckvIn = append(ckvIn, "cmp_row")
		}
		add("ckv", "ckv = prev:ckv ++ cmp_row (if emitted)  (published: compress_kv)", v41CKV, ckvIn...)
	}
	tc := attention.VisibleRows(pos, r)
	ckvName := SharedPrefix + "ckv"
	if kvSrc {
		ckvName = "ckv"
	}
	if idxSrc && tc > 0 {
		icName := SharedPrefix + "icache"
		add("iq_b", "iq_b = FP8Lin32(indexer.wq_b, cq) viewed [H_I][128]", v41IqB, "cq")
		add("iq_roped", "iq_roped = iq_b with RoPE(last 64 dims of each head, p)", v41IqRoped, "iq_b")
		add("iq", "iq = FQ4(iq_roped, 32) per head  (no Hadamard)", v41Iq, "iq_roped")
		add("iw_raw", "iw_raw = bf16(weights_proj · x)", v41IwRaw, "x")
		add("iw", "iw = bf16(iw_raw · f32(128^-0.5 · H_I^-0.5))", v41Iw, "iw_raw")
		add("index_qk", "index_qk[h][j] = bf16(iq[h] · icache[j])  (the KV source's index keys)", v41IndexQK, "iq", icName)
		add("index_score", "index_score[j] = bf16(Σ_h bf16(ReLU(index_qk[h][j]) · iw[h]))", v41IndexScore, "index_qk", "iw")
		scoreName := "index_score"
		if l == cfg.CandidateSource() {
			add("cand_mask", "cand_mask = rows of the top candidate_topk_blocks blocks of candidate_block_size (block max, newest block forced)  (published)", v41CandMask, "index_score")
		} else if cfg.UsesCandidates(l) {
			add("index_score_masked", "index_score_masked = index_score with −∞ outside shared:cand_mask", v41ScoreMasked, "index_score", SharedPrefix+"cand_mask")
			scoreName = "index_score_masked"
		}
		add("index_sel", "index_sel = win + top-min(index_topk, Tc) rows of "+scoreName+", sorted ascending  (published)", v41IndexSel, scoreName)
	}
	switch {
	case r == 0:
		add("topk_idxs", "topk_idxs = V41WindowIdx(p)  (−1 padding first)", v41TopkIdxs)
	case idxSrc && tc > 0:
		add("topk_idxs", "topk_idxs = V41WindowIdx(p) ++ index_sel", v41TopkIdxs, "index_sel")
	case idxSrc:
		add("topk_idxs", "topk_idxs = V41WindowIdx(p)  (no compressed row yet; publishes an empty index_sel)", v41TopkIdxs)
	default:
		add("topk_idxs", "topk_idxs = V41WindowIdx(p) ++ shared:index_sel  (the last index source's list)", v41TopkIdxs, SharedPrefix+"index_sel")
	}
	kvIn := []string{"window"}
	if r > 0 {
		kvIn = append(kvIn, ckvName)
	}
	add("kv_cache", "kv_cache = window ++ ckv of the KV source  (what sparse_attn reads)", v41KVCache, kvIn...)
	add("o", "o = SparseAttn(q, kv_cache[topk_idxs], attn_sink, τ = head_dim^-0.5)", v41O, "q", "kv_cache", "topk_idxs")
	add("o_inv", "o_inv = o with RoPE⁻¹(last 64 dims, p)", v41OInv, "o")
	add("u", "u[g] = bf16(wo_a[g] · o_inv[heads of group g])", v41U, "o_inv")
	add("y", "y = FP8Lin32(wo_b, u)", v41Y, "u")
	return defs
}
