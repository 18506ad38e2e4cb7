package engine

import (
	"encoding/json"
	"strings"
	"testing"

	"sparsemla/attention"
)

// A bf16 checkpoint (dtype "bf16") is accepted; another dtype is refused.
func TestBF16CheckpointConfig(t *testing.T) {
	c, _ := Preset("tiny")
	for dt, ok := range map[string]bool{"fp8": true, "bf16": true, "fp16": false, "": false} {
		m := map[string]any{}
		b, _ := json.Marshal(c)
		json.Unmarshal(b, &m)
		m["dtype"] = dt
		b, _ = json.Marshal(m)
		got, err := ParseConfig(b)
		if (err == nil) != ok {
			t.Errorf("dtype %q: %v", dt, err)
		}
		if err == nil && got.BF16Checkpoint() != (dt == "bf16") {
			t.Errorf("dtype %q: BF16Checkpoint %v", dt, got.BF16Checkpoint())
		}
	}
}

// On a bf16 checkpoint the linear stages are model.py's F.linear on the bf16
// weight (attention.BF16Linear: no activation quantisation), the equations
// say BF16Lin, and the layer stays on the reference loops.
func TestBF16CheckpointLinearStages(t *testing.T) {
	c, _ := Preset("tiny")
	c.DType = "bf16"
	const layer = 1 // r = 4: the indexer's wq_b too
	w := RandomLayerWeights(c, layer, 7)
	// the bf16 weight values: W only, as LoadLayerWeights reads a bf16 checkpoint
	for _, p := range []**attention.FP8Weight{&w.WqA, &w.WqB, &w.Wkv, &w.WoB, &w.Indexer.WqB} {
		*p = &attention.FP8Weight{Rows: (*p).Rows, Cols: (*p).Cols, W: (*p).W}
	}
	PrepareLayer(c, w)
	if w.Fast != nil {
		t.Fatal("a bf16 checkpoint layer was prepared")
	}
	rope := LayerRope(c, layer, 16)
	ctx := &StepContext{Cfg: c, Layer: layer, Pos: 5, W: w, Rope: rope}
	x := SyntheticInput(c, 5, 1)
	defs := Stages(c, layer, 5)
	in := map[string]Tensor{"x": x}
	n := 0
	for _, def := range defs {
		if strings.Contains(def.Equation, "FP8Lin(") {
			t.Errorf("%s: equation %q on a bf16 checkpoint", def.Name, def.Equation)
		}
		var wt *attention.FP8Weight
		src := "x"
		switch def.Name {
		case "q_a":
			wt = w.WqA
		case "kv_raw":
			wt = w.Wkv
		case "q_b", "iq_b":
			wt, src = w.WqB, "cq"
			if def.Name == "iq_b" {
				wt = w.Indexer.WqB
			}
		default:
			continue
		}
		if _, ok := in[src]; !ok {
			t.Fatalf("%s: input %s not computed yet", def.Name, src)
		}
		got, err := def.Compute(ctx, in)
		if err != nil {
			t.Fatal(err)
		}
		want := make([]float32, wt.Rows)
		attention.BF16Linear(want, in[src].F, wt.W, wt.Rows, wt.Cols)
		fp8 := make([]float32, wt.Rows)
		attention.FP8Linear(fp8, in[src].F, wt)
		same, differ := 0, 0
		for i := range want {
			if got.F[i] == want[i] {
				same++
			}
			if fp8[i] != want[i] {
				differ++
			}
		}
		if same != len(want) || differ == 0 {
			t.Errorf("%s: %d of %d values are BF16Linear's; the FP8 path differs on %d", def.Name, same, len(want), differ)
		}
		in[def.Name] = got
		if def.Name == "q_a" {
			cqDef := defs[1]
			cq, err := cqDef.Compute(ctx, in)
			if err != nil {
				t.Fatal(err)
			}
			in["cq"] = cq
		}
		n++
	}
	if n != 4 {
		t.Fatalf("%d linear stages checked, want 4", n)
	}
	defer func() {
		if recover() == nil {
			t.Error("Prepare of a bf16 checkpoint layer did not panic")
		}
	}()
	Prepare(c, w)
}
