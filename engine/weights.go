package engine

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"

	"golang.org/x/sync/errgroup"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/indexer"
	"sparsemla/quant"
)

// LayerWeights are the attention-path parameters of one layer, named as in the
// official state_dict (layers.N.attn.<name>, spec §3.2). Shapes [out, in]:
//
//	WqA       FP8  [q_lora_rank, dim]                 wq_a (+ .scale)
//	QNorm     fp32 [q_lora_rank]                      q_norm.weight
//	WqB       FP8  [H·head_dim, q_lora_rank]          wq_b
//	Wkv       FP8  [head_dim, dim]                    wkv
//	KVNorm    fp32 [head_dim]                         kv_norm.weight
//	WoA       bf16 [G·R, H·head_dim/G]                wo_a.weight (bf16 after convert.py, or FP8 + .scale)
//	WoB       FP8  [dim, G·R]                         wo_b
//	AttnSink  fp32 [H]                                attn_sink
//	Compressor (r > 0): compressor.{wkv,wgate}.weight fp32 [coff·512, dim], .ape fp32 [r, coff·512], .norm.weight [512]
//	Indexer (r = 4):    indexer.wq_b FP8 [H_I·128, q_lora_rank], indexer.weights_proj.weight bf16 [H_I, dim],
//	                    indexer.compressor.* with d = 128
//
// FP8 weights keep their codes and UE8M0 block scales and carry the exact fp32
// dequantisation used by the reference (LoadLayerWeights), or, in the compact
// form of the prepared path (LoadLayerWeightsPrepared), the codes only, with
// WoA nil and Fast holding the packed weights.
type LayerWeights struct {
	Layer, Ratio       int
	WqA, WqB, Wkv, WoB *attention.FP8Weight
	QNorm, KVNorm      []float32
	WoA                []float32
	AttnSink           []float32
	Compressor         *attention.Compressor // nil for r = 0
	Indexer            *indexer.Indexer      // nil unless r = 4
	// Block holds the parameters around the attention sub-layer (mHC, the
	// norms, the MoE; LoadBlockWeights); nil when the weights file holds the
	// attention path only (BlockStages is then Stages).
	Block *BlockWeights
	// V32 holds a V3.2 (DSA) layer's attention (engine/v32weights.go); the
	// V4 fields above are then unset.
	V32 *V32Weights

	// Fast, when set (PrepareLayer, Model.PrepareFast), holds packed copies
	// of these weights and makes the stage computations run the fast kernels,
	// which give the same bits; nil (the default) runs the reference loops.
	Fast *PreparedLayer
}

// weightShape is one expected tensor of a layer: its name suffix and shape.
type weightShape struct {
	name  string
	shape []int
}

// fp8Shape returns the shape of the .scale of an FP8 weight [rows, cols].
func fp8Scale(rows, cols int) []int { return []int{(rows + 127) / 128, (cols + 127) / 128} }

// LoadLayerWeights reads layer l's attention-path weights from an open
// safetensors file with official names (the golden's weights.safetensors, or a
// converted checkpoint shard). Every tensor's dtype and shape is checked against
// the config before its bytes are read, and every value must be finite (a NaN
// or inf weight is refused, naming the tensor and the element).
func LoadLayerWeights(cfg *Config, layer int, st dump.WeightSource) (*LayerWeights, error) {
	if cfg.V32() {
		return loadV32LayerWeights(cfg, layer, st)
	}
	return loadLayerWeights(cfg, layer, st, false)
}

