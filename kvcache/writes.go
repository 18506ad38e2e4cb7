package kvcache

import (
	"fmt"
	"math"
)

// Cache-write hypotheses: the reference's window write of one decode step and
// the ways a GPU's write goes wrong (wrong slot, missing or double write, a
// compressed row not written). The replay runs them on the dumped cache
// before the step and the step's kv to tell a cache-write error from a stale
// or foreign page: a write error changes only the rows this step writes,
// and its result is reproduced bit for bit by one of these.
//
// The cache is the reference's kv_cache tensor [W + Tc, d] row-major: window
// slots 0..W-1 (token t in slot t mod W), then compressed rows.

// WindowWrite is the reference's write (stage kv_cache): a copy of prev with
// window slot p mod W set to kv [d]. prev [rows, d], rows ≥ W.
func WindowWrite(prev []float32, d, W int, kv []float32, p int64) []float32 {
	return windowWriteSlots(prev, d, W, kv, p, []int64{p})
}

func windowWriteSlots(prev []float32, d, W int, kv []float32, p int64, tokens []int64) []float32 {
	if d <= 0 || W <= 0 || len(prev)%d != 0 || len(prev)/d < W || len(kv) != d || p < 0 {
		panic("kvcache: window write shape mismatch")
	}
	out := append([]float32(nil), prev...)
	for _, t := range tokens {
		if t < 0 {
			continue
		}
		s := int(t % int64(W))
		copy(out[s*d:(s+1)*d], kv)
	}
	return out
}

// WriteHypothesis is one way a GPU may write the step's window row.
type WriteHypothesis struct {
	Name string // e.g. "written to slot (p-1) mod W"
	// Write returns the cache after the step under the hypothesis: prev with
	// the hypothesis's write of kv (prev is not modified).
	Write func(prev []float32, d, W int, kv []float32, p int64) []float32
}

// WindowWriteHypotheses lists the cache-write errors: the row in slot
// (p−1) mod W or (p+1) mod W instead of p mod W (the neighbour overwritten,
// slot p stale), no write (slot p keeps token p−W's row), and a double write
// into p mod W and one neighbour.
func WindowWriteHypotheses() []WriteHypothesis {
	one := func(name string, off int64) WriteHypothesis {
		return WriteHypothesis{Name: name, Write: func(prev []float32, d, W int, kv []float32, p int64) []float32 {
			return windowWriteSlots(prev, d, W, kv, p, []int64{p + off + int64(W)})
		}}
	}
	two := func(name string, off int64) WriteHypothesis {
		return WriteHypothesis{Name: name, Write: func(prev []float32, d, W int, kv []float32, p int64) []float32 {
			return windowWriteSlots(prev, d, W, kv, p, []int64{p, p + off + int64(W)})
		}}
	}
	return []WriteHypothesis{
		one("written to slot (p-1) mod W instead of p mod W", -1),
		one("written to slot (p+1) mod W instead of p mod W", +1),
		{Name: "not written (slot p mod W keeps its old row)", Write: func(prev []float32, d, W int, kv []float32, p int64) []float32 {
			return windowWriteSlots(prev, d, W, kv, p, nil)
		}},
		two("written twice: slot p mod W and slot (p-1) mod W", -1),
		two("written twice: slot p mod W and slot (p+1) mod W", +1),
	}
}

// WriteMatch is the verdict of MatchWindowWrite.
type WriteMatch struct {
	Name string // the hypothesis reproducing the GPU's cache ("" when none)
	// Rows lists the window slots where the GPU's cache differs from the
	// reference's write, ascending.
	Rows []int
}

// MatchWindowWrite compares the GPU's window slots (the first W rows of gpu,
// [rows, d]) with the reference's write and, when they differ, returns the
// hypothesis whose write reproduces the GPU's window bit for bit (first in
// list order). Rows past the window (compressed rows) are not compared. It
// returns an error when the shapes do not fit.
func MatchWindowWrite(gpu, prev []float32, d, W int, kv []float32, p int64) (WriteMatch, error) {
	if d <= 0 || len(gpu) < W*d || len(prev) < W*d || len(prev)%d != 0 || len(kv) != d {
		return WriteMatch{}, fmt.Errorf("kvcache: window write check: cache of %d values, previous %d, kv %d, for %d slots of %d", len(gpu), len(prev), len(kv), W, d)
	}
	var m WriteMatch
	ref := WindowWrite(prev, d, W, kv, p)
	for s := 0; s < W; s++ {
		if !rowBitsEqual(ref[s*d:(s+1)*d], gpu[s*d:(s+1)*d]) {
			m.Rows = append(m.Rows, s)
		}
	}
	if len(m.Rows) == 0 {
		return m, nil
	}
	for _, h := range WindowWriteHypotheses() {
		if rowBitsEqual(h.Write(prev, d, W, kv, p)[:W*d], gpu[:W*d]) {
			m.Name = h.Name
			break
		}
	}
	return m, nil
}

func rowBitsEqual(a, b []float32) bool {
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
