package engine

import (
	"container/list"
	"fmt"
	"math"
	"slices"
	"sync"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/head"
	"sparsemla/mhc"
	"sparsemla/moe"
	"sparsemla/quant"
)

// BlockWeights are the parameters of one layer around its attention
// sub-layer (the official Block, R-M:690-751), named as in the state_dict
// (layers.N.<name>), shapes [out, in]:
//
//	hc_attn_fn, hc_ffn_fn        fp32 [(2+hc)·hc, hc·dim]    mixes of the two hc_pre sites
//	hc_attn_base, hc_ffn_base    fp32 [(2+hc)·hc]
//	hc_attn_scale, hc_ffn_scale  fp32 [3]
//	attn_norm.weight, ffn_norm.weight  fp32 [dim] (bf16 in the checkpoint)
//	ffn.gate.weight              bf16 [E, dim]
//	ffn.gate.bias                fp32 [E]            (layers ≥ n_hash_layers)
//	ffn.gate.tid2eid             i32/i64 [vocab, k]  (layers < n_hash_layers)
//	ffn.experts.E.w{1,3}         FP4 [inter, dim/2] + .scale [inter, dim/32]; w2 [dim, inter/2] + [dim, inter/32]
//	ffn.shared_experts.w{1,2,3}  FP8 + .scale (128×128)
type BlockWeights struct {
	AttnSite, FFNSite *mhc.Site
	AttnNorm, FFNNorm []float32
	MoE               *moe.MoE
}

// HeadWeights are the model's parameters outside the layers (Transformer,
// R-M:825-884): the embedding table and the head.
type HeadWeights struct {
	Embed head.Embedding // embed.weight [vocab, dim], bf16 values (a head.Table when loaded)
	Head  *head.Head     // hc_head_fn / _base / _scale, norm.weight, head.weight
}

// HasBlockWeights reports whether st holds layer l's block parameters
// (its hc_attn_fn): a checkpoint or dump weights file with the whole layer,
// not only the attention path.
func HasBlockWeights(st dump.WeightSource, layer int) bool {
	_, ok := st.Lookup(fmt.Sprintf("layers.%d.hc_attn_fn", layer))
	return ok
}

// HasHeadWeights reports whether st holds the embedding and the head.
func HasHeadWeights(st dump.WeightSource) bool {
	for _, n := range []string{"embed.weight", "head.weight", "hc_head_fn"} {
		if _, ok := st.Lookup(n); !ok {
			return false
		}
	}
	return true
}

// weightReader reads checked tensors of one weights file: the dtype and the
// shape are compared with what the config needs before the bytes are read,
// and float values must be finite.
type weightReader struct {
	st dump.WeightSource
}

func (r weightReader) read(name string, shape []int, kinds ...dump.DType) (dump.Record, error) {
	e, ok := r.st.Lookup(name)
	if !ok {
		return dump.Record{}, fmt.Errorf("engine: weights %s: no tensor %s", r.st.Name(), name)
	}
	if !sameInts(e.Shape, shape) {
		return dump.Record{}, fmt.Errorf("engine: weights %s: %s has shape %v, the config needs %v", r.st.Name(), name, e.Shape, shape)
	}
	for _, k := range kinds {
		if e.DType == k {
			return r.st.Read(name)
		}
	}
	return dump.Record{}, fmt.Errorf("engine: weights %s: %s has dtype %s, want one of %v", r.st.Name(), name, e.DType, kinds)
}

// f32 reads a float tensor (F32 or BF16) and refuses non-finite values.
func (r weightReader) f32(name string, shape ...int) ([]float32, error) {
	rec, err := r.read(name, shape, dump.F32, dump.BF16)
	if err != nil {
		return nil, err
	}
	v, err := rec.Float32()
	if err != nil {
		return nil, fmt.Errorf("engine: weights %s: %s: %w", r.st.Name(), name, err)
	}
	if i := firstNonFinite(v); i >= 0 {
		return nil, fmt.Errorf("engine: weights %s: %s[%d] is %g (a weight must be finite)", r.st.Name(), name, i, v[i])
	}
	return v, nil
}