// LoadLayerWeightsPrepared is LoadLayerWeights (the same checks and errors)
// for the prepared path: it keeps the compact form only. w.Fast holds the
// packed weights (PrepareLayer); the FP8 weights are read without their fp32
// copy (attention.NewFP8WeightCodes) and then keep only their packed panels
// (FP8Weight.UsePanels: no Codes, no W; a reference loop that reads them
// dequantises row by row from the panels, the same values); the
// compressors' fp32 wkv and wgate are dropped the same way
// (PreparedLayer.CompactCompressors); WoA's fp32
// values are dropped once packed (WoA nil: only w.Fast.WoA holds them). The stage graph never
// reads WoA of a prepared layer; the reference loops cannot run on such a
// layer without its Fast (the wo_a stage panics), so keep it set.
func LoadLayerWeightsPrepared(cfg *Config, layer int, st dump.WeightSource) (*LayerWeights, error) {
	if cfg.V32() {
		return loadV32LayerWeightsPrepared(cfg, layer, st) // v32prepared.go
	}
	if cfg.BF16Checkpoint() {
		// the fast kernels pack FP8 weights: a bf16 checkpoint runs the
		// reference loops (Model.Kernels says "reference")
		return loadLayerWeights(cfg, layer, st, false)
	}
	lw, err := loadLayerWeights(cfg, layer, st, true)
	if err != nil {
		return nil, err
	}
	PrepareLayer(cfg, lw)
	lw.WoA = nil
	// the compressor projections live on in their bf16 panels only
	lw.Fast.CompactCompressors()
	// the FP8 codes live on in the panels only
	for w, p := range lw.Fast.src {
		w.UsePanels(p)
	}
	return lw, nil
}

// Compact reports whether w holds its compact form only
// (LoadLayerWeightsPrepared: no fp32 wo_a, the prepared weights carry it).
func (w *LayerWeights) Compact() bool { return w.V32 == nil && w.WoA == nil && w.Fast != nil }

// loadLayerWeights is LoadLayerWeights; compact leaves FP8 weights without
// their fp32 dequantisation.
func loadLayerWeights(cfg *Config, layer int, st dump.WeightSource, compact bool) (*LayerWeights, error) {
	if layer < 0 || layer >= cfg.NLayers {
		return nil, fmt.Errorf("engine: weights: layer %d outside the model (%d layers)", layer, cfg.NLayers)
	}
	r := cfg.Ratio(layer)
	wr := &attnWeightReader{cfg: cfg, st: st, pre: fmt.Sprintf("layers.%d.attn.", layer), compact: compact}
	H, D, dim := cfg.NHeads, cfg.HeadDim, cfg.Dim
	lw := &LayerWeights{Layer: layer, Ratio: r}
	var err error
	steps := []func() error{
		func() error { lw.WqA, err = wr.fp8("wq_a", cfg.QLoraRank, dim); return err },
		func() error { lw.QNorm, err = wr.f32("q_norm.weight", cfg.QLoraRank); return err },
		func() error { lw.WqB, err = wr.fp8("wq_b", H*D, cfg.QLoraRank); return err },
		func() error { lw.Wkv, err = wr.fp8("wkv", D, dim); return err },
		func() error { lw.KVNorm, err = wr.f32("kv_norm.weight", D); return err },
		func() error { lw.WoA, err = wr.woA(); return err },
		func() error { lw.WoB, err = wr.fp8("wo_b", dim, cfg.OGroups*cfg.OLoraRank); return err },
		func() error { lw.AttnSink, err = wr.f32("attn_sink", H); return err },
	}
	if r > 0 {
		steps = append(steps, func() error { lw.Compressor, err = wr.compressor("compressor.", r, D, false); return err })
	}
	if r == 4 {
		ix := &indexer.Indexer{NHeads: cfg.IndexNHeads, HeadDim: cfg.IndexHeadDim, TopK: cfg.IndexTopK}
		lw.Indexer = ix
		steps = append(steps,
			func() error {
				ix.WqB, err = wr.fp8("indexer.wq_b", cfg.IndexNHeads*cfg.IndexHeadDim, cfg.QLoraRank)
				return err
			},
			func() error {
				ix.WeightsProj, err = wr.f32("indexer.weights_proj.weight", cfg.IndexNHeads, dim)
				return err
			},
			func() error {
				ix.Compressor, err = wr.compressor("indexer.compressor.", r, cfg.IndexHeadDim, true)
				return err
			})
	}
	for _, s := range steps {
		if err := s(); err != nil {
			return nil, err
		}
	}
	return lw, nil
}

// attnWeightReader reads the tensors of one layer's attention (names under pre)
// from a weight source, checking each tensor's shape, dtype and finiteness.
type attnWeightReader struct {
	cfg     *Config
	st      dump.WeightSource
	pre     string // "layers.L.attn."
	compact bool   // FP8 weights keep their codes only (NewFP8WeightCodes)
}

