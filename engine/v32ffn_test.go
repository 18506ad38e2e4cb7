package engine

import (
	"bytes"
	"math"
	"math/rand/v2"
	"reflect"
	"testing"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/quant"
)

// v32WholeModel returns v32-tiny layer weights with the FFN part (layer 0
// dense, layer 1 MoE with the head), written to records and loaded back.
func v32WholeModel(t *testing.T, seed uint64) (*Config, []*LayerWeights, []*LayerWeights) {
	t.Helper()
	cfg, err := Preset("v32-tiny")
	if err != nil {
		t.Fatal(err)
	}
	var made []*LayerWeights
	var recs []dump.Record
	for l := 0; l < cfg.NLayers; l++ {
		w := RandomLayerWeights(cfg, l, seed)
		w.V32.FFN = RandomV32FFNWeights(cfg, l, seed)
		made = append(made, w)
		recs = append(recs, LayerWeightRecords(cfg, w)...)
	}
	var buf bytes.Buffer
	if err := dump.WriteSafetensors(&buf, recs, nil); err != nil {
		t.Fatal(err)
	}
	st, err := dump.NewSafetensors(bytes.NewReader(buf.Bytes()), int64(buf.Len()), "v32ffn")
	if err != nil {
		t.Fatal(err)
	}
	var loaded []*LayerWeights
	for l := 0; l < cfg.NLayers; l++ {
		w, err := LoadLayerWeights(cfg, l, st)
		if err != nil {
			t.Fatal(err)
		}
		loaded = append(loaded, w)
	}
	return cfg, made, loaded
}

// The FFN part written by LayerWeightRecords loads back to the same values
// and runs the same whole layer (two steps of both layers, chained through
// x_in / res_in as Block.forward chains them).
func TestV32FFNRoundTripAndChain(t *testing.T) {
	cfg, made, loaded := v32WholeModel(t, 5)
	for l := range made {
		a, b := made[l].V32.FFN, loaded[l].V32.FFN
		if !reflect.DeepEqual(a.AttnNorm, b.AttnNorm) || !reflect.DeepEqual(a.FFNNorm, b.FFNNorm) || !reflect.DeepEqual(a.Head, b.Head) || !reflect.DeepEqual(a.Norm, b.Norm) {
			t.Fatalf("layer %d: norms/head differ after the round trip", l)
		}
		if (a.Gate == nil) != (b.Gate == nil) || a.Gate != nil && !reflect.DeepEqual(a.Gate.Weight, b.Gate.Weight) {
			t.Fatalf("layer %d: gate differs after the round trip", l)
		}
		for i := range a.mlps(cfg, l) {
			ma, mb := a.mlps(cfg, l)[i], b.mlps(cfg, l)[i]
			for j := 0; j < 3; j++ {
				if !bytes.Equal((*ma.slot(j)).CodesRowMajor(), (*mb.slot(j)).CodesRowMajor()) || !bytes.Equal((*ma.slot(j)).Scale, (*mb.slot(j)).Scale) {
					t.Fatalf("layer %d mlp %d w%d differs after the round trip", l, i, j+1)
				}
			}
		}
	}
	const p = 3
	run := func(ws []*LayerWeights) map[string]Tensor {
		x := SyntheticInput(cfg, p, 9)
		all := map[string]Tensor{}
		seeds := map[string]Tensor{"x_in": x}
		for l, w := range ws {
			rope := LayerRope(cfg, l, p+1)
			st := SyntheticState(cfg, w, rope, p, 9)
			ctx := &StepContext{Cfg: cfg, Layer: l, Pos: p, W: w, Rope: rope}
			out, _, err := RunLayer(ctx, seeds, st)
			if err != nil {
				t.Fatal(err)
			}
			for n, v := range out {
				all[string(rune('0'+l))+":"+n] = v
			}
			seeds = map[string]Tensor{"x_in": out["ffn_out"], "res_in": out["h_mid"]}
		}
		return all
	}
	a, b := run(made), run(loaded)
	for _, n := range []string{"0:x", "0:ffn_out", "1:h_in", "1:x", "1:moe_indices", "1:moe_weights", "1:ffn_out", "1:logits"} {
		if _, ok := a[n]; !ok {
			t.Fatalf("stage %s missing from the whole-layer run", n)
		}
		if !reflect.DeepEqual(a[n], b[n]) {
			t.Fatalf("stage %s differs between the generated and the loaded weights", n)
		}
	}
	if got := len(a["1:logits"].F); got != cfg.VocabSize {
		t.Fatalf("logits have %d values, want %d", got, cfg.VocabSize)
	}
	// the MoE weights: sigmoid scores normalised × route_scale sum to route_scale
	var sum float64
	for _, v := range a["1:moe_weights"].F {
		sum += float64(v)
	}
	if math.Abs(sum-cfg.RouteScale) > 1e-5 {
		t.Fatalf("moe_weights sum to %g, want route_scale %g", sum, cfg.RouteScale)
	}
	// h_in of layer 1 is bf16(ffn_out@0 + h_mid@0)
	for i, v := range a["1:h_in"].F {
		if w := quant.BF16Round(a["0:ffn_out"].F[i] + a["0:h_mid"].F[i]); v != w {
			t.Fatalf("1:h_in[%d] = %g, want %g", i, v, w)
		}
	}
}