// scaleBytes reads a UE8M0 scale tensor (or fp32 power-of-two scales) and
// refuses the NaN byte.
func (r weightReader) scaleBytes(name string, shape ...int) ([]uint8, error) {
	s, err := r.read(name, shape, dump.E8M0, dump.U8, dump.F32)
	if err != nil {
		return nil, err
	}
	if s.DType == dump.F32 {
		// an HF checkpoint's weight_scale_inv: fp32 scales, which must be
		// powers of two (UE8M0) for the official FP8 / FP4 GEMMs
		if s, err = e8m0FromF32(s); err != nil {
			return nil, fmt.Errorf("engine: weights %s: %s: %w", r.st.Name(), name, err)
		}
	}
	for i, b := range s.Data {
		if b == quant.UE8M0NaN {
			return nil, fmt.Errorf("engine: weights %s: %s[%d] is the UE8M0 NaN byte", r.st.Name(), name, i)
		}
	}
	return s.Data, nil
}

// fp8 reads an FP8 weight [rows, cols] with its 128×128 block scales, kept as
// codes (attention.NewFP8WeightCodes: FP8Linear dequantises a row at a time,
// the same values, a fifth of the memory of the fp32 copy).
func (r weightReader) fp8(name string, rows, cols int) (*attention.FP8Weight, error) {
	w, err := r.read(name+".weight", []int{rows, cols}, dump.E4M3, dump.U8)
	if err != nil {
		return nil, err
	}
	s, err := r.scaleBytes(name+".scale", fp8Scale(rows, cols)...)
	if err != nil {
		return nil, err
	}
	if i := firstE4M3NaN(w.Data); i >= 0 {
		return nil, fmt.Errorf("engine: weights %s: %s.weight[%d] is the E4M3 NaN code 0x%02X (a weight must be finite)", r.st.Name(), name, i, w.Data[i])
	}
	return attention.NewFP8WeightCodes(w.Data, s, rows, cols), nil
}

// fp4 reads an FP4 weight [rows, cols] (packed [rows, cols/2], scales
// [rows, cols/32]). E2M1 has no NaN or inf code.
func (r weightReader) fp4(name string, rows, cols int) (*moe.FP4Weight, error) {
	if cols%attention.ActBlock != 0 {
		return nil, fmt.Errorf("engine: weights %s: %s: %d columns, the FP4 GEMM needs a multiple of %d", r.st.Name(), name, cols, attention.ActBlock)
	}
	// Raw bytes [rows, cols/2] (U8 / I8, as the golden and the converted
	// checkpoint store float4_e2m1fn_x2), or FP4 elements [rows, cols].
	shape := []int{rows, cols / 2}
	if e, ok := r.st.Lookup(name + ".weight"); ok && e.DType == dump.FP4 {
		shape = []int{rows, cols}
	}
	w, err := r.read(name+".weight", shape, dump.U8, dump.I8, dump.FP4)
	if err != nil {
		return nil, err
	}
	s, err := r.scaleBytes(name+".scale", rows, cols/moe.FP4Block)
	if err != nil {
		return nil, err
	}
	return moe.NewFP4Weight(w.Data, s, rows, cols)
}

// LoadBlockWeights reads layer l's block parameters (BlockWeights) from an
// open safetensors file with official names, checking every dtype and shape
// against the config and every value for finiteness. The routed experts
// must be FP4 (expert_dtype "fp4"). It is LoadBlockWeightsWith with every
// expert read at once.
func LoadBlockWeights(cfg *Config, layer int, st dump.WeightSource) (*BlockWeights, error) {
	return LoadBlockWeightsWith(cfg, layer, st, BlockLoadOptions{})
}

// BlockLoadOptions configure LoadBlockWeightsWith.
type BlockLoadOptions struct {
	// LazyExperts leaves the routed experts in the weights file: each is read
	// (and checked) the first time a token is routed to it, through the MoE's
	// ExpertSource, which keeps it in Cache and reads st until the program
	// ends — st must stay open. At load only the presence, dtype and shape
	// of every expert tensor are checked. A V4-Flash layer's 256 experts
	// take 3.2 GiB; a decode step routes 6.
	LazyExperts bool
	// Cache holds the experts read, bounded in bytes; pass one cache to
	// every layer to bound the whole model (NewExpertCache with
	// Config.ExpertCacheBytes fits one step of every layer). Nil: the layer
	// gets a cache of its own of Config.ExpertCacheBytes / n_layers.
	Cache *ExpertCache
}

