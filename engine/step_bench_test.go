package engine

import "testing"

// benchDecodeStep measures one reference decode step (RunStep: every stage,
// state copy included) of layer l of V4-Flash at position p, i.e. with a
// context of p tokens: synthetic weights and state, real dims.
//
//	go test ./engine -run '^$' -bench DecodeStepFlash -benchtime 3x
func benchDecodeStep(b *testing.B, l int, p int64) {
	cfg, _ := Preset("flash")
	w := RandomLayerWeights(cfg, l, 1)
	rope := LayerRope(cfg, l, int(p)+1)
	st := SyntheticState(cfg, w, rope, p, 1)
	x := SyntheticInput(cfg, p, 1)
	ctx := &StepContext{Cfg: cfg, Layer: l, Pos: p, W: w, Rope: rope}
	b.ResetTimer()
	for b.Loop() {
		if _, _, err := RunStep(ctx, x, st); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(st.Rows()), "cmp-rows")
}

// CSA layer 2 at context 65,536: window 128 + top-512 of 16,384 compressed rows,
// indexer over all 16,384 index keys.
func BenchmarkDecodeStepFlashCSA(b *testing.B) { benchDecodeStep(b, 2, 65536) }

// HCA layer 3 at context 65,536: window 128 + all 512 compressed rows.
func BenchmarkDecodeStepFlashHCA(b *testing.B) { benchDecodeStep(b, 3, 65536) }