// read reads tensor pre+name, which must have the shape and one of the kinds.
func (wr *attnWeightReader) read(name string, shape []int, kinds ...dump.DType) (dump.Record, error) {
	st, pre := wr.st, wr.pre
	e, ok := st.Lookup(pre + name)
	if !ok {
		return dump.Record{}, fmt.Errorf("engine: weights %s: no tensor %s%s", st.Name(), pre, name)
	}
	if !sameInts(e.Shape, shape) {
		return dump.Record{}, fmt.Errorf("engine: weights %s: %s%s has shape %v, the config needs %v", st.Name(), pre, name, e.Shape, shape)
	}
	okKind := false
	for _, k := range kinds {
		okKind = okKind || e.DType == k
	}
	if !okKind {
		return dump.Record{}, fmt.Errorf("engine: weights %s: %s%s has dtype %s, want one of %v", st.Name(), pre, name, e.DType, kinds)
	}
	return st.Read(pre + name)
}

// finite refuses a weight holding NaN or ±inf: weights are outside
// input, and a non-finite one would make the reference non-finite and
// the replay blame a GPU kernel for it.
func (wr *attnWeightReader) finite(name string, v []float32) error {
	if i := firstNonFinite(v); i >= 0 {
		return fmt.Errorf("engine: weights %s: %s%s[%d] is %g (a weight must be finite)", wr.st.Name(), wr.pre, name, i, v[i])
	}
	return nil
}

// f32 reads an fp32 or bf16 tensor as float32 values.
func (wr *attnWeightReader) f32(name string, shape ...int) ([]float32, error) {
	rec, err := wr.read(name, shape, dump.F32, dump.BF16)
	if err != nil {
		return nil, err
	}
	v, err := rec.Float32()
	if err != nil {
		return nil, err
	}
	return v, wr.finite(name, v)
}

// fp8 reads an FP8 linear (name.weight E4M3 codes, name.scale UE8M0 block
// scales), or the bf16 values of a bf16 checkpoint.
func (wr *attnWeightReader) fp8(name string, rows, cols int) (*attention.FP8Weight, error) {
	st, pre := wr.st, wr.pre
	if wr.cfg.BF16Checkpoint() {
		// a bf16 checkpoint: the weight's values only (W), no codes or
		// scales; the stages run attention.BF16Linear on them
		v, err := wr.f32(name+".weight", rows, cols)
		if err != nil {
			return nil, err
		}
		return &attention.FP8Weight{Rows: rows, Cols: cols, W: v}, nil
	}
	w, err := wr.read(name+".weight", []int{rows, cols}, dump.E4M3, dump.U8)
	if err != nil {
		return nil, err
	}
	s, err := wr.read(name+".scale", fp8Scale(rows, cols), dump.E8M0, dump.U8, dump.F32)
	if err != nil {
		return nil, err
	}
	if s.DType == dump.F32 {
		// an HF checkpoint's weight_scale_inv: fp32 block scales, which
		// must be powers of two (UE8M0) for the official FP8 GEMM
		if s, err = e8m0FromF32(s); err != nil {
			return nil, fmt.Errorf("engine: weights %s: %s%s.scale: %w", st.Name(), pre, name, err)
		}
	}
	for i, b := range s.Data {
		if b == quant.UE8M0NaN {
			return nil, fmt.Errorf("engine: weights %s: %s%s.scale[%d] is the UE8M0 NaN byte", st.Name(), pre, name, i)
		}
	}
	// E4M3 has NaN codes (S.1111.111) and no inf; with every scale
	// finite (checked above), no NaN code means finite values.
	if i := firstE4M3NaN(w.Data); i >= 0 {
		return nil, fmt.Errorf("engine: weights %s: %s%s.weight[%d] is the E4M3 NaN code 0x%02X (a weight must be finite)", st.Name(), pre, name, i, w.Data[i])
	}
	if wr.compact {
		return attention.NewFP8WeightCodes(w.Data, s.Data, rows, cols), nil
	}
	return attention.NewFP8Weight(w.Data, s.Data, rows, cols), nil
}

