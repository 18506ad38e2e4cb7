package engine

import (
	"bytes"
	"fmt"
	"math"
	"runtime"
	"strings"
	"testing"
	"time"

	"sparsemla/attention"
	"sparsemla/dump"
)

// layerSafetensors serialises one layer's weight records (LayerWeightRecords),
// renamed to layer as when rename >= 0, and opens them as a safetensors file in
// memory.
func layerSafetensors(t testing.TB, recs []dump.Record, from, as int) *dump.Safetensors {
	t.Helper()
	if as != from {
		old, pre := fmt.Sprintf("layers.%d.attn.", from), fmt.Sprintf("layers.%d.attn.", as)
		renamed := make([]dump.Record, len(recs))
		for i, r := range recs {
			r.Name = pre + strings.TrimPrefix(r.Name, old)
			renamed[i] = r
		}
		recs = renamed
	}
	var buf bytes.Buffer
	if err := dump.WriteSafetensors(&buf, recs, nil); err != nil {
		t.Fatal(err)
	}
	st, err := dump.NewSafetensors(bytes.NewReader(buf.Bytes()), int64(buf.Len()), fmt.Sprintf("layer-%d.safetensors", as))
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// TestLoadPreparedSameBits: a layer loaded in the compact prepared form
// (LoadLayerWeightsPrepared) holds no fp32 copy of its FP8 weights nor wo_a
// and no unpacked codes (the panels give back the checkpoint's),
// and every stage of a step computed on it has the bits of the reference
// loops on the fully loaded weights (LoadLayerWeights), in every layer kind;
// FP8Linear on a compact weight (row-by-row dequantisation) is FP8Linear on
// the full one.
func TestLoadPreparedSameBits(t *testing.T) {
	cfg, _ := Preset("tiny")
	for l := 0; l < cfg.NLayers; l++ {
		src := RandomLayerWeights(cfg, l, 17)
		recs := LayerWeightRecords(cfg, src)
		full, err := LoadLayerWeights(cfg, l, layerSafetensors(t, recs, l, l))
		if err != nil {
			t.Fatal(err)
		}
		cw, err := LoadLayerWeightsPrepared(cfg, l, layerSafetensors(t, recs, l, l))
		if err != nil {
			t.Fatal(err)
		}
		if full.Fast != nil || full.Compact() || full.WqB.W == nil {
			t.Fatalf("layer %d: LoadLayerWeights should give the full reference form", l)
		}
		fp8s := []*attention.FP8Weight{cw.WqA, cw.WqB, cw.Wkv, cw.WoB}
		if cw.Indexer != nil {
			fp8s = append(fp8s, cw.Indexer.WqB)
		}
		fullFP8 := []*attention.FP8Weight{full.WqA, full.WqB, full.Wkv, full.WoB}
		if full.Indexer != nil {
			fullFP8 = append(fullFP8, full.Indexer.WqB)
		}
		for i, w := range fp8s {
			if w.W != nil || w.Codes != nil {
				t.Fatalf("layer %d: a compact FP8 weight [%d, %d] kept its fp32 copy or its unpacked codes", l, w.Rows, w.Cols)
			}
			if !bytes.Equal(w.CodesRowMajor(), fullFP8[i].Codes) || !bytes.Equal(w.Scale, fullFP8[i].Scale) {
				t.Fatalf("layer %d: the codes of compact FP8 weight [%d, %d] unpacked from its panels differ", l, w.Rows, w.Cols)
			}
		}
		if !cw.Compact() || cw.WoA != nil || cw.Fast == nil {
			t.Fatalf("layer %d: LoadLayerWeightsPrepared kept wo_a (%d values) or has no prepared weights", l, len(cw.WoA))
		}
		for i, c := range []*attention.Compressor{cw.Compressor, compactIndexerCompressor(cw)} {
			if c == nil {
				continue
			}
			if c.Wkv != nil || c.Wgate != nil {
				t.Fatalf("layer %d: compressor %d of a compact layer kept its fp32 wkv/wgate", l, i)
			}
			fc := full.Compressor
			if i == 1 {
				fc = full.Indexer.Compressor
			}
			wkv, wgate := c.Weights()
			if bitsEqual(wkv, fc.Wkv) != -1 || bitsEqual(wgate, fc.Wgate) != -1 {
				t.Fatalf("layer %d: compressor %d: the weights unpacked from its panels differ", l, i)
			}
			a0, b0 := make([]float32, fc.Width()), make([]float32, fc.Width())
			a1, b1 := make([]float32, fc.Width()), make([]float32, fc.Width())
			xi := SyntheticInput(cfg, 5, 4).F
			fc.Project(a0, b0, xi)
			c.Project(a1, b1, xi)
			if bitsEqual(a0, a1) != -1 || bitsEqual(b0, b1) != -1 {
				t.Fatalf("layer %d: compressor %d: the reference Project on the compact panels differs", l, i)
			}
		}
		fast := cw.Fast
		PrepareLayer(cfg, cw) // a compact layer keeps its packed weights
		if cw.Fast != fast {
			t.Fatalf("layer %d: PrepareLayer repacked a compact layer", l)
		}
		// FP8Linear, compact vs full
		x := SyntheticInput(cfg, 3, 4).F
		y1, y2 := make([]float32, full.Wkv.Rows), make([]float32, full.Wkv.Rows)
		attention.FP8Linear(y1, x, full.Wkv)
		attention.FP8Linear(y2, x, cw.Wkv)
		for i := range y1 {
			if math.Float32bits(y1[i]) != math.Float32bits(y2[i]) {
				t.Fatalf("layer %d: FP8Linear on the compact wkv: y[%d] = %g, full %g", l, i, y2[i], y1[i])
			}
		}
		// one step, every stage, from the same synthetic state (an emitting step)
		pos := int64(127)
		rope := LayerRope(cfg, l, int(pos)+1)
		stRef := SyntheticState(cfg, full, rope, pos, 6)
		stFast := SyntheticState(cfg, cw, rope, pos, 6)
		xs := SyntheticInput(cfg, pos, 6)
		outRef, nextRef, err := RunStep(&StepContext{Cfg: cfg, Layer: l, Pos: pos, W: full, Rope: rope}, xs, stRef)
		if err != nil {
			t.Fatal(err)
		}
		outFast, nextFast, err := RunStep(&StepContext{Cfg: cfg, Layer: l, Pos: pos, W: cw, Rope: rope}, xs, stFast)
		if err != nil {
			t.Fatal(err)
		}
		if len(outRef) != len(outFast) {
			t.Fatalf("layer %d: %d stages reference, %d compact", l, len(outRef), len(outFast))
		}
		for name, a := range outRef {
			if !sameTensorBits(a, outFast[name]) {
				t.Errorf("layer %d stage %s: the compact prepared layer differs from the reference", l, name)
			}
		}
		for name, a := range nextRef.StateTensors() {
			if !sameTensorBits(a, nextFast.StateTensors()[name]) {
				t.Errorf("layer %d state %s: the compact prepared layer differs from the reference", l, name)
			}
		}
	}
}

// sameTensorBits compares two tensors bit for bit (shape, floats, ints).
func sameTensorBits(a, b Tensor) bool {
	if a.Kind != b.Kind || fmt.Sprint(a.Shape) != fmt.Sprint(b.Shape) || len(a.F) != len(b.F) || len(a.I) != len(b.I) {
		return false
	}
	for i := range a.F {
		if math.Float32bits(a.F[i]) != math.Float32bits(b.F[i]) {
			return false
		}
	}
	for i := range a.I {
		if a.I[i] != b.I[i] {
			return false
		}
	}
	return true
}

// BenchmarkLoadPreparedFlash loads all 43 layers of V4-Flash-size weights
// through the replay's load path (LoadModelWith{Prepared}: one
// LoadLayerWeightsPrepared per layer, reading a safetensors file with the
// checkpoint's dtypes: FP8 codes + UE8M0 scales, wo_a and weights_proj bf16,
// compressors fp32) and reports the Go heap in use afterwards (after a GC,
// the generator's buffers dropped), the packed bytes, and the heap one layer
// takes in the full reference form (LoadLayerWeights) for comparison. The
// weights are random (three generated layers, one per kind, serialised under
// every layer's name), so each of the 43 layers is read into its own memory.
//
//	SPARSEMLA_BENCH_BIG=1 go test ./engine -run '^$' -bench LoadPreparedFlash -benchtime 1x -timeout 30m
func BenchmarkLoadPreparedFlash(b *testing.B) {
	if !benchBig() {
		b.Skip("set SPARSEMLA_BENCH_BIG=1 (≈ 9 GiB of heap)")
	}
	cfg, _ := Preset("flash")
	heapNow := func() float64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return float64(ms.HeapInuse)
	}
	for b.Loop() {
		start := heapNow()
		templates := map[int][]dump.Record{} // ratio → records of one layer of that kind
		from := map[int]int{}
		for l := 0; l < cfg.NLayers; l++ {
			r := cfg.Ratio(l)
			if _, ok := templates[r]; !ok {
				templates[r] = LayerWeightRecords(cfg, RandomLayerWeights(cfg, l, 3))
				from[r] = l
			}
		}
		// one CSA layer in the full reference form
		base := heapNow()
		full, err := LoadLayerWeights(cfg, 2, layerSafetensors(b, templates[4], from[4], 2))
		if err != nil {
			b.Fatal(err)
		}
		fullLayer := heapNow() - base
		runtime.KeepAlive(full)
		full = nil

		t0 := time.Now()
		layers := make([]*LayerWeights, cfg.NLayers)
		var packed int64
		for l := range layers {
			r := cfg.Ratio(l)
			lw, err := LoadLayerWeightsPrepared(cfg, l, layerSafetensors(b, templates[r], from[r], l))
			if err != nil {
				b.Fatal(err)
			}
			layers[l] = lw
			packed += lw.Fast.PackedBytes()
		}
		load := time.Since(t0)
		templates = nil
		heap := heapNow()
		b.ReportMetric(heap/(1<<30), "heapGiB")
		b.ReportMetric((heap-start)/(1<<30), "layersGiB")
		b.ReportMetric(float64(packed)/(1<<30), "packedGiB")
		b.ReportMetric(fullLayer/(1<<30), "fullCSALayerGiB")
		b.ReportMetric(load.Seconds(), "load-s")
		runtime.KeepAlive(layers)
	}
}

func compactIndexerCompressor(w *LayerWeights) *attention.Compressor {
	if w.Indexer == nil {
		return nil
	}
	return w.Indexer.Compressor
}
