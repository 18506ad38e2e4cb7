package indexer

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"sparsemla/attention"
)

// officialDir holds runs of the official model.py Compressor on an H200 that
// the official-v4-tiny golden does not reach (README.md there says how they were
// made): prefill hand-offs with S ≥ r, ratio-128 rows, and torch.topk on
// tie-heavy scores.
const officialDir = "testdata/official-compressor"

// TestOfficialCompressorRuns replays the official Compressor's prefill + decode
// runs from the GPU's own projections (a, b) and compares, per scenario:
//   - the state after the prefill (§2.4 hand-off): bit-exact, all rows;
//   - every pooled row (prefill and decode emissions, bf16 before the norm):
//     ≤ 1 bf16 ulp (the GPU sums the softmax pooling in another order);
//   - every emitted row: ≤ 1 bf16 ulp, and bit-exact where the pooled row was;
//   - the state after the last step: bit-exact, all rows.
//
// It also reports how far the reference's fp32 projections from x are from
// the GPU's (relative to Σ|w·x|), for the ratio-128 compressor too.
func TestOfficialCompressorRuns(t *testing.T) {
	dir, cfg := openGolden(t)
	path := filepath.Join(officialDir, "compressor.safetensors")
	if _, err := os.Stat(path); err != nil {
		t.Skipf("%s absent: %v", path, err)
	}
	f := openST(t, ".", path)
	w := openST(t, dir, "weights.safetensors")
	cis, shape, err := openST(t, dir, "rope_tables.safetensors").Float32("freqs_cis_cmp")
	if err != nil {
		t.Fatal(err)
	}
	rope := attention.RopeTableFromCis(cis, shape[0], "gpu freqs_cis_cmp")
	x := mustF32(t, f, "x")

	for _, sc := range []struct {
		name   string
		layer  int
		prefix string
		d      int
		rotate bool
		S      []int
		n      int
	}{
		{"main4", 1, "layers.1.attn.compressor.", 512, false, []int{2, 10}, 20},
		{"idx4", 1, "layers.1.attn.indexer.compressor.", 128, true, []int{2, 10}, 20},
		{"main128", 2, "layers.2.attn.compressor.", 512, false, []int{2, 130}, 260},
	} {
		c := &attention.Compressor{Ratio: cfg.CompressRatios[sc.layer], HeadDim: sc.d, Dim: cfg.Dim, Rotate: sc.rotate, Eps: cfg.NormEps,
			Wkv: mustF32(t, w, sc.prefix+"wkv.weight"), Wgate: mustF32(t, w, sc.prefix+"wgate.weight"),
			Ape: mustF32(t, w, sc.prefix+"ape"), Norm: mustF32(t, w, sc.prefix+"norm.weight")}
		wd := c.Width()
		for _, S := range sc.S {
			key := fmt.Sprintf("%s.S%d.", sc.name, S)
			get := func(n string) []float32 { return mustF32(t, f, key+n) }
			pa, pb := get("prefill_a"), get("prefill_b")
			da, db := get("decode_a"), get("decode_b")

			// Projections from x against the GPU's.
			var maxRel float64
			exact, total := 0, 0
			ga, gb := make([]float32, wd), make([]float32, wd)
			for p := 0; p < sc.n; p++ {
				var wa, wb []float32
				if p < S {
					wa, wb = pa[p*wd:(p+1)*wd], pb[p*wd:(p+1)*wd]
				} else {
					wa, wb = da[(p-S)*wd:(p-S+1)*wd], db[(p-S)*wd:(p-S+1)*wd]
				}
				xp := x[p*cfg.Dim : (p+1)*cfg.Dim]
				c.Project(ga, gb, xp)
				for _, pair := range []struct{ got, want, W []float32 }{{ga, wa, c.Wkv}, {gb, wb, c.Wgate}} {
					for n := range pair.got {
						total++
						if pair.got[n] == pair.want[n] {
							exact++
							continue
						}
						var mag float64
						for k, xk := range xp {
							mag += math.Abs(float64(pair.W[n*cfg.Dim+k]) * float64(xk))
						}
						maxRel = max(maxRel, math.Abs(float64(pair.got[n])-float64(pair.want[n]))/mag)
					}
				}
			}
			if lim := float64(cfg.Dim) * 0x1p-24; maxRel > lim {
				t.Errorf("%sa/b: relative error %.3g exceeds dim·2^-24 = %.3g", key, maxRel, lim)
			}

			// Prefill hand-off from the GPU's projections.
			st, rows := c.Prefill(pa, pb, S, rope)
			sameState(t, key+"prefill", st, get("prefill_kv_state"), get("prefill_score_state"))
			for p := S; p < sc.n; p++ {
				s := c.StepFrom(st, da[(p-S)*wd:(p-S+1)*wd], db[(p-S)*wd:(p-S+1)*wd], int64(p), rope)
				if s.Emitted {
					rows = append(rows, s)
				}
			}
			sameState(t, key+"final", st, get("kv_state"), get("score_state"))

			pooled, out := get("pooled"), get("rows")
			if len(rows)*sc.d != len(pooled) || len(rows)*sc.d != len(out) {
				t.Fatalf("%s: %d rows, the GPU emitted %d", key, len(rows), len(out)/sc.d)
			}
			var ps, rs stageStat
			for j, s := range rows {
				ps.bf16(t, s.Pooled, pooled[j*sc.d:(j+1)*sc.d])
				rs.bf16(t, s.Out, out[j*sc.d:(j+1)*sc.d])
			}
			t.Logf("%-14s rows=%d a/b exact=%.4f maxRel=%.3g | pooled %v | row %v", key, len(rows), float64(exact)/float64(total), maxRel, &ps, &rs)
			if ps.maxULP > 1 || rs.maxULP > 1 {
				t.Errorf("%s: pooled %d ulps, rows %d ulps; tolerance 1", key, ps.maxULP, rs.maxULP)
			}
			if ps.same == ps.n && rs.same != rs.n {
				t.Errorf("%s: pooled rows are exact but %d row values differ", key, rs.n-rs.same)
			}
		}
	}
}

