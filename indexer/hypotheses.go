package indexer

import (
	"fmt"
	"math"

	"sparsemla/attention"
	"sparsemla/quant"
)

// Hypotheses: indexer stages computed the way serving engines compute them
// (spec §8.3, §9.11), from the same inputs as the reference stage functions.
// A replay runs them on the dumped inputs of a diverging stage to name what
// the GPU did. None of them is the reference.

// QueryNoHad is iq_had without the Hadamard rotation: dst = roped (vLLM's
// indexer quantises the roped query directly, §8.3). dst, roped [H_I, 128].
func (ix *Indexer) QueryNoHad(dst, roped []float32) {
	ix.checkHeads(dst)
	ix.checkHeads(roped)
	copy(dst, roped)
}

// QueryNoFQ4 is iq without the FP4 fake quantisation: dst = had (an engine
// that keeps the indexer query in bf16).
func (ix *Indexer) QueryNoFQ4(dst, had []float32) {
	ix.checkHeads(dst)
	ix.checkHeads(had)
	copy(dst, had)
}

// QueryFP8 is iq with an FP8 fake quantisation in place of FQ4: per head (one
// block of 128), s = 2^BlockScaleExp(rule, amax, 448, floor),
// dst = bf16(E4M3(clamp(had/s, ±448))·s) (SGLang's CUDA path: Had then FP8
// act_quant, rule ceil2; vLLM's FP8 indexer: one power-of-two scale per
// 128-dim vector, rule log2ceil).
func (ix *Indexer) QueryFP8(dst, had []float32, rule quant.ScaleRule, floor float32) {
	ix.checkHeads(dst)
	ix.checkHeads(had)
	copy(dst, had)
	quant.FQ8Rule(dst, ix.HeadDim, rule, floor)
}

// QueryFP4Rule is iq with the FP4 block scale picked by rule and floor in
// place of ceil2 and 6·2^-126 (e.g. ScaleRoundLog2, SGLang's MXFP4 codec,
// §8.4): per 32-block, s = 2^BlockScaleExp(rule, amax, 6, floor),
// dst = E2M1(clamp(had/s, ±6))·s.
func (ix *Indexer) QueryFP4Rule(dst, had []float32, rule quant.ScaleRule, floor float32) {
	ix.checkHeads(dst)
	ix.checkHeads(had)
	packed := make([]uint8, len(had)/2)
	scales := make([]uint8, len(had)/32)
	quant.QuantizeFP4(packed, scales, had, 32, rule, floor)
	quant.DequantizeFP4(dst, packed, scales, 32)
}

// IndexQKF32 is index_qk without the bf16 rounding of each dot product:
// qk[h][j] = Σ_k iq[h][k]·icache[j][k] in fp32, k ascending (a fused
// scorer's fp32 logits). Shapes as IndexQK.
func IndexQKF32(qk, iq, icache []float32, heads, headDim int) {
	if headDim <= 0 || len(iq) != heads*headDim || len(icache)%headDim != 0 {
		panic("indexer: IndexQKF32 shape mismatch")
	}
	tc := len(icache) / headDim
	if len(qk) != heads*tc {
		panic("indexer: IndexQKF32 output length is not heads·Tc")
	}
	for h := 0; h < heads; h++ {
		attention.F32Linear(qk[h*tc:(h+1)*tc], iq[h*headDim:(h+1)*headDim], icache, tc, headDim)
	}
}

// IndexScoreNoProductRound is index_score with the ReLU·weight products
// kept in fp32 (the head sum of an fp32 einsum):
// score[j] = bf16(Σ_h max(qk[h][j], 0)·w[h]). Spec §14: the GPU rounds the
// products (with this form only ~75 % of the golden's scores match).
func IndexScoreNoProductRound(score, qk, w []float32) {
	indexScoreForm(score, qk, w, false, true)
}

// IndexScoreF32 is the fp32 scorer: no rounding anywhere,
// score[j] = Σ_h max(qk[h][j], 0)·w[h] in fp32 (DeepGEMM-style fp32 logits
// consumed by top-k without a bf16 cast).
func IndexScoreF32(score, qk, w []float32) {
	indexScoreForm(score, qk, w, false, false)
}

func indexScoreForm(score, qk, w []float32, roundProducts, roundSum bool) {
	heads := len(w)
	if heads == 0 || len(qk) != heads*len(score) {
		panic("indexer: index score hypothesis shape mismatch")
	}
	tc := len(score)
	for j := 0; j < tc; j++ {
		var sum float32
		for h := 0; h < heads; h++ {
			p := float32(max(qk[h*tc+j], 0) * w[h])
			if roundProducts {
				p = quant.BF16Round(p)
			}
			sum += p
		}
		if roundSum {
			sum = quant.BF16Round(sum)
		}
		score[j] = sum
	}
}

