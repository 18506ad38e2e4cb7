package indexer

import (
	"math"
	"slices"

	"sparsemla/attention"
	"sparsemla/quant"
)

// V41Indexer is the indexer of one V4.1 index-source layer (V41-M `Indexer`,
// spec §11 items 5-7). Differences from V4's Indexer: no Hadamard anywhere,
// no compressor of its own — the index keys come from the KV-source layer's
// pre-RoPE latent (`k = k_norm(wk(latent))`, only on KV-source layers,
// OwnsK) — FP8 linears with 32×32 blocks, a candidate-block first level
// at the candidate-source layer, and the selection re-sorted by position.
type V41Indexer struct {
	NHeads  int // index_n_heads H_I: 32 (V4.1-Flash)
	HeadDim int // index_head_dim: 128
	TopK    int // index_topk: 512

	WqB         *attention.V41FP8Weight // indexer.wq_b [H_I·128, q_lora_rank]
	WeightsProj []float32               // indexer.weights_proj.weight [H_I, dim], bf16 values
	// OwnsK: the layer is also a KV source, so it derives index keys from its
	// latent (indexer.wk, indexer.k_norm); otherwise both are nil.
	OwnsK bool
	Wk    []float32 // indexer.wk.weight [128, head_dim], bf16 values
	KNorm []float32 // indexer.k_norm.weight [128], fp32
	Eps   float32   // rms_norm_eps
}

func (ix *V41Indexer) dim() int { return len(ix.WeightsProj) / ix.NHeads }

// QueryB is iq_b = FP8Lin(indexer.wq_b, cq), bf16 [H_I, 128] (32×32 blocks).
func (ix *V41Indexer) QueryB(dst, cq []float32) {
	if len(dst) != ix.NHeads*ix.HeadDim {
		panic("indexer: V41 query length is not heads·head_dim")
	}
	attention.V41FP8Linear(dst, cq, ix.WqB)
}

// Query is iq = FQ4(RoPE(iq_b[h][64:], p), 32) per head: RoPE at the token's
// position, then FP4 with UE8M0 scales per 32 dims. No Hadamard (V4 rotates
// first). roped receives the RoPE output (iq_roped), dst the quantised query.
func (ix *V41Indexer) Query(dst, roped, iqB []float32, pos int64, rope *attention.RopeTable) {
	copy(roped, iqB)
	rope.RopeLast(roped, ix.HeadDim, pos, false)
	copy(dst, roped)
	quant.FQ4(dst, 32)
}

// KeyRaw is the index key before RoPE (iknorm):
// k = RMSNorm_knorm( BF16Lin(indexer.wk, latent) ), bf16 [128], from the
// KV source's pre-RoPE latent [head_dim]: KeyLinear, then KeyNorm.
func (ix *V41Indexer) KeyRaw(dst, latent []float32) {
	raw := make([]float32, ix.HeadDim)
	ix.KeyLinear(raw, latent)
	ix.KeyNorm(dst, raw)
}

// KeyLinear is the index key's projection (model.py's ik_raw =
// indexer.wk(latent)): BF16Lin(indexer.wk, latent), bf16 [128].
func (ix *V41Indexer) KeyLinear(dst, latent []float32) {
	if !ix.OwnsK {
		panic("indexer: V41 KeyLinear on a layer that owns no index keys")
	}
	attention.BF16Linear(dst, latent, ix.Wk, ix.HeadDim, len(latent))
}

// KeyNorm is the index key's norm: RMSNorm(raw) ⊙ indexer.k_norm, bf16
// [128]. dst may alias raw.
func (ix *V41Indexer) KeyNorm(dst, raw []float32) {
	if !ix.OwnsK {
		panic("indexer: V41 KeyNorm on a layer that owns no index keys")
	}
	attention.RMSNorm(dst, raw, ix.KNorm, ix.Eps)
}

