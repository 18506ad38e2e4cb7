package engine

import (
	"bytes"
	"reflect"
	"testing"

	"sparsemla/dump"
	"sparsemla/head"
	"sparsemla/moe"
)

// TestBlockRecordsRoundTrip: the block and head parameters written by
// BlockWeightRecords / HeadWeightRecords load back (LoadBlockWeights,
// LoadHeadWeights) to the same values, on a hash layer (tid2eid) and a score
// layer (bias), every routed expert included, and run the same layer.
func TestBlockRecordsRoundTrip(t *testing.T) {
	cfg, err := Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	const seed = 3
	var recs []dump.Record
	blocks := map[int]*BlockWeights{}
	for _, l := range []int{0, 1} { // hash, score
		blocks[l] = RandomBlockWeights(cfg, l, seed)
		r, err := BlockWeightRecords(cfg, l, blocks[l])
		if err != nil {
			t.Fatal(err)
		}
		recs = append(recs, r...)
	}
	hw := &HeadWeights{Embed: RandomEmbedding(cfg, seed), Head: RandomHead(cfg, seed)}
	hr, err := HeadWeightRecords(cfg, hw)
	if err != nil {
		t.Fatal(err)
	}
	recs = append(recs, hr...)
	var buf bytes.Buffer
	if err := dump.WriteSafetensors(&buf, recs, nil); err != nil {
		t.Fatal(err)
	}
	st, err := dump.NewSafetensors(bytes.NewReader(buf.Bytes()), int64(buf.Len()), "roundtrip")
	if err != nil {
		t.Fatal(err)
	}
	for l, want := range blocks {
		got, err := LoadBlockWeights(cfg, l, st)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			name string
			a, b any
		}{
			{"hc_attn", *got.AttnSite, *want.AttnSite}, {"hc_ffn", *got.FFNSite, *want.FFNSite},
			{"attn_norm", got.AttnNorm, want.AttnNorm}, {"ffn_norm", got.FFNNorm, want.FFNNorm},
			{"gate.weight", got.MoE.Gate.Weight, want.MoE.Gate.Weight}, {"gate.bias", got.MoE.Gate.Bias, want.MoE.Gate.Bias},
			{"gate.tid2eid", got.MoE.Gate.TID2EID, want.MoE.Gate.TID2EID},
			{"swiglu_limit", got.MoE.SwigluLimit, want.MoE.SwigluLimit},
		} {
			if !reflect.DeepEqual(c.a, c.b) {
				t.Errorf("layer %d: %s differs after the round trip", l, c.name)
			}
		}
		for e := 0; e < cfg.NRoutedExperts; e++ {
			w, err := want.MoE.WithRouted([]int32{int32(e)}, func(x *moe.Expert) *moe.Expert { return x })
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(*got.MoE.Experts[e], *w.Experts[e]) {
				t.Errorf("layer %d: routed expert %d differs after the round trip", l, e)
			}
		}
		for i, p := range [][2][]uint8{
			{got.MoE.Shared.W1.CodesRowMajor(), want.MoE.Shared.W1.CodesRowMajor()},
			{got.MoE.Shared.W2.Scale, want.MoE.Shared.W2.Scale},
			{got.MoE.Shared.W3.CodesRowMajor(), want.MoE.Shared.W3.CodesRowMajor()},
		} {
			if !bytes.Equal(p[0], p[1]) {
				t.Errorf("layer %d: shared expert tensor %d differs after the round trip", l, i)
			}
		}
		x := make([]float32, cfg.Dim)
		for i := range x {
			x[i] = float32(i%7-3) / 4
		}
		a, err1 := got.MoE.Forward(x, 5)
		b, err2 := want.MoE.Forward(x, 5)
		if err1 != nil || err2 != nil || !reflect.DeepEqual(a, b) {
			t.Errorf("layer %d: the MoE of the loaded weights computes another result (%v %v)", l, err1, err2)
		}
	}
	got, err := LoadHeadWeights(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	h := make([]float32, cfg.HCMult*cfg.Dim)
	for i := range h {
		h[i] = float32(i%11-5) / 8
	}
	if a, b := got.Head.Forward(h).Logits, hw.Head.Forward(h).Logits; !reflect.DeepEqual(a, b) {
		t.Error("the loaded head computes other logits")
	}
	e1, e2 := make([]float32, cfg.Dim), make([]float32, cfg.Dim)
	for _, tok := range []int64{0, 17, int64(cfg.VocabSize - 1)} {
		if err := got.Embed.Row(e1, tok); err != nil {
			t.Fatal(err)
		}
		hw.Embed.Row(e2, tok)
		if !reflect.DeepEqual(e1, e2) {
			t.Errorf("embed.weight row %d differs after the round trip", tok)
		}
	}
	if _, err := HeadWeightRecords(cfg, &HeadWeights{Embed: hw.Embed, Head: &head.Head{}}); err == nil {
		t.Error("HeadWeightRecords accepted a head without its fp32 table")
	}
}
