package engine

import (
	"math"
	"strings"
	"testing"
)

// official671B is deepseek-ai/DeepSeek-V3.2-Exp inference/config_671B_v3.2.json.
const official671B = `{
    "vocab_size": 129280, "dim": 7168, "inter_dim": 18432, "moe_inter_dim": 2048, "n_layers": 61,
    "n_dense_layers": 3, "n_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "n_activated_experts": 8, "n_expert_groups": 8, "n_limited_groups": 4, "route_scale": 2.5,
    "score_func": "sigmoid", "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "dtype": "fp8", "scale_fmt": "ue8m0",
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}`

func TestV32ConfigOfficial(t *testing.T) {
	c, err := ParseConfig([]byte(official671B))
	if err != nil {
		t.Fatal(err)
	}
	p, _ := Preset("v32")
	if !c.V32() || c.Variant() != "v3.2" {
		t.Fatalf("official V3.2 config not detected as V3.2")
	}
	a, _ := c.MarshalJSON()
	b, _ := p.MarshalJSON()
	if string(a) != string(b) {
		t.Errorf("preset v32 differs from config_671B_v3.2.json:\n%s\n%s", a, b)
	}
	// YaRN: max_seq_len 16384 > original_seq_len 4096 → τ = 192^-0.5 · (0.1 ln 40 + 1)²
	m := 0.1*math.Log(40) + 1
	if got, want := c.V32SoftmaxScale(), float32(math.Pow(192, -0.5)*m*m); got != want {
		t.Errorf("softmax scale %g, want %g", got, want)
	}
	// round trip through JSON stays V3.2
	c2, err := ParseConfig(a)
	if err != nil || !c2.V32() || c2.NLayers != 61 || c2.IndexTopK != 2048 {
		t.Fatalf("round trip: %v %+v", err, c2)
	}
	// a V4 key in a V3.2 config is refused
	if _, err := ParseConfig([]byte(`{"kv_lora_rank": 512, "window_size": 128}`)); err == nil || !strings.Contains(err.Error(), "window_size") {
		t.Errorf("V4 key in a V3.2 config: %v", err)
	}
	// V4 configs are untouched
	v4, _ := Preset("flash")
	if v4.V32() {
		t.Errorf("flash detected as V3.2")
	}
	j, _ := v4.MarshalJSON()
	if strings.Contains(string(j), "kv_lora_rank") {
		t.Errorf("V4 config JSON gained V3.2 keys: %s", j)
	}
}

