package head

import (
	"math"
	"strings"
	"testing"
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