// ExpertCacheBytes is the default expert cache budget of a whole model:
// the k routed experts of every layer for one step, plus k more (their FP4
// codes and scales; 3.3 GiB for V4-Flash: 43·6 + 6 experts of 12.75 MiB).
func (c *Config) ExpertCacheBytes() int64 {
	return int64(c.NLayers+1) * int64(c.NActivatedExperts) * c.ExpertBytes() / int64(c.NRoutedExperts)
}

// ExpertBytes is the size of one layer's routed FP4 expert weights and
// scales in bytes (for choosing BlockLoadOptions.LazyExperts).
func (c *Config) ExpertBytes() int64 {
	per := int64(c.MoEInterDim) * int64(c.Dim) * 3
	return int64(c.NRoutedExperts) * (per/2 + per/int64(moe.FP4Block))
}

// LoadBlockWeightsWith is LoadBlockWeights with options.
func LoadBlockWeightsWith(cfg *Config, layer int, st dump.WeightSource, opt BlockLoadOptions) (*BlockWeights, error) {
	if layer < 0 || layer >= cfg.NLayers {
		return nil, fmt.Errorf("engine: weights: layer %d outside the model (%d layers)", layer, cfg.NLayers)
	}
	if err := cfg.ValidateBlock(); err != nil {
		return nil, err
	}
	r := weightReader{st}
	pre := fmt.Sprintf("layers.%d.", layer)
	hc, dim, E, inter := cfg.HCMult, cfg.Dim, cfg.NRoutedExperts, cfg.MoEInterDim
	nm := mhc.NMixes(hc)
	bw := &BlockWeights{}
	site := func(side string) (*mhc.Site, error) {
		s := &mhc.Site{Mult: hc, Dim: dim}
		var err error
		p := pre + "hc_" + side + "_"
		if s.Fn, err = r.f32(p+"fn", nm, hc*dim); err != nil {
			return nil, err
		}
		if s.Base, err = r.f32(p+"base", nm); err != nil {
			return nil, err
		}
		if s.Scale, err = r.f32(p+"scale", 3); err != nil {
			return nil, err
		}
		return s, nil
	}
	var err error
	if bw.AttnSite, err = site("attn"); err != nil {
		return nil, err
	}
	if bw.FFNSite, err = site("ffn"); err != nil {
		return nil, err
	}
	if bw.AttnNorm, err = r.f32(pre+"attn_norm.weight", dim); err != nil {
		return nil, err
	}
	if bw.FFNNorm, err = r.f32(pre+"ffn_norm.weight", dim); err != nil {
		return nil, err
	}
	sf, err := moe.ParseScoreFunc(cfg.ScoreFunc)
	if err != nil {
		return nil, err
	}
	m := &moe.MoE{SwigluLimit: float32(cfg.SwigluLimit), Gate: moe.Gate{
		Experts: E, TopK: cfg.NActivatedExperts, Dim: dim, Func: sf, RouteScale: float32(cfg.RouteScale)}}
	f := pre + "ffn."
	if m.Gate.Weight, err = r.f32(f+"gate.weight", E, dim); err != nil {
		return nil, err
	}
	if cfg.HashLayer(layer) {
		rec, err := r.read(f+"gate.tid2eid", []int{cfg.VocabSize, cfg.NActivatedExperts}, dump.I32, dump.I64)
		if err != nil {
			return nil, err
		}
		ids, err := rec.Int64()
		if err != nil {
			return nil, fmt.Errorf("engine: weights %s: %sgate.tid2eid: %w", st.Name(), f, err)
		}
		m.Gate.TID2EID = make([]int32, len(ids))
		for i, id := range ids {
			if id < 0 || id >= int64(E) {
				return nil, fmt.Errorf("engine: weights %s: %sgate.tid2eid[%d] = %d is not an expert id (0 … %d)", st.Name(), f, i, id, E-1)
			}
			m.Gate.TID2EID[i] = int32(id)
		}
	} else if m.Gate.Bias, err = r.f32(f+"gate.bias", E); err != nil {
		return nil, err
	}
	if opt.LazyExperts {
		for e := 0; e < E; e++ {
			p := fmt.Sprintf("%sexperts.%d.", f, e)
			for _, w := range []struct {
				name       string
				rows, cols int
			}{{"w1", inter, dim}, {"w2", dim, inter}, {"w3", inter, dim}} {
				if err := r.checkFP4(p+w.name, w.rows, w.cols); err != nil {
					return nil, err
				}
			}
		}
		c := opt.Cache
		if c == nil {
			c = NewExpertCache(cfg.ExpertCacheBytes() / int64(cfg.NLayers))
		}
		m.Experts = make([]*moe.Expert, E)
		m.Source = &checkpointExperts{r: r, prefix: f, layer: layer, dim: dim, inter: inter, cache: c}
	}
	for e := 0; e < E && !opt.LazyExperts; e++ {
		ex, err := readExpert(r, f, e, dim, inter)
		if err != nil {
			return nil, err
		}
		m.Experts = append(m.Experts, ex)
	}
	sh := &moe.Shared{}
	if sh.W1, err = r.fp8(f+"shared_experts.w1", inter, dim); err != nil {
		return nil, err
	}
	if sh.W2, err = r.fp8(f+"shared_experts.w2", dim, inter); err != nil {
		return nil, err
	}
	if sh.W3, err = r.fp8(f+"shared_experts.w3", inter, dim); err != nil {
		return nil, err
	}
	m.Shared = sh
	bw.MoE = m
	return bw, nil
}

