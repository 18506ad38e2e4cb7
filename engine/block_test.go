package engine

import (
	"bytes"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/moe"
)

// TestLoadBlockWeightsGolden loads the block and head weights of every layer
// of the official-v4-tiny golden and checks what the config makes of them:
// layer 0 hashes (tid2eid, no bias), the others carry a bias; 4 FP4 experts
// and an FP8 shared expert per layer.
func TestLoadBlockWeightsGolden(t *testing.T) {
	st, err := dump.OpenSafetensors(filepath.Join(goldenTiny, "weights.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	cfg, _ := Preset("tiny")
	for l := 0; l < cfg.NLayers; l++ {
		if !HasBlockWeights(st, l) {
			t.Fatalf("layer %d: no block weights in the golden", l)
		}
		b, err := LoadBlockWeights(cfg, l, st)
		if err != nil {
			t.Fatalf("layer %d: %v", l, err)
		}
		g := b.MoE.Gate
		if g.Hash() != (l == 0) || (g.Bias == nil) != (l == 0) {
			t.Errorf("layer %d: hash %v, bias %v", l, g.Hash(), g.Bias != nil)
		}
		if len(b.MoE.Experts) != 4 || b.MoE.Experts[3].W2.Rows != cfg.Dim || b.MoE.Shared.W2.Cols != cfg.MoEInterDim {
			t.Errorf("layer %d: experts %d", l, len(b.MoE.Experts))
		}
	}
	if !HasHeadWeights(st) {
		t.Fatal("no head weights in the golden")
	}
	if _, err := LoadHeadWeights(cfg, st); err != nil {
		t.Fatal(err)
	}
}

// TestLoadBlockWeightsErrors: a missing, misshapen or non-finite block
// tensor, an expert id outside the experts, and a config the block cannot
// use are errors that name the problem.
func TestLoadBlockWeightsErrors(t *testing.T) {
	src, err := dump.OpenSafetensors(filepath.Join(goldenTiny, "weights.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	build := func(edit func(r *dump.Record) bool) *dump.Safetensors {
		var recs []dump.Record
		for _, n := range src.Names() {
			if !strings.HasPrefix(n, "layers.0.") && !strings.HasPrefix(n, "layers.1.") {
				continue
			}
			r, err := src.Read(n)
			if err != nil {
				t.Fatal(err)
			}
			if edit(&r) {
				recs = append(recs, r)
			}
		}
		var buf bytes.Buffer
		if err := dump.WriteSafetensors(&buf, recs, nil); err != nil {
			t.Fatal(err)
		}
		s, err := dump.NewSafetensors(bytes.NewReader(buf.Bytes()), int64(buf.Len()), "edited")
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	cfg, _ := Preset("tiny")
	for _, c := range []struct {
		name  string
		layer int
		edit  func(r *dump.Record) bool
		want  string
	}{
		{"missing expert", 1, func(r *dump.Record) bool { return r.Name != "layers.1.ffn.experts.2.w3.weight" }, "no tensor layers.1.ffn.experts.2.w3.weight"},
		{"missing bias", 1, func(r *dump.Record) bool { return r.Name != "layers.1.ffn.gate.bias" }, "no tensor layers.1.ffn.gate.bias"},
		{"wrong shape", 1, func(r *dump.Record) bool {
			if r.Name == "layers.1.hc_ffn_base" {
				r.Shape = []int{12, 2}
			}
			return true
		}, "hc_ffn_base has shape [12 2]"},
		{"NaN fn", 1, func(r *dump.Record) bool {
			if r.Name == "layers.1.hc_attn_fn" {
				copy(r.Data[8:], []byte{0, 0, 0xc0, 0x7f})
			}
			return true
		}, "hc_attn_fn[2] is NaN"},
		{"NaN expert scale", 1, func(r *dump.Record) bool {
			if r.Name == "layers.1.ffn.experts.0.w1.scale" {
				r.Data[5] = 0xff
			}
			return true
		}, "experts.0.w1.scale[5] is the UE8M0 NaN byte"},
		{"bad tid2eid", 0, func(r *dump.Record) bool {
			if r.Name == "layers.0.ffn.gate.tid2eid" {
				r.Data[4*7] = 9
			}
			return true
		}, "tid2eid[7] = 9 is not an expert id"},
	} {
		_, err := LoadBlockWeights(cfg, c.layer, build(c.edit))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error with %q", c.name, err, c.want)
		}
	}
	bad := *cfg
	bad.ExpertDType = ""
	if _, err := LoadBlockWeights(&bad, 1, src); err == nil || !strings.Contains(err.Error(), "expert_dtype") {
		t.Errorf("bf16 experts: %v", err)
	}
	bad = *cfg
	bad.ScoreFunc = "relu"
	if _, err := LoadBlockWeights(&bad, 1, src); err == nil || !strings.Contains(err.Error(), "score_func") {
		t.Errorf("score_func relu: %v", err)
	}
}

// TestBlockStagesOrder: the whole layer in replay order — hc_pre, the
// attention sub-layer unchanged, hc_post, hc_pre, the MoE, hc_post — with h_in
// on layer 0 only when the embedding is there and logits on the last layer
// only when the head is; without block weights the attention stages alone.
func TestBlockStagesOrder(t *testing.T) {
	cfg, _ := Preset("tiny")
	names := func(defs []StageDef) []string {
		var n []string
		for _, d := range defs {
			n = append(n, d.Name)
		}
		return n
	}
	attn := names(Stages(cfg, 1, 7))
	w := &LayerWeights{Block: &BlockWeights{}}
	hw := &HeadWeights{Embed: RandomEmbedding(cfg, 1)}
	got := names(BlockStages(cfg, 1, 7, w, hw))
	pre := []string{"hc_attn_mixes", "hc_attn_pre", "hc_attn_post", "hc_attn_comb", "attn_norm_in", "x"}
	post := []string{"h_mid", "hc_ffn_mixes", "hc_ffn_pre", "hc_ffn_post", "hc_ffn_comb", "ffn_norm_in", "ffn_in",
		"moe_indices", "moe_weights", "ffn_out", "h_out"}
	want := append(append(append([]string{}, pre...), attn...), post...)
	if !slices.Equal(got, want) {
		t.Errorf("layer 1:\n got %v\nwant %v", got, want)
	}
	if got := names(BlockStages(cfg, 0, 7, w, hw)); got[0] != "h_in" {
		t.Errorf("layer 0 with the embedding starts with %s", got[0])
	}
	if got := names(BlockStages(cfg, 0, 7, w, nil)); got[0] != "hc_attn_mixes" {
		t.Errorf("layer 0 without the embedding starts with %s", got[0])
	}
	last := BlockStages(cfg, 3, 7, w, &HeadWeights{Head: RandomHead(cfg, 1)})
	if d := last[len(last)-1]; d.Name != "logits" || !d.Global {
		t.Errorf("last layer ends with %s (global %v)", d.Name, d.Global)
	}
	if got := names(BlockStages(cfg, 1, 7, &LayerWeights{}, hw)); !slices.Equal(got, attn) {
		t.Errorf("without block weights: %v", got)
	}
	for _, d := range BlockStages(cfg, 0, 7, w, hw) {
		if d.Name == "moe_indices" && !slices.Contains(d.Inputs, GlobalPrefix+"tok") {
			t.Errorf("hash layer 0: moe_indices reads %v, want the token", d.Inputs)
		}
	}
}

// TestRunLayerSynthetic runs a whole synthetic layer twice from the same
// seeds (the same bits), checks that its attention part is RunStep's from the
// computed x, and that its output streams are finite and differ from the
// input (the sub-layers wrote into them).
func TestRunLayerSynthetic(t *testing.T) {
	cfg, _ := Preset("tiny")
	const l, p, seed = 1, 9, 5
	rope := LayerRope(cfg, l, p+1)
	W := RandomLayerWeights(cfg, l, seed)
	W.Block = RandomBlockWeights(cfg, l, seed)
	st := SyntheticState(cfg, W, rope, p, seed)
	h := NewF(KindBF16, cfg.HCMult, cfg.Dim)
	for j := 0; j < cfg.HCMult; j++ {
		copy(h.F[j*cfg.Dim:], SyntheticInput(cfg, p, seed+uint64(j)).F)
	}
	seeds := map[string]Tensor{"h_in": h, GlobalPrefix + "tok": FromI(KindI64, []int64{3}, 1)}
	ctx := &StepContext{Cfg: cfg, Layer: l, Pos: p, W: W, Rope: rope}
	a, _, err := RunLayer(ctx, seeds, st)
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := RunLayer(ctx, seeds, st)
	if err != nil {
		t.Fatal(err)
	}
	for name, v := range a {
		if !slices.Equal(v.F, b[name].F) || !slices.Equal(v.I, b[name].I) {
			t.Errorf("%s differs between two runs", name)
		}
	}
	attn, _, err := RunStep(ctx, a["x"], st)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(attn["y"].F, a["y"].F) {
		t.Error("RunLayer's y differs from RunStep's from the same x")
	}
	changed := 0
	for i, v := range a["h_out"].F {
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			t.Fatalf("h_out[%d] = %v", i, v)
		}
		if v != h.F[i] {
			changed++
		}
	}
	if changed < len(h.F)/2 {
		t.Errorf("h_out differs from h_in in only %d of %d values", changed, len(h.F))
	}
}

// TestLazyExperts: routed experts read on demand (one kept at a time) give
// the bits of the experts read at load, on every step and layer of the
// golden; a missing expert tensor is still an error at load.
func TestLazyExperts(t *testing.T) {
	st, err := dump.OpenSafetensors(filepath.Join(goldenTiny, "weights.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	cfg, _ := Preset("tiny")
	if cfg.ExpertBytes() != 4*3*256*256/2+4*3*256*256/32 {
		t.Errorf("ExpertBytes = %d", cfg.ExpertBytes())
	}
	for l := 0; l < cfg.NLayers; l++ {
		eager, err := LoadBlockWeights(cfg, l, st)
		if err != nil {
			t.Fatal(err)
		}
		lazy, err := LoadBlockWeightsWith(cfg, l, st, BlockLoadOptions{LazyExperts: true, Cache: NewExpertCache(cfg.ExpertBytes() / int64(cfg.NRoutedExperts))})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range lazy.MoE.Experts {
			if e != nil {
				t.Fatal("lazy load read an expert")
			}
		}
		for P := 2; P <= 7; P++ {
			sst, err := dump.OpenSafetensors(filepath.Join(goldenTiny, fmt.Sprintf("step_%d.safetensors", P)))
			if err != nil {
				t.Fatal(err)
			}
			x, _, _ := sst.Float32(fmt.Sprintf("L%d.ffn_in", l))
			ids, _, _ := sst.Int64(fmt.Sprintf("L%d.moe_indices", l))
			w, _, _ := sst.Float32(fmt.Sprintf("L%d.moe_weights", l))
			sst.Close()
			idx := []int32{int32(ids[0]), int32(ids[1])}
			a, err := eager.MoE.Combine(x, idx, w)
			if err != nil {
				t.Fatal(err)
			}
			b, err := lazy.MoE.Combine(x, idx, w)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(a, b) {
				t.Fatalf("layer %d step %d: lazy experts give other bits", l, P)
			}
		}
	}
	src := st
	var recs []dump.Record
	for _, n := range src.Names() {
		if strings.HasPrefix(n, "layers.1.") && n != "layers.1.ffn.experts.3.w2.scale" {
			r, err := src.Read(n)
			if err != nil {
				t.Fatal(err)
			}
			recs = append(recs, r)
		}
	}
	var buf bytes.Buffer
	if err := dump.WriteSafetensors(&buf, recs, nil); err != nil {
		t.Fatal(err)
	}
	edited, err := dump.NewSafetensors(bytes.NewReader(buf.Bytes()), int64(buf.Len()), "edited")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := LoadBlockWeightsWith(cfg, 1, edited, BlockLoadOptions{LazyExperts: true}); err == nil || !strings.Contains(err.Error(), "experts.3.w2.scale") {
		t.Errorf("lazy load without an expert scale: %v", err)
	}
}

// TestLazyEmbedSameRows: embed.weight read row by row from the file
// (HeadLoadOptions.LazyEmbed, a CheckpointEmbedding) gives every row the
// bits of the in-memory table; a token outside the vocabulary, a
// non-finite value in the row read, an fp32 table and a source that cannot
// read ranges are errors.
func TestLazyEmbedSameRows(t *testing.T) {
	st, err := dump.OpenSafetensors(filepath.Join(goldenTiny, "weights.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	cfg, _ := Preset("tiny")
	mem, err := LoadHeadWeights(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	lazy, err := LoadHeadWeightsWith(cfg, st, HeadLoadOptions{LazyEmbed: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := lazy.Embed.(*CheckpointEmbedding); !ok {
		t.Fatalf("LazyEmbed loaded a %T", lazy.Embed)
	}
	a, b := make([]float32, cfg.Dim), make([]float32, cfg.Dim)
	for tok := int64(0); tok < int64(cfg.VocabSize); tok++ {
		if err := mem.Embed.Row(a, tok); err != nil {
			t.Fatal(err)
		}
		if err := lazy.Embed.Row(b, tok); err != nil {
			t.Fatal(err)
		}
		if k := bitsEqual(a, b); k != -1 {
			t.Fatalf("token %d: row differs at %d: %g read from the file, %g in memory", tok, k, b[k], a[k])
		}
	}
	for _, tok := range []int64{-1, int64(cfg.VocabSize)} {
		if err := lazy.Embed.Row(b, tok); err == nil || !strings.Contains(err.Error(), "outside the vocabulary") {
			t.Errorf("token %d: %v", tok, err)
		}
	}
	// a NaN in row 3 of an otherwise valid table, an fp32 table
	rec, err := st.Read("embed.weight")
	if err != nil {
		t.Fatal(err)
	}
	withEmbed := func(r dump.Record) *dump.Safetensors {
		var buf bytes.Buffer
		if err := dump.WriteSafetensors(&buf, []dump.Record{r}, nil); err != nil {
			t.Fatal(err)
		}
		s, err := dump.NewSafetensors(bytes.NewReader(buf.Bytes()), int64(buf.Len()), "edited")
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	if rec.DType != dump.BF16 {
		t.Fatalf("the golden's embed.weight is %s, the test needs bf16", rec.DType)
	}
	bad := rec
	bad.Data = slices.Clone(rec.Data)
	o := 2 * (3*cfg.Dim + 5)
	bad.Data[o], bad.Data[o+1] = 0xc0, 0x7f // bf16 NaN
	e := &CheckpointEmbedding{Src: withEmbed(bad), Name: "embed.weight", Vocab: cfg.VocabSize, Dim: cfg.Dim}
	if err := e.Row(b, 2); err != nil {
		t.Fatalf("row 2 has no NaN: %v", err)
	}
	if err := e.Row(b, 3); err == nil || !strings.Contains(err.Error(), "embed.weight[3][5]") {
		t.Errorf("NaN in row 3: %v", err)
	}
	f32 := rec
	v, err := rec.Float32()
	if err != nil {
		t.Fatal(err)
	}
	f32.DType, f32.Data = dump.F32, f32Bytes(v)
	if _, err := (weightReader{withEmbed(f32)}).lazyEmbedding(cfg.VocabSize, cfg.Dim); err == nil || !strings.Contains(err.Error(), "needs bf16") {
		t.Errorf("fp32 table: %v", err)
	}
	if _, err := (weightReader{wholeOnly{st}}).lazyEmbedding(cfg.VocabSize, cfg.Dim); err == nil || !strings.Contains(err.Error(), "row by row") {
		t.Errorf("a source without ReadRange: %v", err)
	}
}

// wholeOnly hides a source's ReadRange.
type wholeOnly struct{ dump.WeightSource }

// TestExpertCacheBudget: the cache shared by layers keeps at most its
// budget in bytes, evicts the least recently used expert of any layer
// first (a hit refreshes it), re-reads an evicted expert, keeps no expert
// larger than the budget, and the same request sequence leaves the same
// experts in the same order.
func TestExpertCacheBudget(t *testing.T) {
	mk := func(rows int) *moe.Expert { // 3·rows·(64+4) bytes
		w := func() *moe.FP4Weight {
			return &moe.FP4Weight{Rows: rows, Cols: 128, Packed: make([]uint8, rows*64), Scale: make([]uint8, rows*4)}
		}
		return &moe.Expert{W1: w(), W2: w(), W3: w()}
	}
	const unit = 3 * 68 // bytes of mk(1)
	run := func() ([][2]int, int64, *ExpertCache) {
		c := NewExpertCache(3 * unit)
		var log []expertKey
		get := func(l, e, rows int) {
			k := expertKey{l, e}
			if _, err := c.get(k, func() (*moe.Expert, error) { log = append(log, k); return mk(rows), nil }); err != nil {
				t.Fatal(err)
			}
			if c.Bytes() > c.Budget() {
				t.Fatalf("after (%d, %d): %d bytes held, budget %d", l, e, c.Bytes(), c.Budget())
			}
		}
		get(0, 1, 1)
		get(1, 1, 1)
		get(2, 7, 1) // full: (2,7) (1,1) (0,1)
		get(0, 1, 1) // a hit: (0,1) (2,7) (1,1)
		get(3, 0, 1) // evicts (1,1), the least recently used
		if got := c.Held(); !slices.Equal(got, [][2]int{{3, 0}, {0, 1}, {2, 7}}) {
			t.Fatalf("held %v", got)
		}
		get(1, 1, 2) // re-read, 2 units: evicts (2,7) and (0,1)
		if got := c.Held(); !slices.Equal(got, [][2]int{{1, 1}, {3, 0}}) {
			t.Fatalf("held %v", got)
		}
		get(4, 4, 4) // larger than the budget: used, not kept
		if got := c.Held(); !slices.Equal(got, [][2]int{{1, 1}, {3, 0}}) || c.Bytes() != 3*unit {
			t.Fatalf("after an expert larger than the budget: held %v, %d bytes", got, c.Bytes())
		}
		want := []expertKey{{0, 1}, {1, 1}, {2, 7}, {3, 0}, {1, 1}, {4, 4}}
		if !slices.Equal(log, want) || c.Reads() != int64(len(want)) {
			t.Fatalf("reads %v (%d), want %v", log, c.Reads(), want)
		}
		return c.Held(), c.Bytes(), c
	}
	h1, b1, c := run()
	h2, b2, _ := run()
	if !slices.Equal(h1, h2) || b1 != b2 {
		t.Fatalf("the same requests left %v (%d bytes), then %v (%d bytes)", h1, b1, h2, b2)
	}
	c.Reset()
	if c.Bytes() != 0 || len(c.Held()) != 0 {
		t.Fatal("Reset left experts")
	}
	// an error from the read is returned and nothing is kept
	if _, err := c.get(expertKey{0, 0}, func() (*moe.Expert, error) { return nil, fmt.Errorf("bad tensor") }); err == nil || len(c.Held()) != 0 {
		t.Fatalf("read error: %v, held %v", err, c.Held())
	}
	// the V4-Flash default: one step of every layer plus k experts
	flash, _ := Preset("flash")
	per := flash.ExpertBytes() / int64(flash.NRoutedExperts)
	if got, want := flash.ExpertCacheBytes(), int64(44*6)*per; got != want || per != 13369344 {
		t.Errorf("flash ExpertCacheBytes = %d (per expert %d), want %d", got, per, want)
	}
}