// RowScore is one compressed row of a selection comparison with its score
// under the reference and under the GPU (NaN when the GPU's scores were not
// given).
type RowScore struct {
	Row      int64
	Ref, GPU float32
}

// RefSelection is the GPU's selection judged against the reference's own
// scores recomputed from the dumped indexer inputs (iq, icache, iw), beside
// the usual judgement against the GPU's dumped scores: it catches a GPU whose
// scores are computed differently (no Hadamard, no FQ4, another scorer) and
// whose selection is consistent with its own wrong scores.
type RefSelection struct {
	Scores  []float32     // reference index_score from the dumped iq, icache, iw
	Diff    SelectionDiff // CompareSelection(gpu, Scores, k): tie-aware
	Missing []RowScore    // rows the reference selects that the GPU did not (Diff.Missing, ascending)
	Extra   []RowScore    // rows the GPU selected that the reference would not (Diff.Extra, ascending)
	// ScoreRows counts rows whose GPU score differs from the reference
	// score in bits (0 when the GPU's scores were not given); FirstRow is
	// the first of them (-1 when none).
	ScoreRows int
	FirstRow  int64
}

// CheckSelectionRef recomputes index_score with the reference (IndexQK,
// IndexScore) from the dumped iq [heads, headDim], icache [Tc, headDim] and
// iw [heads], and compares the GPU's selection gpu (rows, any order) with
// the reference top-k k over those scores, tie-aware (CompareSelection).
// gpuScores (len Tc, or nil) are the GPU's dumped scores, reported beside.
func CheckSelectionRef(gpu []int64, gpuScores, iq, icache, iw []float32, heads, headDim, k int) RefSelection {
	tc := len(icache) / headDim
	qk := make([]float32, heads*tc)
	IndexQK(qk, iq, icache, heads, headDim)
	sc := make([]float32, tc)
	IndexScore(sc, qk, iw)
	return JudgeSelectionRef(gpu, gpuScores, sc, k)
}

// JudgeSelectionRef is CheckSelectionRef with the reference's scores sc
// already computed (a propagated replay's own chain): the GPU's selection
// gpu compared with TopK(sc, k), tie-aware, with the rows and both scores.
func JudgeSelectionRef(gpu []int64, gpuScores, sc []float32, k int) RefSelection {
	tc := len(sc)
	r := RefSelection{Scores: sc, Diff: CompareSelection(gpu, sc, k), FirstRow: -1}
	gpuAt := func(j int64) float32 {
		if gpuScores == nil || j < 0 || j >= int64(len(gpuScores)) {
			return float32(math.NaN())
		}
		return gpuScores[j]
	}
	for _, j := range r.Diff.Missing {
		r.Missing = append(r.Missing, RowScore{j, sc[j], gpuAt(j)})
	}
	for _, j := range r.Diff.Extra {
		ref := float32(math.NaN())
		if j >= 0 && j < int64(tc) {
			ref = sc[j]
		}
		r.Extra = append(r.Extra, RowScore{j, ref, gpuAt(j)})
	}
	if len(gpuScores) == tc {
		for j := range sc {
			if math.Float32bits(sc[j]) != math.Float32bits(gpuScores[j]) {
				if r.ScoreRows == 0 {
					r.FirstRow = int64(j)
				}
				r.ScoreRows++
			}
		}
	}
	return r
}

// String says in one line what the reference would select instead, every
// number of a row from that row.
func (r RefSelection) String() string {
	if r.Diff.Verdict != Diverged {
		return fmt.Sprintf("the reference's scores select the same rows (%s)", r.Diff.Verdict)
	}
	s := fmt.Sprintf("with the reference's scores from the dumped iq, icache and iw, the top-%d would be other rows: %s", r.Diff.Ties.K, r.Diff.Reason)
	if len(r.Missing) > 0 {
		s += "; the reference selects " + rowScores(r.Missing, 4)
	}
	if len(r.Extra) > 0 {
		s += "; the GPU selected instead " + rowScores(r.Extra, 4)
	}
	return s
}

func rowScores(rs []RowScore, n int) string {
	out := ""
	for i, x := range rs {
		if i == n {
			out += fmt.Sprintf(" … (%d more)", len(rs)-n)
			break
		}
		if i > 0 {
			out += ", "
		}
		if x.GPU != x.GPU {
			out += fmt.Sprintf("row %d (reference score %g)", x.Row, x.Ref)
		} else {
			out += fmt.Sprintf("row %d (reference score %g, GPU score %g)", x.Row, x.Ref, x.GPU)
		}
	}
	return out
}