// TestV32StepDenseEquivalence: with top-k ≥ T every token is selected and the
// absorbed MLA decode must equal the plain (non-absorbed) multi-head attention
// of model.py's prefill form — k_nope = wkv_b_k·latent, v = wkv_b_v·latent —
// computed here in float64 from the same q_b, latent cache and weights.
func TestV32StepDenseEquivalence(t *testing.T) {
	cfg, _ := Preset("v32-tiny")
	const p = 9 // T = 10 ≤ top-16
	w := RandomLayerWeights(cfg, 1, 7)
	rope := LayerRope(cfg, 1, 64)
	st := SyntheticState(cfg, w, rope, p, 3)
	x := SyntheticInput(cfg, p, 3)
	out, next, err := RunStep(&StepContext{Cfg: cfg, Layer: 1, Pos: p, W: w, Rope: rope}, x, st)
	if err != nil {
		t.Fatal(err)
	}
	if next.Next != p+1 || len(next.KV) != (p+1)*cfg.V32KVDim() || len(next.IScale) != p+1 {
		t.Fatalf("state after the step: next %d, %d latent values, %d key scales", next.Next, len(next.KV), len(next.IScale))
	}
	if got := len(out["index_topk"].I); got != p+1 {
		t.Fatalf("index_topk has %d entries, want all %d tokens", got, p+1)
	}
	H, nope, rope64, v, c := cfg.NHeads, cfg.QKNopeHeadDim, 64, cfg.VHeadDim, cfg.KVLoraRank
	T := p + 1
	q, qpe, lat := out["q_b"].F, out["q_pe"].F, out["latent_cache"].F
	wkvb := w.V32.WkvB.W
	tau := float64(cfg.V32SoftmaxScale())
	var want []float64
	for h := 0; h < H; h++ {
		s := make([]float64, T)
		mx := math.Inf(-1)
		for ti := 0; ti < T; ti++ {
			row := lat[ti*(c+rope64):]
			var dot float64
			for d := 0; d < nope; d++ { // q_nope · k_nope, k_nope = wkv_b[h, d, :] · latent
				var k float64
				for j := 0; j < c; j++ {
					k += float64(wkvb[(h*(nope+v)+d)*c+j]) * float64(row[j])
				}
				dot += float64(q[h*(nope+rope64)+d]) * k
			}
			for r := 0; r < rope64; r++ {
				dot += float64(qpe[h*rope64+r]) * float64(row[c+r])
			}
			s[ti] = dot * tau
			mx = math.Max(mx, s[ti])
		}
		var z float64
		for ti := range s {
			s[ti] = math.Exp(s[ti] - mx)
			z += s[ti]
		}
		for j := 0; j < v; j++ {
			var o float64
			for ti := 0; ti < T; ti++ {
				row := lat[ti*(c+rope64):]
				var vv float64
				for k := 0; k < c; k++ {
					vv += float64(wkvb[(h*(nope+v)+nope+j)*c+k]) * float64(row[k])
				}
				o += s[ti] / z * vv
			}
			want = append(want, o)
		}
	}
	// Errors relative to the rms of o_v: bf16 q_absorbed (through exp of
	// scores of size ~10), bf16 probabilities and bf16 o_latent give ~1 %;
	// a wrong half of wkv_b, a wrong RoPE half or a missing mask give ~100 %.
	var rms, worst float64
	for _, o := range want {
		rms += o * o
	}
	rms = math.Sqrt(rms / float64(len(want)))
	for i, o := range want {
		worst = math.Max(worst, math.Abs(float64(out["o_v"].F[i])-o)/rms)
	}
	if worst > 0.03 {
		t.Errorf("absorbed decode vs plain MHA: worst error / rms(o_v) %.3g", worst)
	}
	t.Logf("absorbed decode vs float64 plain MHA: worst error / rms(o_v) %.3g", worst)
}

// TestV32TopKSelects: past index_topk tokens the attention reads exactly the
// selected rows: changing an unselected latent row leaves o_latent unchanged,
// changing a selected one changes it.
func TestV32TopKSelects(t *testing.T) {
	cfg, _ := Preset("v32-tiny")
	const p = 40
	w := RandomLayerWeights(cfg, 0, 11)
	rope := LayerRope(cfg, 0, 64)
	st := SyntheticState(cfg, w, rope, p, 5)
	ctx := &StepContext{Cfg: cfg, Layer: 0, Pos: p, W: w, Rope: rope}
	out, _, err := RunStep(ctx, SyntheticInput(cfg, p, 5), st)
	if err != nil {
		t.Fatal(err)
	}
	sel := out["index_topk"].I
	if len(sel) != cfg.IndexTopK {
		t.Fatalf("top-k has %d entries, want %d", len(sel), cfg.IndexTopK)
	}
	in := map[string]Tensor{}
	for _, n := range []string{"q_absorbed", "q_pe", "latent_cache", "index_topk"} {
		in[n] = out[n].Clone()
	}
	chosen := map[int64]bool{}
	for _, j := range sel {
		chosen[j] = true
	}
	var un, on int64 = -1, sel[0]
	for j := int64(0); j <= p; j++ {
		if !chosen[j] {
			un = j
			break
		}
	}
	base, _ := v32OLatent(ctx, in)
	D := cfg.V32KVDim()
	for _, tc := range []struct {
		row  int64
		same bool
	}{{un, true}, {on, false}} {
		m := in["latent_cache"].Clone()
		for i := 0; i < cfg.KVLoraRank; i++ {
			m.F[int(tc.row)*D+i] += 1
		}
		in2 := map[string]Tensor{"q_absorbed": in["q_absorbed"], "q_pe": in["q_pe"], "latent_cache": m, "index_topk": in["index_topk"]}
		o, err := v32OLatent(ctx, in2)
		if err != nil {
			t.Fatal(err)
		}
		same := true
		for i := range o.F {
			same = same && o.F[i] == base.F[i]
		}
		if same != tc.same {
			t.Errorf("row %d (selected %v): o_latent unchanged = %v", tc.row, chosen[tc.row], same)
		}
	}
}