// sameState compares a reference state with the official one, every row, bit for bit.
func sameState(t *testing.T, what string, st *attention.CompressorState, kv, score []float32) {
	t.Helper()
	if len(kv) != len(st.KV) || len(score) != len(st.Score) {
		t.Fatalf("%s: state sizes %d/%d, official %d/%d", what, len(st.KV), len(st.Score), len(kv), len(score))
	}
	for i := range kv {
		if math.Float32bits(kv[i]) != math.Float32bits(st.KV[i]) || math.Float32bits(score[i]) != math.Float32bits(st.Score[i]) {
			t.Fatalf("%s: state element %d: kv %v score %v, official %v %v", what, i, st.KV[i], st.Score[i], kv[i], score[i])
		}
	}
}

// TestOfficialTopKTies checks CompareSelection on what torch.topk on CUDA really
// returns, for score rows on a coarse bf16 grid (many exact ties, most of them
// zeros as after the ReLU): Tc = 64 with k = 16 (the tiny golden's index_topk),
// Tc = 1024 and 16384 with k = 512 (V4-Flash at contexts 4K and 64K). Every GPU
// selection must compare as Same or Tie, never Diverged, and the data must hold
// boundary ties (a tie at the k-th score cut by the selection).
func TestOfficialTopKTies(t *testing.T) {
	path := filepath.Join(officialDir, "topk.safetensors")
	if _, err := os.Stat(path); err != nil {
		t.Skipf("%s absent: %v", path, err)
	}
	f := openST(t, ".", path)
	for _, tcs := range []int{64, 1024, 16384} {
		scores, shape, err := f.Float32(fmt.Sprintf("scores_%d", tcs))
		if err != nil {
			t.Fatal(err)
		}
		topk, kshape, err := f.Int64(fmt.Sprintf("topk_%d", tcs))
		if err != nil {
			t.Fatal(err)
		}
		rows, tc, k := shape[0], shape[1], kshape[1]
		counts := map[Verdict]int{}
		boundary, order := 0, 0
		for i := 0; i < rows; i++ {
			sc := scores[i*tc : (i+1)*tc]
			gpu := topk[i*k : (i+1)*k]
			d := CompareSelection(gpu, sc, k)
			counts[d.Verdict]++
			if d.Ties.Boundary() {
				boundary++
			}
			if d.Verdict == Diverged {
				t.Errorf("Tc=%d row %d: GPU selection diverges: %s", tc, i, d.Reason)
			}
			if d.Verdict == Tie && !d.Ties.Boundary() {
				t.Errorf("Tc=%d row %d: verdict tie without a boundary tie (%v)", tc, i, d.Ties)
			}
			if slices.Equal(d.Ref, gpu) {
				order++
			}
		}
		t.Logf("torch.topk (CUDA) Tc=%5d k=%3d, %3d rows: %3d with a boundary tie; GPU set = reference set %3d, other member of the tie %3d, diverged %d; same order %d",
			tc, k, rows, boundary, counts[Same], counts[Tie], counts[Diverged], order)
		if boundary == 0 {
			t.Errorf("Tc=%d: no boundary ties in the data: the tie rule was not exercised", tc)
		}
	}
}
