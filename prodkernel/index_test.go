package prodkernel

import (
	"encoding/binary"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"sparsemla/replay"
)

// openIndexRun opens the golden and its committed kernels-index run.
func openIndexRun(t *testing.T, name string) (*replay.DumpSource, *Run) {
	t.Helper()
	_, src := openGolden(t, name)
	r, err := Open(kernelDir(name), "index")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	const run = "sglang_fp8_paged_mqa_logits_torch"
	if !r.Info.Runs[run].OK {
		t.Fatalf("%s did not run: %s", run, r.Info.Runs[run].Error)
	}
	return src, r
}

// indexScorers are the scoring kernels of kernels-index and the value each
// leaves at positions ≥ Tc.
var indexScorers = []struct {
	name string
	fill float32
}{
	{"sglang_logits", 0},                   // SGLang masked_fill(~valid, 0.0)
	{"vllm_logits", float32(math.Inf(-1))}, // vLLM torch.full(-inf)
}

// TestIndexScoresReplay: SGLang's and vLLM's torch scorers, fed the
// reference's own q, keys and weights (exactly, in E4M3 with power-of-two
// scales), give every compressed row's score within IndexScoreTol of the
// reference's index_score, at every unit of both goldens, and equal the
// fp32-scorer form (indexer.IndexScoreF32) bit for bit.
func TestIndexScoresReplay(t *testing.T) { forDumps(t, testIndexScoresReplay) }

func testIndexScoresReplay(t *testing.T, name string) {
	src, r := openIndexRun(t, name)
	units, err := IndexUnits(src, r, "iscore")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range indexScorers {
		c, err := CheckIndexScores(src, r, "iscore", k.name, k.fill, units)
		if err != nil {
			t.Fatal(err)
		}
		if !c.Agrees() {
			t.Errorf("%v", c)
		}
		// The named difference behind the tolerance: both scorers compute the
		// fp32 form, which indexer.IndexScoreF32 reproduces bit for bit.
		if c.F32Exact != c.Rows {
			t.Errorf("fp32 form reproduces %d of %d scores: %v", c.F32Exact, c.Rows, c)
		}
		t.Logf("%v", c)
	}
}

// indexTopKs are the top-k outputs of kernels-index: the list, the logits
// it selected from, SGLang's page-index output.
func indexTopKs(k int) []struct{ name, scores, pages string } {
	return []struct{ name, scores, pages string }{
		{fmt.Sprintf("sglang_topk%d.raw", k), "sglang_logits", fmt.Sprintf("sglang_topk%d.pages", k)},
		{fmt.Sprintf("vllm_topk%d", k), "vllm_logits", ""},
	}
}

// TestIndexTopKReplay: SGLang's torch top-k and vLLM's CUDA
// top_k_per_row_decode select, at k = index_topk (16) and at 512, a top-k of
// their own logits whose set is the reference's up to boundary ties (spec
// §9.6), with SGLang's page indices right; 0 false alarms. gpu-v4-tiny-long
// step 126 layer 3 (six rows tied at score 0 for the last three places) is
// one such tie: the two engines keep different rows there.
func TestIndexTopKReplay(t *testing.T) { forDumps(t, testIndexTopKReplay) }

func testIndexTopKReplay(t *testing.T, name string) {
	src, r := openIndexRun(t, name)
	units, err := IndexUnits(src, r, "iscore")
	if err != nil {
		t.Fatal(err)
	}
	ties := 0
	for _, k := range []int{16, 512} {
		for _, tk := range indexTopKs(k) {
			c, err := CheckIndexTopK(src, r, "iscore", tk.name, tk.scores, tk.pages, k, units)
			if err != nil {
				t.Fatal(err)
			}
			if !c.Agrees() {
				t.Errorf("%v", c)
			}
			ties += c.TieSwap
			t.Logf("%v", c)
		}
	}
	if name == "gpu-v4-tiny-long" && ties == 0 {
		t.Errorf("no unit differed from the reference by a boundary tie; step 126 layer 3 did on the H200")
	}
}

// TestIndexScoreScaleFault: the faulted call (the K scale of one row, row 32
// of step 256 layer 3, doubled in its page) is found exactly: one row outside
// tolerance, named with its ×2 ratio (the faulted call's own inputs are not
// stored: the clean unit's are checked by TestIndexScoresReplay).
func TestIndexScoreScaleFault(t *testing.T) {
	src, r := openIndexRun(t, "gpu-v4-tiny-long")
	units, err := IndexUnits(src, r, "iscore_fault")
	if err != nil {
		t.Fatal(err)
	}
	if len(units) != 1 || units[0].Step != 256 || units[0].Layer != 3 {
		t.Fatalf("fault units %v, want step 256 layer 3", units)
	}
	c, err := CheckIndexScores(src, r, "iscore_fault", "sglang_logits", 0, units)
	if err != nil {
		t.Fatal(err)
	}
	want := "p256 L3 row 32: kernel score"
	if c.Rows-c.Within != 1 || len(c.First) != 1 || !strings.HasPrefix(c.First[0], want) || !strings.Contains(c.First[0], "scaled by 2^1") {
		t.Fatalf("%v\nwant exactly one mismatch %q … scaled by 2^1", c, want)
	}
	t.Logf("%v", c)
}

