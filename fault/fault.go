package fault

import (
	"fmt"

	"io"
	"path/filepath"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/replay"
)

// Options configure WriteFaulted.
type Options struct {
	Fault Fault
	// Seed picks what a fault leaves to chance: the 64-block whose scale
	// byte flips (scale-byte) and the donor request's tokens (stale-prefix).
	Seed uint64
	// Weights is where the replay found the weights (a safetensors file or a
	// directory holding weights.safetensors; empty: beside the dump). The
	// file is copied into the output directory, so the copy replays without
	// flags.
	Weights string
}

// Copy says what WriteFaulted wrote.
type Copy struct {
	Dir       string
	Fault     Fault
	Request   string            // the replayed request the fault went into
	Changed   []replay.StageKey // its stage records whose values changed, in replay order
	Dropped   []replay.StageKey // its stage records left out (stages the faulty GPU did not compute)
	Pages     int               // KV page records re-encoded
	Donor     string            // stale-prefix: the request whose rows were served
	Records   int               // tensor records written
	Unmapped  int               // tensors of the input no name-map rule matched (not in the input's index, not copied)
	CarriedTo int64             // last step whose records carry the fault (its cache rows or outputs)
}

// The files of a faulted copy: the layout of a synthetic dump directory
// (SynthConfigFile, SynthWeightsFile, SynthDumpFile), so replay, report,
// diff and bisect find the native dump and the weights beside it.

// WriteFaulted writes into dir (created; new, empty, or an earlier copy) a
// copy of the dump d (replayed request src, reference m) in which the fault
// opt.Fault is applied the way a buggy GPU would have produced it:
//
//   - the fault's stage (Fault.Stage) at its step and layer is corrupted
//     (faultInjector, the code Synthesize injects with), starting from the
//     GPU's own dumped value; it must be out of tolerance against the
//     reference computed from the dumped inputs (ErrInvisible);
//   - every stage of that step and layer that reads a changed value,
//     directly or through other stages, is recomputed with the reference
//     from the changed values (a local replay recomputes each stage from the
//     dump's own inputs, so the first divergence is exactly the injected
//     stage and every later stage agrees); with the whole layer's weights
//     this includes the block stages after it (h_mid … h_out, and the
//     logits on the last layer: engine.BlockStages); stages upstream of the
//     fault and stages that read no changed value keep their dumped bytes.
//     The layers above keep theirs too, so where the layer's h_out changed,
//     the next layer's dumped h_in no longer equals it and a local replay's
//     check of that link fails as well (after the fault's own stage);
//   - when the fault lives in the cache (kv, kv_cache), later steps of the
//     layer carry it: their kv_cache is recomputed from the faulty one, and
//     across steps the dump does not hold (a state-only step, a gap) the
//     faulty rows are carried into the dumped cache unless a later token
//     overwrote their window slot; the outputs those steps compute from the
//     cache are recomputed too;
//   - KV pages of a changed kv_cache are re-encoded (replay.RewritePage); split-K
//     partials dumped beside a recomputed o are recomputed over the dumped
//     split_bounds; a stale-prefix fault adds the donor request's cache and
//     the prefix-cache hit record.
//
// Other layers and the residual stream between layers (mHC, FFN: not part of
// the reference) keep their dumped values. dir receives config.json (the
// ModelArgs), weights.safetensors (a copy of the weights the replay used)
// and dump.smd: a native dump holding every record of the input (start
// state, tables, all steps, other requests, pages, prefix hits; weight
// records live in weights.safetensors), with the header's user metadata
// naming the fault and the input.
func WriteFaulted(d *dump.Dump, src *replay.DumpSource, m *engine.Model, dir string, opt Options) (*Copy, error) {
	wpath, err := replay.FindWeights(d.Path, opt.Weights)
	if err != nil {
		return nil, err
	}
	g, err := outputGuard(d, wpath)
	if err != nil {
		return nil, err
	}
	if err := g.Check(dir); err != nil {
		return nil, fmt.Errorf("fault: %w", err)
	}
	pl, err := planFault(d, src, m, opt)
	if err != nil {
		return nil, err
	}
	od, err := g.CreateDir(dir)
	if err != nil {
		return nil, fmt.Errorf("fault: %w", err)
	}
	defer od.Abort()
	res := &Copy{Dir: dir, Fault: opt.Fault, Request: src.Request, Donor: pl.donor, Unmapped: len(d.Unmapped), CarriedTo: pl.carriedTo}
	for k := range pl.patch {
		res.Changed = append(res.Changed, k)
	}
	for k := range pl.drop {
		res.Dropped = append(res.Dropped, k)
	}
	sortStageKeys(res.Changed)
	sortStageKeys(res.Dropped)
	if err := od.WriteFile(SynthConfigFile, 0o644, func(w io.Writer) error { _, err := io.WriteString(w, d.Header.ModelArgs); return err }); err != nil {
		return nil, fmt.Errorf("fault: %w", err)
	}
	if err := od.WriteFile(SynthWeightsFile, 0o644, func(w io.Writer) error { return copyFile(w, wpath) }); err != nil {
		return nil, err
	}
	var n, pages int
	if err := od.WriteFile(SynthDumpFile, 0o644, func(w io.Writer) (err error) {
		n, pages, err = pl.write(w, filepath.Join(dir, SynthDumpFile), wpath)
		return err
	}); err != nil {
		return nil, err
	}
	if err := od.Commit(); err != nil {
		return nil, fmt.Errorf("fault: %w", err)
	}
	res.Records, res.Pages = n, pages
	return res, nil
}