// Known answer for V32MLP: with identity w1 = w2 = w3 and an input exact in
// E4M3 under one power-of-two scale, both up-projections return x, so
// out = FP8Lin(I, bf16(silu(x)·x)) = bf16(FQ8(bf16(silu(x)·x), 128)).
func TestV32MLPIdentity(t *testing.T) {
	const n = 256
	eye := make([]float32, n*n)
	for i := 0; i < n; i++ {
		eye[i*n+i] = 1
	}
	I := attention.QuantizeFP8Weight(eye, n, n)
	m := &V32MLP{W1: I, W2: I, W3: I}
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(i%17-8) / 4 // multiples of 1/4 in [-2, 2]: exact in E4M3
	}
	x[0] = 448.0 / 64 // sets the block amax to a power-of-two multiple of 448
	x[128] = -448.0 / 64
	out := make([]float32, n)
	m.Forward(out, x)
	want := make([]float32, n)
	for i, v := range x {
		want[i] = quant.BF16Round(float32(float64(v)/(1+math.Exp(-float64(v)))) * v)
	}
	quant.FQ8(want, 128)
	for i := range want {
		want[i] = quant.BF16Round(want[i])
		if out[i] != want[i] {
			t.Fatalf("out[%d] = %g, want %g (x %g)", i, out[i], want[i], x[i])
		}
	}
}

// The fused add-RMSNorm normalises the fp32 sum, not its bf16 rounding
// (the two differ on this input), and returns the bf16 sum as the residual.
func TestV32AddNormFP32Sum(t *testing.T) {
	const n = 256
	rng := rand.New(rand.NewPCG(1, 2))
	x, r, w := make([]float32, n), make([]float32, n), make([]float32, n)
	for i := range x {
		x[i] = quant.BF16Round(float32(rng.NormFloat64()))
		r[i] = quant.BF16Round(float32(0.01 * rng.NormFloat64()))
		w[i] = quant.BF16Round(float32(1 + 0.1*rng.NormFloat64()))
	}
	normed, h := make([]float32, n), make([]float32, n)
	V32AddNorm(normed, h, x, r, w, 1e-6)
	s, hb := make([]float32, n), make([]float32, n)
	for i := range s {
		s[i] = x[i] + r[i]
		hb[i] = quant.BF16Round(s[i])
		if h[i] != hb[i] {
			t.Fatalf("h[%d] = %g, want bf16(x + r) = %g", i, h[i], hb[i])
		}
	}
	want, ofBF16 := make([]float32, n), make([]float32, n)
	attention.RMSNorm(want, s, w, 1e-6)
	attention.RMSNorm(ofBF16, hb, w, 1e-6)
	if !reflect.DeepEqual(normed, want) {
		t.Fatal("normed is not RMSNorm of the fp32 sum")
	}
	if reflect.DeepEqual(want, ofBF16) {
		t.Fatal("test input does not tell the fp32 sum from its bf16 rounding")
	}
}