// readExpert reads routed expert e of the MoE whose tensors are named
// prefix + "experts.E.w{1,2,3}".
func readExpert(r weightReader, prefix string, e, dim, inter int) (*moe.Expert, error) {
	ex := &moe.Expert{}
	p := fmt.Sprintf("%sexperts.%d.", prefix, e)
	var err error
	if ex.W1, err = r.fp4(p+"w1", inter, dim); err != nil {
		return nil, err
	}
	if ex.W2, err = r.fp4(p+"w2", dim, inter); err != nil {
		return nil, err
	}
	if ex.W3, err = r.fp4(p+"w3", inter, dim); err != nil {
		return nil, err
	}
	return ex, nil
}

// checkFP4 checks that an FP4 weight and its scales are in the file with
// the dtype and shape they need, reading nothing.
func (r weightReader) checkFP4(name string, rows, cols int) error {
	for _, c := range []struct {
		name  string
		shape []int
		kinds []dump.DType
	}{
		{name + ".weight", []int{rows, cols / 2}, []dump.DType{dump.U8, dump.I8}},
		{name + ".scale", []int{rows, cols / moe.FP4Block}, []dump.DType{dump.E8M0, dump.U8, dump.F32}},
	} {
		e, ok := r.st.Lookup(c.name)
		if !ok {
			return fmt.Errorf("engine: weights %s: no tensor %s", r.st.Name(), c.name)
		}
		shape := c.shape
		if e.DType == dump.FP4 {
			shape, c.kinds = []int{rows, cols}, []dump.DType{dump.FP4}
		}
		if !sameInts(e.Shape, shape) || !slices.Contains(c.kinds, e.DType) {
			return fmt.Errorf("engine: weights %s: %s is %s %v, the config needs %v %v", r.st.Name(), c.name, e.DType, e.Shape, c.kinds, shape)
		}
	}
	return nil
}

// checkpointExperts reads layer's routed experts from the weights file on
// demand (BlockLoadOptions.LazyExperts) and keeps them in cache.
type checkpointExperts struct {
	r          weightReader
	prefix     string
	layer      int
	dim, inter int
	cache      *ExpertCache
}

