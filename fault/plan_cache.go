package fault

import (
	"fmt"

	"math/rand/v2"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/quant"
	"sparsemla/replay"
)

// makeDonor builds the stale-prefix donor: another request that shares the
// replayed request's tokens before p-4 and has its own tokens at p-4 .. p-1
// (seeded random attention inputs, as synth's request A), so its window rows
// of those tokens differ. Its kv_cache at the fault step p is the replayed
// request's with those rows replaced, each computed by the reference's own
// window-K stages (kv_raw, kv_normed, kv_roped, kv) at its position.
func (pl *faultPlan) makeDonor(seed uint64) error {
	f, cfg := pl.f, pl.cfg
	base, ok, err := pl.src.Stage(f.Step, f.Layer, "kv_cache")
	if err != nil {
		return err
	}
	if !ok || len(base.Shape) != 2 || base.Shape[1] != cfg.HeadDim || base.Shape[0] < cfg.WindowSize {
		return fmt.Errorf("fault %s: the dump has no usable kv_cache at step %d, layer %d", f, f.Step, f.Layer)
	}
	reqs := map[string]bool{}
	for _, e := range pl.d.Entries {
		reqs[e.Request] = true
	}
	pl.donor = SynthOtherRequest
	for i := 2; reqs[pl.donor]; i++ {
		pl.donor = fmt.Sprintf("%s%d", SynthOtherRequest, i)
	}
	D, W := cfg.HeadDim, cfg.WindowSize
	pl.donorCache = base.Clone()
	for t := max(0, f.Step-4); t < f.Step; t++ {
		row, err := pl.windowRow(t, donorInput(cfg, seed, t, f.Layer))
		if err != nil {
			return fmt.Errorf("fault %s: donor row of token %d: %w", f, t, err)
		}
		slot := int(t % int64(W))
		copy(pl.donorCache.F[slot*D:(slot+1)*D], row)
	}
	return nil
}

// donorInput is the donor request's attention input at token t: a seeded
// random bf16 residual vector through synthNorm (synth's request glue).
func donorInput(cfg *engine.Config, seed uint64, t int64, layer int) engine.Tensor {
	rng := rand.New(rand.NewPCG(seed^0xa5a5a5a5, uint64(t)<<8|uint64(layer)))
	h := make([]float32, cfg.Dim)
	for i := range h {
		h[i] = quant.BF16Round(float32(rng.NormFloat64()))
	}
	return synthNorm(h)
}

// windowRow computes the window K row (stage kv) of token t from the
// attention input x with the fault layer's reference stages.
func (pl *faultPlan) windowRow(t int64, x engine.Tensor) ([]float32, error) {
	l := pl.layer
	ctx := &engine.StepContext{Cfg: pl.cfg, Layer: l, Pos: t, W: pl.m.Weights[l], Rope: pl.m.Rope[l]}
	if t >= int64(ctx.Rope.T) {
		return nil, fmt.Errorf("position %d outside the RoPE table", t)
	}
	vals := map[string]engine.Tensor{"x": x}
	for _, def := range engine.Stages(pl.cfg, l, t) {
		switch def.Name {
		case "kv_raw", "kv_normed", "kv_roped", "kv":
		default:
			continue
		}
		out, err := def.Compute(ctx, vals)
		if err != nil {
			return nil, err
		}
		vals[def.Name] = out
	}
	return vals["kv"].F, nil
}

// planPages re-encodes, for every changed kv_cache of the replayed request,
// the entries of its changed rows in the dumped KV pages.
func (pl *faultPlan) planPages() error {
	for k, kv := range pl.patch {
		if k.Stage != "kv_cache" {
			continue
		}
		gpu, _, err := pl.src.Stage(k.Step, k.Layer, "kv_cache")
		if err != nil {
			return err
		}
		D := kv.Shape[1]
		for i := range pl.d.Entries {
			e := &pl.d.Entries[i]
			if e.Kind != dump.KindPage || e.Request != pl.src.Request || int64(e.Step) != k.Step || e.Layer != k.Layer || !replay.IsPageStage(e.Stage) {
				continue
			}
			if e.Page == nil || e.Page.BlockSize <= 0 {
				return fmt.Errorf("dump %s: record %d (%s): page record without page info", e.File, e.Record, e.Key)
			}
			B := e.Page.BlockSize
			rows := map[int][]float32{}
			for b, id := range e.Page.BlockTable {
				if id != e.Page.PageID {
					continue
				}
				for r := b * B; r < (b+1)*B && (r+1)*D <= len(kv.F); r++ {
					nr := kv.F[r*D : (r+1)*D]
					if (r+1)*D <= len(gpu.F) && bitIdentical(engine.FromF(engine.KindF32, nr, D), engine.FromF(engine.KindF32, gpu.F[r*D:(r+1)*D], D)) {
						continue
					}
					rows[r-b*B] = nr
				}
			}
			if len(rows) == 0 {
				continue
			}
			rec, err := pl.d.Read(e)
			if err != nil {
				return err
			}
			// A zero-byte record reads as nil, which RewritePage takes for
			// "no page: zero bytes" and allocates at the claimed block size
			// (up to 1 GiB); given as an empty page its length is checked.
			page := rec.Data
			if page == nil {
				page = []byte{}
			}
			data, err := replay.RewritePage(e.Page.Layout, D, B, page, rows)
			if err != nil {
				return fmt.Errorf("dump %s: record %d (%s): re-encoding the faulty rows: %w", e.File, e.Record, e.Key, err)
			}
			pl.pages[i] = data
		}
	}
	return nil
}