// woA reads wo_a: bf16 after convert.py; a checkpoint may still hold it as
// FP8 codes + .scale, which dequantise exactly to the same bf16 values.
func (wr *attnWeightReader) woA() ([]float32, error) {
	cfg := wr.cfg
	rows, cols := cfg.OGroups*cfg.OLoraRank, cfg.NHeads*cfg.HeadDim/cfg.OGroups
	if e, ok := wr.st.Lookup(wr.pre + "wo_a.weight"); ok && e.DType == dump.E4M3 {
		w, err := wr.fp8("wo_a", rows, cols)
		if err != nil {
			return nil, err
		}
		if w.W == nil { // compact: dequantised here, packed and dropped by the caller
			w.W = make([]float32, rows*cols)
			quant.DequantFP8Weight(w.W, w.Codes, w.Scale, rows, cols)
		}
		return w.W, nil
	}
	return wr.f32("wo_a.weight", rows, cols)
}

// compressor reads a compressor of ratio r and head dim d (wkv, wgate, ape,
// norm under prefix).
func (wr *attnWeightReader) compressor(prefix string, r, d int, rotate bool) (*attention.Compressor, error) {
	cfg := wr.cfg
	dim := cfg.Dim
	c := &attention.Compressor{Ratio: r, HeadDim: d, Dim: dim, Rotate: rotate, Eps: float32(cfg.NormEps)}
	w := Coff(r) * d
	var err error
	if c.Wkv, err = wr.f32(prefix+"wkv.weight", w, dim); err != nil {
		return nil, err
	}
	if c.Wgate, err = wr.f32(prefix+"wgate.weight", w, dim); err != nil {
		return nil, err
	}
	if c.Ape, err = wr.f32(prefix+"ape", r, w); err != nil {
		return nil, err
	}
	if c.Norm, err = wr.f32(prefix+"norm.weight", d); err != nil {
		return nil, err
	}
	return c, nil
}

// firstNonFinite returns the index of the first NaN or ±inf in v, or -1.
func firstNonFinite(v []float32) int {
	for i, x := range v {
		if math.Float32bits(x)&0x7F800000 == 0x7F800000 { // exponent all ones: NaN or ±inf
			return i
		}
	}
	return -1
}

// firstE4M3NaN returns the index of the first E4M3 NaN code (low 7 bits all
// ones) in codes, or -1. Eight codes at a time: (c & 0x7F) + 1 sets bit 7 of
// a byte exactly when its low 7 bits are all ones, with no carry into the
// next byte.
func firstE4M3NaN(codes []uint8) int {
	const low7, ones, high = 0x7F7F7F7F7F7F7F7F, 0x0101010101010101, 0x8080808080808080
	i := 0
	for ; i+8 <= len(codes); i += 8 {
		if (binary.LittleEndian.Uint64(codes[i:])&low7+ones)&high != 0 {
			break
		}
	}
	for ; i < len(codes); i++ {
		if codes[i]&0x7F == 0x7F {
			return i
		}
	}
	return -1
}

func sameInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// RandomLayerWeights makes synthetic attention weights for layer l, seeded and
// deterministic, distributed like the golden's generator: linear weights
// bf16(N(0,1)/sqrt(in)) (FP8 ones then block-quantised as the checkpoint is),
// norm weights bf16(1 + 0.1·N), ape bf16(0.5·N), attn_sink bf16(N). Only the
// layer asked for is generated. Every 128-row block of every matrix has its
// own random stream, so blocks are generated in parallel and the result is the
// same at any GOMAXPROCS.
func RandomLayerWeights(cfg *Config, layer int, seed uint64) *LayerWeights {
	if cfg.V32() {
		return randomV32LayerWeights(cfg, layer, seed)
	}
	r := cfg.Ratio(layer)
	H, D, dim := cfg.NHeads, cfg.HeadDim, cfg.Dim
	var id uint64 // matrix number: the stream of block b of matrix id is (seed, layer, id, b)
	stream := func(b int) *rand.Rand {
		return rand.New(rand.NewPCG(seed, uint64(layer)<<48|id<<32|uint64(b)))
	}
	// blocks runs f on every 128-row block of a rows-row matrix in parallel.
	blocks := func(rows int, f func(b, r0, r1 int)) {
		var g errgroup.Group
		g.SetLimit(runtime.GOMAXPROCS(0))
		for b := 0; b*128 < rows; b++ {
			g.Go(func() error { f(b, b*128, min(rows, b*128+128)); return nil })
		}
		g.Wait()
		id++
	}
	fill := func(dst []float32, rng *rand.Rand, s float64) {
		for i := range dst {
			dst[i] = quant.BF16Round(float32(rng.NormFloat64() * s))
		}
	}
	lin := func(rows, cols int) []float32 {
		w := make([]float32, rows*cols)
		blocks(rows, func(b, r0, r1 int) { fill(w[r0*cols:r1*cols], stream(b), 1/math.Sqrt(float64(cols))) })
		return w
	}
	fp8 := func(rows, cols int) *attention.FP8Weight {
		fw := &attention.FP8Weight{Rows: rows, Cols: cols, Codes: make([]uint8, rows*cols),
			Scale: make([]uint8, len(fp8ScaleFlat(rows, cols))), W: make([]float32, rows*cols)}
		bc := (cols + 127) / 128
		blocks(rows, func(b, r0, r1 int) {
			w := make([]float32, (r1-r0)*cols)
			fill(w, stream(b), 1/math.Sqrt(float64(cols)))
			q := attention.QuantizeFP8Weight(w, r1-r0, cols) // 128×128 blocks never straddle row blocks
			copy(fw.Codes[r0*cols:], q.Codes)
			copy(fw.W[r0*cols:], q.W)
			copy(fw.Scale[b*bc:], q.Scale)
		})
		return fw
	}
	rng := stream(1 << 30) // the stream of the small vectors
	vec := func(n int, mean, sd float64) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = quant.BF16Round(float32(mean + sd*rng.NormFloat64()))
		}
		return v
	}
	lw := &LayerWeights{Layer: layer, Ratio: r,
		WqA: fp8(cfg.QLoraRank, dim), QNorm: vec(cfg.QLoraRank, 1, 0.1),
		WqB: fp8(H*D, cfg.QLoraRank), Wkv: fp8(D, dim), KVNorm: vec(D, 1, 0.1),
	}
	// wo_a: FP8 block-quantised then dequantised to bf16, as convert.py does.
	lw.WoA = fp8(cfg.OGroups*cfg.OLoraRank, H*D/cfg.OGroups).W
	lw.WoB = fp8(dim, cfg.OGroups*cfg.OLoraRank)
	lw.AttnSink = vec(H, 0, 1)
	cmp := func(d int, rotate bool) *attention.Compressor {
		w := Coff(r) * d
		return &attention.Compressor{Ratio: r, HeadDim: d, Dim: dim, Rotate: rotate,
			Eps: float32(cfg.NormEps), Wkv: lin(w, dim), Wgate: lin(w, dim), Ape: vec(r*w, 0, 0.5), Norm: vec(d, 1, 0.1)}
	}
	if r > 0 {
		lw.Compressor = cmp(D, false)
	}
	if r == 4 {
		lw.Indexer = &indexer.Indexer{NHeads: cfg.IndexNHeads, HeadDim: cfg.IndexHeadDim, TopK: cfg.IndexTopK,
			WqB: fp8(cfg.IndexNHeads*cfg.IndexHeadDim, cfg.QLoraRank), WeightsProj: lin(cfg.IndexNHeads, dim),
			Compressor: cmp(cfg.IndexHeadDim, true)}
	}
	return lw
}

// fp8ScaleFlat is a zero slice with one entry per 128×128 block of [rows, cols].
func fp8ScaleFlat(rows, cols int) []uint8 {
	s := fp8Scale(rows, cols)
	return make([]uint8, s[0]*s[1])
}

// e8m0FromF32 turns fp32 block scales into UE8M0 bytes (2^(b-127)); every
// scale must be a positive power of two in [2^-127, 2^127].
func e8m0FromF32(r dump.Record) (dump.Record, error) {
	v, err := r.Float32()
	if err != nil {
		return r, err
	}
	out := make([]byte, len(v))
	for i, x := range v {
		fr, e := math.Frexp(float64(x))
		if !(x > 0) || math.IsInf(float64(x), 0) || fr != 0.5 || e-1 < -127 || e-1 > 127 {
			return r, fmt.Errorf("scale[%d] = %g is not a power of two in [2^-127, 2^127] (the FP8 checkpoint's UE8M0 block scales)", i, x)
		}
		out[i] = byte(e - 1 + 127)
	}
	return dump.Record{Key: r.Key, Kind: r.Kind, Name: r.Name, DType: dump.E8M0, Shape: r.Shape, Data: out}, nil
}
