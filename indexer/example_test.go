package indexer_test

import (
	"fmt"

	"sparsemla/indexer"
)

// Select the top 3 of 7 compressed rows, then judge two GPU selections: one that
// picked another member of the tie at the k-th score, one that did not.
func ExampleCompareSelection() {
	scores := []float32{1, 3, 2, 3, 2, 0, 2} // index_score [Tc = 7]
	sel, ties := indexer.TopK(scores, 3)
	fmt.Println("reference:", sel, ties)

	for _, gpu := range [][]int64{{3, 1, 6}, {3, 1, 0}} {
		d := indexer.CompareSelection(gpu, scores, 3)
		fmt.Printf("gpu %v: %s recall=%.2f jaccard=%.2f\n", gpu, d.Verdict, d.Recall, d.Jaccard)
		if d.Reason != "" {
			fmt.Println("  ", d.Reason)
		}
	}
	// Output:
	// reference: [1 3 2] k=3 kth=2 tied=3 selected=1 boundary=true
	// gpu [3 1 6]: tie recall=0.67 jaccard=0.50
	// gpu [3 1 0]: diverged recall=0.67 jaccard=0.50
	//    GPU selected row 0 (score 1), below the k-th score 2
}

// The score of one compressed row: Σ_h bf16(ReLU(q_h·k)·w_h), here with two heads
// whose dot products are 1 and −2 (the second is cut by the ReLU).
func ExampleIndexScore() {
	qk := []float32{1, -2} // index_qk [heads = 2, Tc = 1]
	w := []float32{0.75, 5}
	score := make([]float32, 1)
	indexer.IndexScore(score, qk, w)
	fmt.Println(score[0])
	// Output: 0.75
}
