package prodkernel

import (
	"encoding/binary"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// openPTopK opens a dump's committed kernels-ptopk run (vLLM's
// persistent_topk at k = 512) and checks that it ran.
func openPTopK(t *testing.T, dir string) *Run {
	t.Helper()
	p, err := Open(dir, "ptopk")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	const run = "vllm_persistent_topk"
	if !p.Info.Runs[run].OK {
		t.Fatalf("%s did not run: %s", run, p.Info.Runs[run].Error)
	}
	return p
}

// TestPTopKReplay: vLLM's persistent_topk (topk.cu @ cd9078fe, built on the
// H200), run at k = 512 on vLLM's scorer logits of every golden unit, lists
// a top-512 of those logits whose set is the reference's (Tc ≤ 64 < 512:
// every row), as its trivial branch writes it: rows 0..Tc−1 in order, then
// −1. The faulted unit's list (logits of a doubled K scale) is a well-formed
// top-512 of its own logits too.
func TestPTopKReplay(t *testing.T) { forDumps(t, testPTopKReplay) }

func testPTopKReplay(t *testing.T, name string) {
	src, r := openIndexRun(t, name)
	p := openPTopK(t, kernelDir(name))
	n, err := r.Join(p, "."+PTopKName)
	if err != nil {
		t.Fatal(err)
	}
	for _, prefix := range []string{"iscore", "iscore_fault"} {
		units, err := IndexUnits(src, r, prefix)
		if err != nil {
			t.Fatal(err)
		}
		c, err := CheckIndexTopK(src, r, prefix, PTopKName, "vllm_logits", "", 512, units)
		if err != nil {
			t.Fatal(err)
		}
		if !c.Agrees() {
			t.Errorf("%v", c)
		}
		t.Logf("%s: %v", prefix, c)
		for _, u := range units {
			sel, err := r.Ints(fmt.Sprintf("%s.p%d.L%d.%s", prefix, u.Step, u.Layer, PTopKName))
			if err != nil {
				t.Fatal(err)
			}
			for i, v := range sel {
				want := int64(-1)
				if i < u.Tc {
					want = int64(i)
				}
				if v != want {
					t.Errorf("%s p%d L%d (Tc %d): entry %d = %d, the trivial branch writes %d", prefix, u.Step, u.Layer, u.Tc, i, v, want)
					break
				}
			}
		}
		n -= len(units)
	}
	if n != 0 {
		t.Errorf("%d persistent_topk lists of the run were not checked", n)
	}
}

// TestPTopKSynthReplay: persistent_topk on the synthetic units' vLLM logits
// (Tc 520 to 2,048 at width 16,384: histogram_2048_topk) selects the
// reference's set up to boundary ties, and on the logits-only units
// (harness.PTOPK_EXTRA: Tc 12,000 → histogram_256_topk; 40,000 → the
// multi-CTA radix_topk; 5,000 on a 0.25 grid → exact ties at the k-th; a
// 33-row batch → FilteredTopKRaggedTransform) lists a top-512 of its own
// logits, differing from indexer.TopK only in rows exactly tied with the
// k-th logit; 0 false alarms.
func TestPTopKSynthReplay(t *testing.T) {
	dir := filepath.Join("..", "testdata", "kernels", "index-synth")
	r, err := Open(dir, "index-synth")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	p := openPTopK(t, dir)
	if n, err := r.Join(p, "."+PTopKName); err != nil {
		t.Fatal(err)
	} else if n != len(IndexSynthCases)+1+1+1+33 {
		t.Fatalf("joined %d lists, want %d synthetic + 36 logits-only", n, len(IndexSynthCases))
	}
	// The same set as vLLM's top_k_per_row_decode and SGLang's torch top-k
	// chose from the same logits (both committed in kernels-index-synth).
	for _, s := range IndexSynthCases {
		base := "isynth." + s + "."
		a, err := r.Ints(base + PTopKName)
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range []string{"vllm_topk512", "sglang_topk512.raw"} {
			b, err := r.Ints(base + o)
			if err != nil {
				t.Fatal(err)
			}
			if x, y := slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b)); !slices.Equal(x, y) {
				t.Errorf("%s: persistent_topk's set differs from %s's", s, o)
			}
		}
	}
	c, err := CheckIndexSynthTopK(r, PTopKName, "vllm_logits", "")
	if err != nil {
		t.Fatal(err)
	}
	if !c.Agrees() || c.Units != len(IndexSynthCases) {
		t.Errorf("%v", c)
	}
	t.Logf("%v", c)
	x, err := CheckPTopKExtra(p, 512)
	if err != nil {
		t.Fatal(err)
	}
	if !x.Agrees() || x.Units != 36 {
		t.Errorf("%v", x)
	}
	// The 0.25 grid puts several rows on the k-th logit: count them.
	lg, err := p.Floats("ptopk.x2.r0.logits")
	if err != nil {
		t.Fatal(err)
	}
	sel, err := p.Ints("ptopk.x2.r0." + PTopKName)
	if err != nil {
		t.Fatal(err)
	}
	kth := lg.F[sel[0]]
	for _, j := range sel {
		kth = min(kth, lg.F[j])
	}
	tied, tiedIn := 0, 0
	for _, v := range lg.F {
		if v == kth {
			tied++
		}
	}
	for _, j := range sel {
		if lg.F[j] == kth {
			tiedIn++
		}
	}
	if tied <= tiedIn {
		t.Errorf("x2: %d rows at the k-th logit %g, %d selected: no boundary tie exercised", tied, kth, tiedIn)
	}
	t.Logf("%v; x2: %d rows at the k-th logit %g, %d of them selected", x, tied, kth, tiedIn)
}