// Key finishes index key j: RoPE of the last 64 dims at j·r, then FQ4(·, 32)
// over all 128 dims (UE8M0 scales). dst may alias kraw.
func (ix *V41Indexer) Key(dst, kraw []float32, j int64, r int, rope *attention.RopeTable) {
	copy(dst, kraw)
	rope.ApplyRope(dst[ix.HeadDim-attention.RopeDims:], j*int64(r), false)
	quant.FQ4(dst, 32)
}

// WeightScale is f32(head_dim^-0.5 · H_I^-0.5): 1/64 for 32 heads × 128.
func (ix *V41Indexer) WeightScale() float32 {
	return float32(math.Pow(float64(ix.HeadDim), -0.5) * math.Pow(float64(ix.NHeads), -0.5))
}

// Weights is iw = bf16( bf16(weights_proj · x) · WeightScale() ) [H_I]; raw
// receives iw_raw.
func (ix *V41Indexer) Weights(dst, raw, x []float32) {
	attention.BF16Linear(raw, x, ix.WeightsProj, ix.NHeads, ix.dim())
	s := ix.WeightScale()
	for h, v := range raw {
		dst[h] = quant.BF16Round(v * s)
	}
}

// SelectCandidateBlocks is level one of V4.1's two-level top-k
// (select_candidate_blocks, at the candidate-source layer) at decode, where
// every one of the Tc = len(scores) rows is reachable:
//
//	block b = rows b·B … b·B+B−1 (the last one padded with −∞)
//	score_b = max over its rows;  the block of the newest row (Tc−1) div B → +∞
//	keep the top min(topkBlocks, nblocks) blocks whose score is > −∞
//
// It returns the row mask [Tc]. Tie order among equal block scores: larger
// first, then lower block index (torch.topk leaves it unspecified, [U]).
func SelectCandidateBlocks(scores []float32, topkBlocks, blockSize int) []bool {
	tc := len(scores)
	nb := (tc + blockSize - 1) / blockSize
	bs := make([]float32, nb)
	for b := range bs {
		bs[b] = float32(math.Inf(-1))
		for j := b * blockSize; j < min(tc, (b+1)*blockSize); j++ {
			if scores[j] > bs[b] || scores[j] != scores[j] {
				bs[b] = scores[j]
			}
		}
	}
	if tc > 0 {
		bs[(tc-1)/blockSize] = float32(math.Inf(1))
	}
	top, _ := TopK(bs, min(topkBlocks, nb))
	mask := make([]bool, tc)
	for _, b := range top {
		if bs[b] > float32(math.Inf(-1)) || bs[b] != bs[b] {
			for j := int(b) * blockSize; j < min(tc, (int(b)+1)*blockSize); j++ {
				mask[j] = true
			}
		}
	}
	return mask
}

// MaskScores is level two at a later index source: scores outside the
// candidate mask become −∞ (`index_score.masked_fill(~candidates, -inf)`).
// mask must cover the scores (the candidate source saw the same Tc rows).
func MaskScores(dst, scores []float32, mask []bool) {
	for j, s := range scores {
		if mask[j] {
			dst[j] = s
		} else {
			dst[j] = float32(math.Inf(-1))
		}
	}
}

// V41Select is V4.1's final selection: the top min(index_topk, Tc) rows by score
// (TopK's rule: larger score, then lower row), re-sorted ascending by row;
// rows ≥ compressLen become −1 (none at decode, where every row of the score
// vector is reachable), the rest are offset by offset (the window length):
// `topk(…).indices.sort()` then `where(idxs < compress_lens, idxs + offset, -1)`.
func V41Select(scores []float32, k, compressLen, offset int) ([]int32, TieReport) {
	sel, rep := TopK(scores, k)
	s := slices.Clone(sel)
	slices.Sort(s)
	out := make([]int32, len(s))
	for i, j := range s {
		if int(j) < compressLen {
			out[i] = int32(int(j) + offset)
		} else {
			out[i] = -1
		}
	}
	return out, rep
}