// Expert implements moe.ExpertSource.
func (c *checkpointExperts) Expert(e int) (*moe.Expert, error) {
	return c.cache.get(expertKey{c.layer, e}, func() (*moe.Expert, error) {
		return readExpert(c.r, c.prefix, e, c.dim, c.inter)
	})
}

// ExpertCache keeps routed experts read from a weights file
// (BlockLoadOptions.LazyExperts), for one layer or shared by many: at most
// Budget bytes of expert weights (FP4 codes and scales, expertBytes), the
// least recently used expert of any layer evicted first. An expert larger
// than the whole budget is used but not kept. The eviction order is a
// function of the sequence of requests only (a step asks layer after
// layer, each layer's experts in ascending id: moe.Combine), so a replay
// evicts the same experts at any GOMAXPROCS. Safe for concurrent use.
type ExpertCache struct {
	budget int64

	mu    sync.Mutex
	used  int64
	items map[expertKey]*list.Element // of *cachedExpert
	lru   *list.List                  // most recently used first
	reads int64
}

type expertKey struct{ layer, expert int }

type cachedExpert struct {
	key   expertKey
	ex    *moe.Expert
	bytes int64
}

// NewExpertCache returns an empty cache holding at most budget bytes.
func NewExpertCache(budget int64) *ExpertCache {
	return &ExpertCache{budget: budget, items: map[expertKey]*list.Element{}, lru: list.New()}
}

// Budget is the cache's bound in bytes.
func (c *ExpertCache) Budget() int64 { return c.budget }

// Bytes is the memory of the experts held now (≤ Budget).
func (c *ExpertCache) Bytes() int64 { c.mu.Lock(); defer c.mu.Unlock(); return c.used }

// Reads is the number of experts read from the file so far.
func (c *ExpertCache) Reads() int64 { c.mu.Lock(); defer c.mu.Unlock(); return c.reads }

// Held lists the experts held, most recently used first, as (layer,
// expert) pairs.
func (c *ExpertCache) Held() [][2]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out [][2]int
	for el := c.lru.Front(); el != nil; el = el.Next() {
		k := el.Value.(*cachedExpert).key
		out = append(out, [2]int{k.layer, k.expert})
	}
	return out
}

// Reset empties the cache.
func (c *ExpertCache) Reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.used, c.items, c.lru = 0, map[expertKey]*list.Element{}, list.New()
}

// get returns the expert k, read by read when not held (under the lock:
// requests are served in order).
func (c *ExpertCache) get(k expertKey, read func() (*moe.Expert, error)) (*moe.Expert, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.items[k]; ok {
		c.lru.MoveToFront(el)
		return el.Value.(*cachedExpert).ex, nil
	}
	ex, err := read()
	if err != nil {
		return nil, err
	}
	c.reads++
	n := expertBytes(ex)
	if n > c.budget {
		return ex, nil
	}
	for c.used+n > c.budget {
		el := c.lru.Back()
		old := el.Value.(*cachedExpert)
		c.lru.Remove(el)
		delete(c.items, old.key)
		c.used -= old.bytes
	}
	c.items[k] = c.lru.PushFront(&cachedExpert{key: k, ex: ex, bytes: n})
	c.used += n
	return ex, nil
}

// expertBytes is the memory of an expert's FP4 codes and scales.
func expertBytes(ex *moe.Expert) int64 {
	var n int64
	for _, w := range []*moe.FP4Weight{ex.W1, ex.W2, ex.W3} {
		n += int64(len(w.Packed) + len(w.Scale))
	}
	return n
}

// LoadHeadWeights reads the embedding and the head (HeadWeights) with the
// same checks as LoadBlockWeights.
func LoadHeadWeights(cfg *Config, st dump.WeightSource) (*HeadWeights, error) {
	return LoadHeadWeightsWith(cfg, st, HeadLoadOptions{})
}

// HeadLoadOptions configure LoadHeadWeightsWith.
type HeadLoadOptions struct {
	// LazyEmbed leaves embed.weight in the weights file: each step reads
	// its token's row (2·dim bytes of the bf16 tensor) when it needs it
	// (a CheckpointEmbedding), instead of holding the table (1 GiB for
	// V4-Flash). st must stay open and read rows by range
	// (dump.Safetensors, dump.Checkpoint); the tensor must be bf16.
	LazyEmbed bool
}

