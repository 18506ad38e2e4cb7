package engine

import (
	"math"
	"runtime"
	"slices"
	"strings"
	"testing"
)

// TestStateRoundTrip: StateTensors → LoadState gives the same state, for every
// layer kind, and Clone is deep.
func TestStateRoundTrip(t *testing.T) {
	cfg, _ := Preset("tiny")
	for l := 0; l < cfg.NLayers; l++ {
		w := RandomLayerWeights(cfg, l, 5)
		rope := LayerRope(cfg, l, 64)
		st := SyntheticState(cfg, w, rope, 41, 5)
		back, err := LoadState(cfg, l, st.StateTensors())
		if err != nil {
			t.Fatal(err)
		}
		back.Next = st.Next
		for name, a := range st.StateTensors() {
			b := back.StateTensors()[name]
			if !slices.Equal(a.Shape, b.Shape) || !sameBits(a.F, b.F) {
				t.Errorf("layer %d %s changed in the round trip: %v vs %v", l, name, a.Shape, b.Shape)
			}
		}
		c := st.Clone()
		c.KV[0] += 1
		if st.KV[0] == c.KV[0] {
			t.Error("Clone shares the kv cache")
		}
	}
}

func sameBits(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}

// TestStateShapes checks the dump-compatible shapes: r = 128 compressor states
// show only the live rows 0 … (Next−1) mod 128.
func TestStateShapes(t *testing.T) {
	cfg, _ := Preset("tiny")
	st := NewLayerState(cfg, 2) // r = 128
	st.Next = 131               // last token 130: live rows 0 … 2
	m := st.StateTensors()
	if s := m["cmp_kv_state"].Shape; s[0] != 3 || s[1] != 512 {
		t.Errorf("r = 128 cmp_kv_state shape %v, want [3 512]", s)
	}
	if s := m["kv_cache"].Shape; s[0] != 128 || s[1] != 512 {
		t.Errorf("kv_cache shape %v, want [128 512]", s)
	}
	st4 := NewLayerState(cfg, 1)
	m = st4.StateTensors()
	if s := m["cmp_kv_state"].Shape; s[0] != 8 || s[1] != 1024 {
		t.Errorf("r = 4 cmp_kv_state shape %v", s)
	}
	if s := m["icmp_score_state"].Shape; s[0] != 8 || s[1] != 256 || !math.IsInf(float64(m["icmp_score_state"].F[0]), -1) {
		t.Errorf("r = 4 icmp_score_state %v, want [8 256] of −∞", s)
	}
}

func TestLoadStateErrors(t *testing.T) {
	cfg, _ := Preset("tiny")
	good := NewLayerState(cfg, 1).StateTensors()
	for _, c := range []struct {
		name string
		edit func(m map[string]Tensor)
		want string
	}{
		{"missing icache", func(m map[string]Tensor) { delete(m, "icache") }, "missing icache"},
		{"narrow kv_cache", func(m map[string]Tensor) { m["kv_cache"] = NewF(KindBF16, 128, 256) }, "kv_cache has shape"},
		{"short window", func(m map[string]Tensor) { m["kv_cache"] = NewF(KindBF16, 100, 512) }, "kv_cache has shape"},
		{"icache rows", func(m map[string]Tensor) { m["icache"] = NewF(KindBF16, 2, 128) }, "icache has"},
		{"int state", func(m map[string]Tensor) { m["cmp_kv_state"] = FromI(KindI64, make([]int64, 8*1024), 8, 1024) }, "cmp_kv_state has shape"},
	} {
		m := map[string]Tensor{}
		for k, v := range good {
			m[k] = v
		}
		c.edit(m)
		if _, err := LoadState(cfg, 1, m); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want %q", c.name, err, c.want)
		}
	}
	if _, err := LoadState(cfg, 7, good); err == nil {
		t.Error("layer 7 of 4 accepted")
	}
}

// TestRunStepChain decodes several steps of every layer kind from a fresh
// state and checks the state machine: window slot, emitted rows, index list
// lengths, and that the stage outputs do not depend on GOMAXPROCS.
func TestRunStepChain(t *testing.T) {
	cfg, _ := Preset("tiny")
	for l := 0; l < cfg.NLayers; l++ {
		r := cfg.Ratio(l)
		w := RandomLayerWeights(cfg, l, 3)
		rope := LayerRope(cfg, l, 16)
		st := SyntheticState(cfg, w, rope, 1, 3)
		for p := int64(1); p <= 8; p++ {
			ctx := &StepContext{Cfg: cfg, Layer: l, Pos: p, W: w, Rope: rope}
			x := SyntheticInput(cfg, p, 3)
			out, next, err := RunStep(ctx, x, st)
			if err != nil {
				t.Fatal(err)
			}
			prev := runtime.GOMAXPROCS(1)
			out1, _, err := RunStep(ctx, x, st)
			runtime.GOMAXPROCS(prev)
			if err != nil {
				t.Fatal(err)
			}
			for name, a := range out {
				if !sameBits(a.F, out1[name].F) || !slices.Equal(a.I, out1[name].I) {
					t.Fatalf("layer %d p %d: %s differs at GOMAXPROCS 1", l, p, name)
				}
			}
			if !slices.Equal(next.KV[int(p)*512:int(p+1)*512], out["kv"].F) {
				t.Errorf("layer %d p %d: kv not in window slot %d", l, p, p)
			}
			tc := 0
			if r > 0 {
				tc = int(p+1) / r
			}
			if next.Rows() != tc {
				t.Errorf("layer %d p %d: %d compressed rows, want %d", l, p, next.Rows(), tc)
			}
			k := tc
			if r == 4 {
				k = min(tc, cfg.IndexTopK)
			}
			if n := len(out["topk_idxs"].I); n != 128+k {
				t.Errorf("layer %d p %d: index list of %d entries, want %d", l, p, n, 128+k)
			}
			if next.Next != p+1 {
				t.Errorf("next state at %d, want %d", next.Next, p+1)
			}
			st = next
		}
		// A state at the wrong position is refused.
		ctx := &StepContext{Cfg: cfg, Layer: l, Pos: 3, W: w, Rope: rope}
		if _, _, err := RunStep(ctx, SyntheticInput(cfg, 3, 3), st); err == nil {
			t.Error("RunStep accepted a state at position 9 for step 3")
		}
	}
}

// TestNewCompressorStateFill: every score starts at −inf and every kv at
// 0, at every size (the fill doubles a copy).
func TestNewCompressorStateFill(t *testing.T) {
	for _, r := range []int{4, 128} {
		for _, d := range []int{1, 3, 128, 512} {
			st := newCompressorState(r, d)
			n := Coff(r) * r * Coff(r) * d
			if len(st.Score) != n || len(st.KV) != n {
				t.Fatalf("r %d d %d: %d scores, %d kv, want %d", r, d, len(st.Score), len(st.KV), n)
			}
			for i := range n {
				if !math.IsInf(float64(st.Score[i]), -1) || st.KV[i] != 0 {
					t.Fatalf("r %d d %d: score[%d] = %v, kv = %v", r, d, i, st.Score[i], st.KV[i])
				}
			}
		}
	}
}