// TestIndexTopKOffByOne: one entry of SGLang's top-16 list moved to the next
// row (an off-by-one in the kernel's output) is named exactly: that unit, the
// two rows, "off by one"; every other unit still agrees.
func TestIndexTopKOffByOne(t *testing.T) {
	src, r := openIndexRun(t, "gpu-v4-tiny-long")
	units, err := IndexUnits(src, r, "iscore")
	if err != nil {
		t.Fatal(err)
	}
	const p, l = 255, 1
	base := fmt.Sprintf("iscore.p%d.L%d.", p, l)
	sel, err := r.Ints(base + "sglang_topk16.raw")
	if err != nil {
		t.Fatal(err)
	}
	lg, err := r.Floats(base + "sglang_logits")
	if err != nil {
		t.Fatal(err)
	}
	in := map[int64]bool{}
	for _, v := range sel {
		in[v] = true
	}
	// The first entry whose next row is unselected and scores strictly lower.
	at := -1
	for i, v := range sel {
		if v+1 < 64 && !in[v+1] && lg.F[v+1] < lg.F[v] {
			at = i
			break
		}
	}
	if at < 0 {
		t.Fatal("no entry to move")
	}
	moved := sel[at]
	for _, name := range []string{"sglang_topk16.raw", "sglang_topk16.pages"} {
		if err := r.Patch(base+name, func(d []byte) {
			binary.LittleEndian.PutUint32(d[4*at:], binary.LittleEndian.Uint32(d[4*at:])+1)
		}); err != nil {
			t.Fatal(err)
		}
	}
	c, err := CheckIndexTopK(src, r, "iscore", "sglang_topk16.raw", "sglang_logits", "sglang_topk16.pages", 16, units)
	if err != nil {
		t.Fatal(err)
	}
	// The kernel's lowest selected row is now moved+1 unless another selected
	// row scores lower still; the message names the pair it found.
	want := fmt.Sprintf("p%d L%d: not a top-16 of the kernel's own scores: unselected row %d", p, l, moved)
	if c.Agree != c.Units-1 || len(c.First) != 1 || !strings.HasPrefix(c.First[0], want) ||
		!strings.Contains(c.First[0], fmt.Sprintf("off by one (row %d listed in place of row %d)", moved+1, moved)) {
		t.Fatalf("%v\nwant exactly one mismatch %q … off by one", c, want)
	}
	t.Logf("%v", c)
}

// TestIndexScoreTolBound: the tolerance is the stated formula (a hand-worked
// unit: two heads, one row) and a reference perturbed past it fails.
func TestIndexScoreTolBound(t *testing.T) {
	// S = |0.5|·3 + |−2|·max(−1, 0) = 1.5; tol = 2^-8·(1+2^-7)·1.5 + 2^-8·1.5 + 2^-20·1.5
	tol := IndexScoreTol([]float32{3, -1}, []float32{0.5, -2}, []float32{1.5})
	want := 0x1p-8*(1+0x1p-7)*1.5 + 0x1p-8*1.5 + 0x1p-20*1.5
	if len(tol) != 1 || tol[0] != want {
		t.Fatalf("tol %v, want [%g]", tol, want)
	}
	if h := scaleHint(3, 1.5); !strings.Contains(h, "2^1") {
		t.Errorf("scaleHint(3, 1.5) = %q", h)
	}
	if h := scaleHint(1.51, 1.5); h != "" {
		t.Errorf("scaleHint(1.51, 1.5) = %q, want none", h)
	}
}

// TestIndexSynthReplay: at V4-Flash indexer dims (64 heads × 128, Tc 520 to
// 2,048, k = 512; kernels-index-synth) both scorers' logits are within
// IndexScoreTol of the reference's bf16 index_score recomputed from the fed
// inputs, equal the fp32-scorer form up to summation order, and both top-k's (SGLang's
// torch top-k, vLLM's radix-sort path at 16,384 columns) select the
// reference's set up to boundary ties.
func TestIndexSynthReplay(t *testing.T) {
	r, err := Open(filepath.Join("..", "testdata", "kernels", "index-synth"), "index-synth")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	for _, k := range indexScorers {
		c, err := CheckIndexSynthScores(r, k.name, k.fill)
		if err != nil {
			t.Fatal(err)
		}
		if !c.Agrees() || c.Rows != 520+1000+2048+2048 {
			t.Errorf("%v", c)
		}
		// Over 64 heads the fp32 form differs from torch's in summation
		// order only: a few fp32 ulps of the magnitude summed.
		if c.F32Rel > 1e-5 {
			t.Errorf("fp32 form differs by %.3g of S: %v", c.F32Rel, c)
		}
		t.Logf("%v", c)
	}
	for _, tk := range indexTopKs(512) {
		c, err := CheckIndexSynthTopK(r, tk.name, tk.scores, tk.pages)
		if err != nil {
			t.Fatal(err)
		}
		if !c.Agrees() {
			t.Errorf("%v", c)
		}
		t.Logf("%v", c)
	}
}