// LoadHeadWeightsWith is LoadHeadWeights with options.
func LoadHeadWeightsWith(cfg *Config, st dump.WeightSource, opt HeadLoadOptions) (*HeadWeights, error) {
	if err := cfg.ValidateBlock(); err != nil {
		return nil, err
	}
	r := weightReader{st}
	hc, dim, V := cfg.HCMult, cfg.Dim, cfg.VocabSize
	hw := &HeadWeights{Head: &head.Head{Mult: hc, Dim: dim, Vocab: V, NormEps: float32(cfg.NormEps), HCEps: float32(cfg.HCEps)}}
	var err error
	if opt.LazyEmbed {
		hw.Embed, err = r.lazyEmbedding(V, dim)
	} else {
		hw.Embed, err = r.embedding(V, dim)
	}
	if err != nil {
		return nil, err
	}
	h := hw.Head
	if h.HCFn, err = r.f32("hc_head_fn", hc, hc*dim); err != nil {
		return nil, err
	}
	if h.HCBase, err = r.f32("hc_head_base", hc); err != nil {
		return nil, err
	}
	s, err := r.f32("hc_head_scale", 1)
	if err != nil {
		return nil, err
	}
	h.HCScale = s[0]
	if h.Norm, err = r.f32("norm.weight", dim); err != nil {
		return nil, err
	}
	w, err := r.f32("head.weight", V, dim)
	if err != nil {
		return nil, err
	}
	// kept only as panels: bf16 storage for the checkpoint's bf16 values
	// (half of fp32; Logits on them is F32Linear's bits)
	h.Panels = attention.PackPanels(w, V, dim)
	return hw, nil
}

// embedding reads embed.weight [vocab, dim]: a bf16 checkpoint tensor stays
// bf16 (head.BF16Table, 2 bytes a value), an fp32 one is a head.Table.
// Values must be finite.
func (r weightReader) embedding(vocab, dim int) (head.Embedding, error) {
	const name = "embed.weight"
	if e, ok := r.st.Lookup(name); !ok || e.DType != dump.BF16 {
		w, err := r.f32(name, vocab, dim)
		if err != nil {
			return nil, err
		}
		return &head.Table{Dim: dim, W: w}, nil
	}
	rec, err := r.read(name, []int{vocab, dim}, dump.BF16)
	if err != nil {
		return nil, err
	}
	if len(rec.Data) != 2*vocab*dim {
		return nil, fmt.Errorf("engine: weights %s: %s has %d bytes, want %d", r.st.Name(), name, len(rec.Data), 2*vocab*dim)
	}
	w := make([]uint16, vocab*dim)
	for i := range w {
		b := uint16(rec.Data[2*i]) | uint16(rec.Data[2*i+1])<<8
		if b&0x7f80 == 0x7f80 {
			return nil, fmt.Errorf("engine: weights %s: %s[%d] is %g (a weight must be finite)", r.st.Name(), name, i, math.Float32frombits(uint32(b)<<16))
		}
		w[i] = b
	}
	return &head.BF16Table{Dim: dim, W: w}, nil
}

// RangeSource is a weights file that reads part of a tensor
// (dump.Safetensors, dump.Checkpoint).
type RangeSource interface {
	dump.WeightSource
	ReadRange(name string, off int64, dst []byte) error
}

// CheckpointEmbedding is embed.weight [Vocab][Dim] (bf16) left in the
// weights file (HeadLoadOptions.LazyEmbed): Row reads the token's row,
// 2·Dim bytes at byte 2·Dim·tok of the tensor, and widens it exactly — the
// values of a head.BF16Table of the same tensor. A non-finite value is an
// error naming the tensor, the row and the column.
type CheckpointEmbedding struct {
	Src        RangeSource
	Name       string
	Vocab, Dim int
}

