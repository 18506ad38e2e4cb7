package engine

import (
	"encoding/binary"
	"fmt"
	"math"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/quant"
)

// TensorFromRecord widens a dump record to an engine Tensor: float dtypes to
// fp32 values (KindBF16 for bf16 records, KindF32 otherwise), integers to int64
// (KindI32 for 32-bit and narrower records, KindI64 otherwise).
func TensorFromRecord(r *dump.Record) (Tensor, error) {
	shape := append([]int{}, r.Shape...)
	if r.DType.IsFloat() {
		f, err := r.Float32()
		if err != nil {
			return Tensor{}, err
		}
		k := KindF32
		if r.DType == dump.BF16 {
			k = KindBF16
		}
		return Tensor{Kind: k, Shape: shape, F: f}, nil
	}
	v, err := r.Int64()
	if err != nil {
		return Tensor{}, err
	}
	k := KindI64
	if r.DType.Bits() <= 32 {
		k = KindI32
	}
	return Tensor{Kind: k, Shape: shape, I: v}, nil
}

// LayerWeightRecords are one layer's attention weights as checkpoint records
// named like the official state_dict (layers.L.attn.*), the inverse of
// LoadLayerWeights.
// It needs the full form (wo_a's values): it panics on a compact layer
// (LoadLayerWeightsPrepared).
func LayerWeightRecords(cfg *Config, lw *LayerWeights) []dump.Record {
	if lw.V32 != nil {
		return v32WeightRecords(cfg, lw)
	}
	if lw.WoA == nil {
		panic("engine: LayerWeightRecords needs the full weights (LoadLayerWeights), not the compact prepared form")
	}
	pre := fmt.Sprintf("layers.%d.attn.", lw.Layer)
	var out []dump.Record
	fp8 := func(name string, w *attention.FP8Weight) {
		out = append(out,
			dump.Record{Name: pre + name + ".weight", DType: dump.E4M3, Shape: []int{w.Rows, w.Cols}, Data: append([]byte(nil), w.CodesRowMajor()...)},
			dump.Record{Name: pre + name + ".scale", DType: dump.U8,
				Shape: []int{(w.Rows + 127) / 128, (w.Cols + 127) / 128}, Data: append([]byte(nil), w.Scale...)})
	}
	f32 := func(name string, v []float32, shape ...int) {
		out = append(out, dump.Record{Name: pre + name, DType: dump.F32, Shape: shape, Data: f32Bytes(v)})
	}
	bf16 := func(name string, v []float32, shape ...int) {
		out = append(out, dump.Record{Name: pre + name, DType: dump.BF16, Shape: shape, Data: bf16Bytes(v)})
	}
	H, D, dim := cfg.NHeads, cfg.HeadDim, cfg.Dim
	fp8("wq_a", lw.WqA)
	f32("q_norm.weight", lw.QNorm, cfg.QLoraRank)
	fp8("wq_b", lw.WqB)
	fp8("wkv", lw.Wkv)
	f32("kv_norm.weight", lw.KVNorm, D)
	bf16("wo_a.weight", lw.WoA, cfg.OGroups*cfg.OLoraRank, H*D/cfg.OGroups)
	fp8("wo_b", lw.WoB)
	f32("attn_sink", lw.AttnSink, H)
	cmp := func(prefix string, c *attention.Compressor) {
		w := c.Width()
		wkv, wgate := c.Weights()
		f32(prefix+"wkv.weight", wkv, w, dim)
		f32(prefix+"wgate.weight", wgate, w, dim)
		f32(prefix+"ape", c.Ape, c.Ratio, w)
		f32(prefix+"norm.weight", c.Norm, c.HeadDim)
	}
	if lw.Compressor != nil {
		cmp("compressor.", lw.Compressor)
	}
	if ix := lw.Indexer; ix != nil {
		fp8("indexer.wq_b", ix.WqB)
		bf16("indexer.weights_proj.weight", ix.WeightsProj, ix.NHeads, dim)
		cmp("indexer.compressor.", ix.Compressor)
	}
	return out
}

func f32Bytes(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func bf16Bytes(v []float32) []byte {
	b := make([]byte, 2*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint16(b[2*i:], quant.BF16Bits(x))
	}
	return b
}

func i32Bytes(v []int64) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(int32(x)))
	}
	return b
}

func i64Bytes(v []int64) []byte {
	b := make([]byte, 8*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint64(b[8*i:], uint64(x))
	}
	return b
}

// TensorRecord converts a Tensor to a dump record with key k and kind.
func TensorRecord(t Tensor, k dump.Key, kind dump.Kind) dump.Record {
	r := dump.Record{Key: k, Kind: kind, Shape: append([]int{}, t.Shape...)}
	switch t.Kind {
	case KindBF16:
		r.DType, r.Data = dump.BF16, bf16Bytes(t.F)
	case KindF32:
		r.DType, r.Data = dump.F32, f32Bytes(t.F)
	case KindI32:
		r.DType, r.Data = dump.I32, i32Bytes(t.I)
	default:
		r.DType, r.Data = dump.I64, i64Bytes(t.I)
	}
	return r
}

// RecordLike encodes t as a record with rec's key, kind and name, in rec's
// dtype when it is one a stage value widens from exactly (bf16, f32, i32,
// i64), else in t's own kind.
func RecordLike(rec dump.Record, t Tensor) dump.Record {
	out := TensorRecord(t, rec.Key, rec.Kind)
	out.Name, out.Page = rec.Name, rec.Page
	switch {
	case rec.DType == dump.BF16 && t.Kind.IsFloat():
		out.DType, out.Data = dump.BF16, bf16Bytes(t.F)
	case rec.DType == dump.F32 && t.Kind.IsFloat():
		out.DType, out.Data = dump.F32, f32Bytes(t.F)
	case rec.DType == dump.I32 && !t.Kind.IsFloat():
		out.DType, out.Data = dump.I32, i32Bytes(t.I)
	case rec.DType == dump.I64 && !t.Kind.IsFloat():
		out.DType, out.Data = dump.I64, i64Bytes(t.I)
	}
	return out
}
