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
	// NotRecomputed lists, one line each ("step(s) …: why"), what the
	// faulty GPU would have changed but the copy keeps as dumped because
	// the dump does not let it be recomputed (layers or steps not in the
	// dump, weights of the attention path only, a token a greedy run would
	// have picked differently). Empty when every stage downstream of the
	// fault was recomputed. The copy's header names them too
	// (fault_not_recomputed).
	NotRecomputed []string
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
//   - every stage that reads a changed value, directly or through other
//     stages, is recomputed with the reference from the changed values, as
//     the GPU would have computed it (a local replay recomputes each stage
//     from the dump's own inputs, so the first divergence is exactly the
//     injected stage and every later stage agrees): the rest of the fault's
//     layer (with the whole layer's weights its block stages h_mid … h_out:
//     engine.BlockStages), every layer above it at that step (its input
//     streams are the output of the layer below: h_in = h_out, or V3.2's
//     x_in = ffn_out and res_in = h_mid), the logits, and at every later
//     step each layer whose state (kv_cache, compressor and indexer states)
//     the fault changed, and the layers above it again; stages upstream of
//     the fault and stages that read no changed value keep their dumped
//     bytes. The tokens fed stay as dumped (a sampled token does not follow
//     from the logits);
//   - across steps the dump does not hold (a state-only step, a gap) the
//     fault's layer carries its faulty cache rows into the dumped cache
//     unless a later token overwrote their window slot (the layers below it
//     are unchanged, so what it wrote meanwhile is the dump's); a layer above
//     it, whose inputs in those steps are unknown, goes on from its dumped
//     state after them;
//   - KV pages of a changed kv_cache are re-encoded (replay.RewritePage); split-K
//     partials dumped beside a recomputed o are recomputed over the dumped
//     split_bounds; a stale-prefix fault adds the donor request's cache and
//     the prefix-cache hit record.
//
// What the dump does not let it recompute stays as dumped and is listed,
// with the steps, in Copy.NotRecomputed (and the copy's header,
// fault_not_recomputed): a layer state not followed through steps the dump
// does not hold, layers between or above the dumped ones, a layer whose
// weights hold the attention path only (the residual stream to the layer
// above is not part of the reference), a stage whose other input is neither
// dumped nor computable, the logits without head weights, and, in a dump
// whose tokens are all the greedy pick of the logits before them, a token
// the faulty logits would have picked otherwise. dir receives config.json (the
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
	res := &Copy{Dir: dir, Fault: opt.Fault, Request: src.Request, Donor: pl.donor, Unmapped: len(d.Unmapped), CarriedTo: pl.carriedTo, NotRecomputed: pl.notes.list()}
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