// Row implements head.Embedding; concurrent Rows only read the file
// (lazyEmbedding opened its shard at load).
func (c *CheckpointEmbedding) Row(e []float32, tok int64) error {
	if len(e) != c.Dim {
		return fmt.Errorf("engine: embedding row of %d values, the table has dim %d", len(e), c.Dim)
	}
	if tok < 0 || tok >= int64(c.Vocab) {
		return fmt.Errorf("head: token id %d outside the vocabulary [0, %d)", tok, c.Vocab)
	}
	buf := make([]byte, 2*c.Dim)
	if err := c.Src.ReadRange(c.Name, 2*int64(c.Dim)*tok, buf); err != nil {
		return fmt.Errorf("engine: weights %s: %s row %d: %w", c.Src.Name(), c.Name, tok, err)
	}
	for i := range e {
		b := uint16(buf[2*i]) | uint16(buf[2*i+1])<<8
		if b&0x7f80 == 0x7f80 {
			return fmt.Errorf("engine: weights %s: %s[%d][%d] is %g (a weight must be finite)", c.Src.Name(), c.Name, tok, i, math.Float32frombits(uint32(b)<<16))
		}
		e[i] = math.Float32frombits(uint32(b) << 16)
	}
	return nil
}

// lazyEmbedding checks embed.weight's dtype and shape and returns a
// CheckpointEmbedding on it (reading no value).
func (r weightReader) lazyEmbedding(vocab, dim int) (head.Embedding, error) {
	const name = "embed.weight"
	src, ok := r.st.(RangeSource)
	if !ok {
		return nil, fmt.Errorf("engine: weights %s: cannot read %s row by row (the source reads whole tensors only)", r.st.Name(), name)
	}
	e, ok := r.st.Lookup(name)
	switch {
	case !ok:
		return nil, fmt.Errorf("engine: weights %s: no tensor %s", r.st.Name(), name)
	case e.DType != dump.BF16 || !sameInts(e.Shape, []int{vocab, dim}):
		return nil, fmt.Errorf("engine: weights %s: %s is %s %v, reading it row by row needs bf16 [%d %d]", r.st.Name(), name, e.DType, e.Shape, vocab, dim)
	}
	// open its shard now (a dump.Checkpoint opens shards on first use), so
	// that the steps only read
	if err := src.ReadRange(name, 0, nil); err != nil {
		return nil, fmt.Errorf("engine: weights %s: %s: %w", r.st.Name(), name, err)
	}
	return &CheckpointEmbedding{Src: src, Name: name, Vocab: vocab, Dim: dim}, nil
}

// HashLayer reports whether layer l routes by token id (layer < n_hash_layers,
// Gate.hash).
func (c *Config) HashLayer(layer int) bool { return layer < c.NHashLayers }

// ValidateBlock checks the config fields the block, the MoE and the head
// read (Validate checks the attention path's).
func (c *Config) ValidateBlock() error {
	switch {
	case c.HCMult <= 0:
		return fmt.Errorf("engine: invalid config: hc_mult = %d must be positive", c.HCMult)
	case c.HCSinkhornIters <= 0:
		return fmt.Errorf("engine: invalid config: hc_sinkhorn_iters = %d must be positive", c.HCSinkhornIters)
	case c.NRoutedExperts <= 0 || c.NActivatedExperts <= 0 || c.NActivatedExperts > c.NRoutedExperts:
		return fmt.Errorf("engine: invalid config: n_activated_experts = %d of n_routed_experts = %d", c.NActivatedExperts, c.NRoutedExperts)
	case c.NSharedExperts != 1:
		return fmt.Errorf("engine: invalid config: n_shared_experts = %d (the official MoE asserts 1)", c.NSharedExperts)
	case c.MoEInterDim <= 0 || c.MoEInterDim%attention.ActBlock != 0:
		return fmt.Errorf("engine: invalid config: moe_inter_dim = %d must be a positive multiple of 128", c.MoEInterDim)
	case c.ExpertDType != "fp4":
		return fmt.Errorf("engine: invalid config: expert_dtype = %q: the reference implements FP4 routed experts (\"fp4\")", c.ExpertDType)
	case c.VocabSize <= 0:
		return fmt.Errorf("engine: invalid config: vocab_size = %d must be positive", c.VocabSize)
	}
	return nil
}
