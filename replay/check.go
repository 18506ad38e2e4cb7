package replay

import (
	"fmt"
	"slices"
	"strings"

	"sparsemla/dump"
	"sparsemla/engine"
)

// checkDumpShapes checks, once when a model is loaded for a dump, that the
// config agrees with the shapes the dump's records have (from the index: no
// data is read): the layer schedule of the dump header, which stages each
// layer has (a compressor only for r > 0, an indexer only for r = 4), the
// widths fixed by dim, n_heads, head_dim and the indexer dims, and the rows
// of kv_cache — window_size window rows, then at most (s+1) div r compressed
// rows after step s (none for r = 0). Weights check the dims they hold
// (LoadLayerWeights); window_size and compress_ratios only the dump can.
//
// A disagreement is outside input (the wrong config for this dump), so it is
// an error naming the record, its shape and the config value, not a
// divergence: replaying with it would blame a GPU stage for the config.
// Shapes of a stage the GPU may legally get wrong in a way the replay
// diagnoses (a cache row emitted late, a top-k list) are only bounded, not
// fixed, here.
func checkDumpShapes(cfg *engine.Config, d *dump.Dump) error {
	if hr := d.Header.CompressRatios; len(hr) > 0 && !slices.Equal(hr, cfg.CompressRatios) {
		return fmt.Errorf("config and dump disagree: the dump header's layer schedule is compress_ratios %v, the config's %v", hr, cfg.CompressRatios)
	}
	for i := range d.Entries {
		e := &d.Entries[i]
		// A decode position is below max_seq_len (the model's caches and
		// RoPE tables hold that many): a record of step 2^63-1 is refused
		// here, before any row count is computed from it.
		if (e.Kind == dump.KindStage || e.Kind == dump.KindState) && cfg.MaxSeqLen > 0 && e.Step >= cfg.MaxSeqLen {
			return fmt.Errorf("config and dump disagree: %s record %d (%s %s) is at step %d, past the config's max_seq_len = %d", e.File, e.Record, e.Key, e.Kind, e.Step, cfg.MaxSeqLen)
		}
		if (e.Kind != dump.KindStage && e.Kind != dump.KindState) || e.Layer < 0 || e.Layer >= cfg.NLayers {
			continue
		}
		if err := checkRecordShape(cfg, e); err != nil {
			return fmt.Errorf("config and dump disagree: %s record %d (%s %s) has shape %v: %w", e.File, e.Record, e.Key, e.Kind, e.Shape, err)
		}
	}
	return nil
}

// checkRecordShape checks one stage or state record of a layer against the
// config; the error says what the config needs.
func checkRecordShape(cfg *engine.Config, e *dump.Entry) error {
	if cfg.V32() {
		return checkV32RecordShape(cfg, e)
	}
	l, s := e.Layer, e.Stage
	r := cfg.Ratio(l)
	H, D, Dim := cfg.NHeads, cfg.HeadDim, cfg.Dim
	HI, DI := cfg.IndexNHeads, cfg.IndexHeadDim
	// Which layers have the stage at all.
	switch {
	case strings.HasPrefix(s, "icmp_") || strings.HasPrefix(s, "iq") || strings.HasPrefix(s, "iw") || s == "icache" || strings.HasPrefix(s, "index_"):
		if r != 4 {
			return fmt.Errorf("an indexer stage on layer %d, which compress_ratios %v make a ratio-%d layer (the indexer exists only for r = 4)", l, cfg.CompressRatios, r)
		}
	case strings.HasPrefix(s, "cmp_"):
		if r == 0 {
			return fmt.Errorf("a compressor stage on layer %d, which compress_ratios %v make a window-only layer (ratio 0)", l, cfg.CompressRatios)
		}
	}
	exact := func(want ...int) error {
		if !slices.Equal(e.Shape, want) {
			return fmt.Errorf("the config needs %v (dim = %d, n_heads = %d, head_dim = %d, rope_head_dim = %d, index_n_heads = %d, index_head_dim = %d)",
				want, Dim, H, D, cfg.RopeHeadDim, HI, DI)
		}
		return nil
	}
	rows := func(cols, maxRows int, what string) error {
		if len(e.Shape) != 2 || e.Shape[1] != cols || e.Shape[0] > maxRows {
			return fmt.Errorf("the config needs [at most %d, %d] (%s)", maxRows, cols, what)
		}
		return nil
	}
	switch s {
	case "x", "y":
		return exact(Dim)
	case "q_a", "cq":
		return exact(cfg.QLoraRank)
	case "q_b", "q", "o", "o_inv":
		return exact(H, D)
	case "q_pe_prerope":
		return exact(H, cfg.RopeHeadDim)
	case "kv_raw", "kv_normed", "kv_roped", "kv":
		return exact(D)
	case "u":
		return exact(cfg.OGroups, cfg.OLoraRank)
	case "iq_b", "iq_roped", "iq_had", "iq":
		return exact(HI, DI)
	case "iw_raw", "iw":
		return exact(HI)
	case "cmp_a", "cmp_b":
		return exact(engine.Coff(r) * D)
	case "cmp_pooled", "cmp_normed", "cmp_roped", "cmp_row":
		return exact(D)
	case "icmp_a", "icmp_b":
		return exact(2 * DI)
	case "icmp_pooled", "icmp_normed", "icmp_roped", "icmp_had", "icmp_row":
		return exact(DI)
	case "cmp_kv_state", "cmp_score_state":
		return rows(engine.Coff(r)*D, engine.Coff(r)*r, fmt.Sprintf("ratio %d: coff·head_dim columns, at most coff·r rows", r))
	case "icmp_kv_state", "icmp_score_state":
		return rows(2*DI, 8, "2·index_head_dim columns, at most 8 rows")
	case "icache":
		return rows(DI, rowsAfter(e.Step, 4), fmt.Sprintf("index_head_dim columns, at most (s+1) div 4 rows after step %d", e.Step))
	case "kv_cache":
		W := cfg.WindowSize
		maxCmp := 0
		if r > 0 {
			maxCmp = rowsAfter(e.Step, r)
		}
		if len(e.Shape) != 2 || e.Shape[1] != D || e.Shape[0] < W || e.Shape[0] > W+maxCmp {
			if r == 0 {
				return fmt.Errorf("the config needs [%d, %d]: window_size = %d window rows on a window-only layer (ratio 0), head_dim = %d", W, D, W, D)
			}
			return fmt.Errorf("the config needs [%d + at most %d, %d]: window_size = %d window rows, then at most (s+1) div r = (%d+1) div %d compressed rows, head_dim = %d",
				W, maxCmp, D, W, e.Step, r, D)
		}
	}
	return nil
}

// rowsAfter is (step+1) div r, the compressed rows a ratio-r layer holds
// after step, computed without overflow for any step a dump may claim (a
// step of 2^63−1 gives 2^61 rows, not a negative count).
func rowsAfter(step, r int) int {
	if step < 0 || r <= 0 {
		return 0
	}
	return int((uint64(step) + 1) / uint64(r))
}
