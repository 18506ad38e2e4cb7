package head

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"sparsemla/attention"
	"sparsemla/quant"
)

func TestEmbed(t *testing.T) {
	table := []float32{1, 2, 3, 4, 5, 6}
	e := make([]float32, 2)
	if err := Embed(e, table, 2); err != nil || e[0] != 5 || e[1] != 6 {
		t.Errorf("Embed row 2 = %v, %v", e, err)
	}
	tb := &Table{Dim: 2, W: table}
	if err := tb.Row(e, 1); err != nil || e[0] != 3 || e[1] != 4 {
		t.Errorf("Table.Row(1) = %v, %v", e, err)
	}
	if err := tb.Row(make([]float32, 3), 1); err == nil {
		t.Error("Table.Row accepted a row of the wrong width")
	}
	for _, tok := range []int64{-1, 3} {
		if err := Embed(e, table, tok); err == nil || !strings.Contains(err.Error(), "outside the vocabulary") {
			t.Errorf("Embed(%d) = %v, want an out-of-vocabulary error", tok, err)
		}
	}
}

func TestGreedy(t *testing.T) {
	nan := float32(math.NaN())
	for _, c := range []struct {
		l    []float32
		want int
	}{
		{[]float32{0.1, 3, 2}, 1},
		{[]float32{3, 1, 3}, 0},        // first of equal maxima
		{[]float32{1, nan, 5, nan}, 1}, // first NaN
		{nil, -1},
	} {
		if got := Greedy(c.l); got != c.want {
			t.Errorf("Greedy(%v) = %d, want %d", c.l, got, c.want)
		}
	}
}

// TestBF16TableAndPanels: the bf16 forms of the embedding and the head
// (BF16Table, Head.Panels without Weight) give the bits of the fp32 forms.
func TestBF16TableAndPanels(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	const vocab, dim = 70, 64
	w := make([]float32, vocab*dim)
	bits := make([]uint16, len(w))
	for i := range w {
		w[i] = quant.BF16Round(float32(rng.NormFloat64()))
		bits[i] = uint16(math.Float32bits(w[i]) >> 16)
	}
	tb, bt := &Table{Dim: dim, W: w}, &BF16Table{Dim: dim, W: bits}
	for _, tok := range []int64{0, 33, vocab - 1} {
		a, b := make([]float32, dim), make([]float32, dim)
		if err := tb.Row(a, tok); err != nil {
			t.Fatal(err)
		}
		if err := bt.Row(b, tok); err != nil {
			t.Fatal(err)
		}
		for i := range a {
			if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
				t.Fatalf("BF16Table row %d [%d] = %v, Table %v", tok, i, b[i], a[i])
			}
		}
	}
	if err := bt.Row(make([]float32, dim), vocab); err == nil || !strings.Contains(err.Error(), "outside the vocabulary") {
		t.Errorf("BF16Table.Row(vocab) = %v", err)
	}
	x := make([]float32, dim)
	for i := range x {
		x[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	ref := &Head{Mult: 1, Dim: dim, Vocab: vocab, Weight: w}
	pk := &Head{Mult: 1, Dim: dim, Vocab: vocab, Panels: attention.PackPanels(w, vocab, dim)}
	if pk.Panels.BF16 == nil {
		t.Fatal("bf16 values packed as fp32 panels")
	}
	a, b := ref.Logits(x), pk.Logits(x)
	for v := range a {
		if math.Float32bits(a[v]) != math.Float32bits(b[v]) {
			t.Fatalf("logit %d from the panels = %v, from Weight %v", v, b[v], a[v])
		}
	}
}
