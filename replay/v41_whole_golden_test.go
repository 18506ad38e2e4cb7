package replay

import (
	"fmt"
	"sort"
	"strings"
	"testing"
)

// v41WholeGolden is the GPU golden of a whole V4.1 decode step (the official
// Transformer.forward; testdata/v41-tiny-whole/README.md). Its attention
// stages are in v41-tiny's layout, so V41Run replays them; the block, MoE
// and head stages are not judged by V41Run (engine's TestV41WholeGolden*
// check them).
const v41WholeGolden = "../testdata/v41-tiny-whole"

// TestV41WholeGoldenAttention replays the attention sub-layer of every layer
// and step of the whole-step golden with V41Run (each layer's x is now the
// official attn_norm output of the real stream, not a random input), in both
// modes, and logs the agreement per stage. Every attention stage must be
// compared. Local: every stage passes V41Tolerance except kv_normed, where
// the reference's index-order fp32 sum of squares (attention.RMSNorm) can
// differ from torch's reduction by a few ulps and flip one bf16 rounding at a
// near-tie (1 value of 512, 1 ulp). Propagated: failures only at the layers
// and steps of such a near-tie (the flipped value goes through FQ8 into the
// window and the attention).
func TestV41WholeGoldenAttention(t *testing.T) {
	d, err := LoadV41Dir(v41WholeGolden)
	if err != nil {
		t.Fatal(err)
	}
	nearTie := map[string]bool{}
	for _, mode := range []Mode{Local, Propagated} {
		rep, err := V41Run(d, V41Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		type agg struct {
			results, pass, n, mismatch int
			maxULP                     int64
			maxAbs                     float64
			fails                      []string
		}
		per := map[string]*agg{}
		for _, r := range rep.Results {
			if r.Status == StatusMissing || r.Status == StatusSkipped {
				continue
			}
			a := per[r.Stage]
			if a == nil {
				a = &agg{}
				per[r.Stage] = a
			}
			a.results++
			if r.Status == StatusPass || r.Status == StatusTie {
				a.pass++
			}
			where := fmt.Sprintf("P%d L%d", r.Step, r.Layer)
			if r.Metrics != nil {
				a.n += r.Metrics.N
				a.mismatch += r.Metrics.Mismatch
				a.maxULP = max(a.maxULP, r.Metrics.MaxULP)
				a.maxAbs = max(a.maxAbs, r.Metrics.MaxAbs)
			}
			if r.Status != StatusFail {
				continue
			}
			a.fails = append(a.fails, where)
			switch {
			case mode == Local && r.Stage == "kv_normed" && r.Metrics != nil && r.Metrics.Mismatch == 1 && r.Metrics.MaxULP == 1:
				nearTie[where] = true
			case mode == Propagated && nearTie[where]:
			default:
				t.Errorf("%s: %s %s: %s", mode, where, r.Stage, r.Reason)
			}
		}
		var names []string
		for n := range per {
			names = append(names, n)
		}
		sort.Strings(names)
		var b strings.Builder
		fmt.Fprintf(&b, "%s mode, %d steps x %d layers:\n", mode, len(d.Steps), d.Cfg.NLayers)
		for _, n := range names {
			a := per[n]
			fmt.Fprintf(&b, "  %-16s %3d/%3d results pass, %7d values, %8.4f %% bit-exact, max %d bf16 ulp, max |Δ| %.2g", n, a.pass, a.results, a.n, 100*float64(a.n-a.mismatch)/float64(max(a.n, 1)), a.maxULP, a.maxAbs)
			if len(a.fails) > 0 {
				fmt.Fprintf(&b, "; fail at %s", strings.Join(a.fails, ", "))
			}
			b.WriteString("\n")
		}
		t.Log(b.String())
		for _, want := range []string{"q_a", "cq", "q_b", "q", "kv_raw", "kv_normed", "kv", "window", "kv_cache", "o", "y",
			"cmp_a", "cmp_b", "cmp_raw", "cmp_latent", "ik_normed", "icache", "iq_b", "iw_raw", "cand_mask", "index_sel", "topk_idxs"} {
			if per[want] == nil || per[want].results == 0 {
				t.Errorf("%s: stage %s never compared", mode, want)
			}
		}
	}
}