// TestPTopKDroppedRow: in the list of ptopk.x0.r0 (Tc 12,000,
// histogram_256_topk) the selected row of the highest logit (neighbours
// unselected) is replaced by the unselected row of the lowest: exactly that
// unit fails, "not a top-512 of the kernel's own scores", naming both rows.
func TestPTopKDroppedRow(t *testing.T) {
	p := openPTopK(t, filepath.Join("..", "testdata", "kernels", "index-synth"))
	const unit = "ptopk.x0.r0"
	lg, err := p.Floats(unit + ".logits")
	if err != nil {
		t.Fatal(err)
	}
	sel, err := p.Ints(unit + "." + PTopKName)
	if err != nil {
		t.Fatal(err)
	}
	tc := len(lg.F)
	in := make([]bool, tc)
	for _, j := range sel {
		in[j] = true
	}
	at, u := -1, -1
	for i, j := range sel {
		if (j == 0 || !in[j-1]) && (j+1 == int64(tc) || !in[j+1]) && (at < 0 || lg.F[j] > lg.F[sel[at]]) {
			at = i
		}
	}
	for j := range tc {
		if !in[j] && (u < 0 || lg.F[j] < lg.F[u]) {
			u = j
		}
	}
	if at < 0 || u < 0 || u == int(sel[at])+1 || u == int(sel[at])-1 {
		t.Fatalf("no entry to replace (at %d, row %d)", at, u)
	}
	m := sel[at]
	if err := p.Patch(unit+"."+PTopKName, func(d []byte) { binary.LittleEndian.PutUint32(d[4*at:], uint32(u)) }); err != nil {
		t.Fatal(err)
	}
	c, err := CheckPTopKExtra(p, 512)
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("%s: not a top-512 of the kernel's own scores: unselected row %d scores %g above selected row %d (%g)", unit, m, lg.F[m], u, lg.F[u])
	if c.Agree != c.Units-1 || len(c.First) != 1 || c.First[0] != want {
		t.Fatalf("%v\nwant exactly one mismatch %q", c, want)
	}
	t.Logf("%v", c)
}

// TestRunJoinTwice: a name joined twice is an error naming it, not a silent
// replacement of the first list.
func TestRunJoinTwice(t *testing.T) {
	_, r := openIndexRun(t, "official-v4-tiny")
	p := openPTopK(t, kernelDir("official-v4-tiny"))
	if n, err := r.Join(p, "."+PTopKName); err != nil || n != 11 {
		t.Fatalf("first join: %d, %v; want 11 lists", n, err)
	}
	if _, err := r.Join(p, "."+PTopKName); err == nil || !strings.Contains(err.Error(), "iscore.p3.L1.vllm_ptopk512 is in both") {
		t.Fatalf("second join: %v, want iscore.p3.L1.vllm_ptopk512 named", err)
	}
}
