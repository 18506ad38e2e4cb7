package fault

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/replay"
)

// openFaultInput opens a GPU-made dump under testdata/ (committed: a missing
// one fails the test) with its model.
func openFaultInput(t *testing.T, name string) (*dump.Dump, *replay.DumpSource, *engine.Model) {
	t.Helper()
	return openDumpModel(t, filepath.Join("..", "testdata", name))
}

// openDumpModel opens the dump at path, its default request and its model;
// the dump is closed when the test ends.
func openDumpModel(t *testing.T, path string) (*dump.Dump, *replay.DumpSource, *engine.Model) {
	t.Helper()
	d, err := dump.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	src, err := replay.NewDumpSource(d, "")
	if err != nil {
		t.Fatal(err)
	}
	m, err := replay.LoadModel(d, src, "")
	if err != nil {
		t.Fatal(err)
	}
	return d, src, m
}

// faultWhyGPU is what the diagnosis of each fault must say on a GPU dump:
// faultWhy (the official dumps hold no split-K partials, but the split-K
// hypotheses reproduce the faulty o from q, the cache and the index list).
func faultWhyGPU(k Kind) string { return faultWhy[k] }

// TestFaultedCopyGPUDumps writes a faulted copy of the GPU dumps for every
// fault kind that applies to them and replays it: the first divergence is
// exactly the injected step, layer and stage with the fault's diagnosis; no
// stage of another layer or an earlier step fails; and every record the copy
// does not list as changed or dropped is byte-identical to the input's.
func TestFaultedCopyGPUDumps(t *testing.T) {
	cases := []struct {
		dump  string
		fault string
		fails int      // stages out of tolerance in the whole replay
		notes []string // what each line of Copy.NotRecomputed says
	}{
		{"official-v4-tiny", "splitk-merge@5,1", 1, nil},
		{"official-v4-tiny", "wrong-lse@4,2", 1, nil},
		{"official-v4-tiny", "fp8-scale@3,0", 1, nil},
		{"official-v4-tiny", "scale-byte@6,3", 1, nil},
		{"official-v4-tiny", "stale-prefix@6,1", 1, nil},
		// The late row lands at step 4: the cache differs there too.
		{"official-v4-tiny", "compressor-late@3,1", 2, nil},
		{"official-v4-tiny", "window-order@2,0", 1, nil},
		// Faults of the whole layer (hyper-connections, MoE).
		{"official-v4-tiny", "expert-nibble@4,2", 1, nil},
		{"official-v4-tiny", "router-bias@2,2", 1, nil},
		{"official-v4-tiny", "hc-post-transposed@7,3", 1, nil},
		{"official-v4-tiny", "router-hash-off@3,0", 1, nil},
		{"official-v4-tiny", "router-unnormalised@3,2", 1, nil},
		{"official-v4-tiny", "expert-scale-block@4,1", 1, nil},
		{"official-v4-tiny", "shared-gate-up-swapped@5,2", 1, nil},
		{"official-v4-tiny", "hc-split-no-sigmoid@6,1", 1, nil},
		{"official-v4-tiny", "head-no-norm@7,3", 1, nil},
		{"gpu-v4-tiny-long", "topk-off-by-one@255,1", 1, nil},
		// Carried across the state-only step 254 into step 255; the
		// layers above, whose state the faulty stream changed at step
		// 128, cannot be followed through the steps not dumped.
		{"gpu-v4-tiny-long", "fp8-scale@128,0", 1, []string{"step 254: layers 1, 2, 3: the state the fault changed up to step 128 (cmp_kv_state, cmp_score_state, icmp_kv_state, icmp_score_state, kv_cache) is not followed through step(s) 129..254"}},
		// The HCA (r = 128) row due at p = 127 lands at p = 128.
		{"gpu-v4-tiny-long", "compressor-late@127,2", 2, []string{"step 254: layer 3: the state the fault changed up to step 128"}},
	}
	for i, c := range cases {
		if !raceShortSample(i) {
			continue
		}
		t.Run(c.dump+"/"+c.fault, func(t *testing.T) {
			f, err := Parse(c.fault)
			if err != nil {
				t.Fatal(err)
			}
			d, src, m := openFaultInput(t, c.dump)
			dir := t.TempDir()
			res, err := WriteFaulted(d, src, m, dir, Options{Fault: f, Seed: 3})
			if err != nil {
				t.Fatal(err)
			}
			fd, err := dump.Open(filepath.Join(dir, SynthDumpFile))
			if err != nil {
				t.Fatal(err)
			}
			defer fd.Close()
			if got := fd.Header.User["injected_fault"]; got != c.fault {
				t.Errorf("header names fault %q, want %q", got, c.fault)
			}
			fsrc, err := replay.NewDumpSource(fd, "")
			if err != nil {
				t.Fatal(err)
			}
			fm, err := replay.LoadModel(fd, fsrc, "") // weights found beside the copy
			if err != nil {
				t.Fatal(err)
			}
			rep, err := replay.Run(context.Background(), fm, fsrc, replay.Options{})
			if err != nil {
				t.Fatal(err)
			}
			dv := rep.First
			if dv == nil {
				t.Fatal("the faulted copy replays clean")
			}
			if dv.Step != f.Step || dv.Layer != f.Layer || dv.Stage != f.Stage() || dv.Kind != f.Diagnosis() {
				t.Fatalf("first divergence step %d layer %d stage %s kind %q; want step %d layer %d stage %s kind %q\n%s",
					dv.Step, dv.Layer, dv.Stage, dv.Kind, f.Step, f.Layer, f.Stage(), f.Diagnosis(), dv.Text)
			}
			if !strings.Contains(dv.Why, faultWhyGPU(f.Kind)) && !strings.Contains(dv.Text, faultWhyGPU(f.Kind)) {
				t.Errorf("diagnosis %q does not say %q", dv.Text, faultWhyGPU(f.Kind))
			}
			checkWhy(t, f, dv.Text, true)
			fails := 0
			for _, r := range rep.Results {
				if r.Status != replay.StatusFail {
					continue
				}
				// Every stage downstream of the fault — the layers above,
				// the logits, the later steps — was recomputed from the
				// faulty values: no other stage fails (no layer link of
				// h_in either).
				fails++
				if r.Layer != f.Layer || r.Step < f.Step {
					t.Errorf("step %d layer %d stage %s fails: outside the fault's layer and later steps", r.Step, r.Layer, r.Stage)
				}
			}
			if fails != c.fails {
				t.Errorf("%d stages fail, want %d", fails, c.fails)
			}
			if len(res.NotRecomputed) != len(c.notes) {
				t.Errorf("not recomputed: %q, want %d lines", res.NotRecomputed, len(c.notes))
			}
			for i, n := range c.notes {
				if i < len(res.NotRecomputed) && !strings.Contains(res.NotRecomputed[i], n) {
					t.Errorf("not recomputed[%d] = %q, want it to say %q", i, res.NotRecomputed[i], n)
				}
			}
			if got, want := fd.Header.User["fault_not_recomputed"], strings.Join(res.NotRecomputed, "; "); got != want {
				t.Errorf("header fault_not_recomputed = %q, want %q", got, want)
			}
			checkLaterWindow(t, fm, fsrc, f)
			checkCopyIdentical(t, d, fd, res)
			// The propagated replay (the reference's own chain from each
			// layer's dumped x) finds the same first divergence.
			prop, err := replay.Run(context.Background(), fm, fsrc, replay.Options{Mode: replay.Propagated})
			if err != nil {
				t.Fatal(err)
			}
			if pd := prop.First; pd == nil || pd.Step != f.Step || pd.Layer != f.Layer || pd.Stage != f.Stage() || pd.Kind != f.Diagnosis() {
				t.Errorf("propagated replay: first divergence %+v", pd)
			}
		})
	}
}

// checkLaterWindow replays the faulted copy from the step after the
// fault's on (replay --steps): each step of the window is recomputed from
// the copy's own records, which carry the fault's consequences, so a stage
// fails there only where the fault itself still acts at a later step (the
// late compressed row landing one step late) — never a layer link or
// another layer.
func checkLaterWindow(t *testing.T, m *engine.Model, src replay.Source, f Fault) {
	t.Helper()
	var later []int64
	for _, p := range src.Steps() {
		if p > f.Step {
			later = append(later, p)
		}
	}
	if len(later) == 0 {
		return
	}
	rep, err := replay.Run(context.Background(), m, src, replay.Options{Steps: later})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rep.Results {
		if r.Status != replay.StatusFail {
			continue
		}
		if r.Layer != f.Layer || r.Stage == "h_in" || f.Kind != CompressorLate {
			t.Errorf("replay of steps %s: step %d layer %d stage %s fails: %s", replay.StepList(later), r.Step, r.Layer, r.Stage, r.Reason)
		}
	}
	if dv := rep.First; dv != nil && (dv.Kind == replay.KindLayerLink || dv.Layer != f.Layer) {
		t.Errorf("replay of steps %s: first divergence %s", replay.StepList(later), dv.Text)
	}
}

// checkCopyIdentical checks that the copy holds every record of the input
// (weights excepted: they are the copied weights file) byte for byte, except
// the stage records the copy lists as changed (which must differ) or dropped
// (which must be absent).
func checkCopyIdentical(t *testing.T, in, out *dump.Dump, res *Copy) {
	t.Helper()
	changed, dropped := map[replay.StageKey]bool{}, map[replay.StageKey]bool{}
	for _, k := range res.Changed {
		changed[k] = true
	}
	for _, k := range res.Dropped {
		dropped[k] = true
	}
	if len(changed) == 0 {
		t.Fatal("the copy changed nothing")
	}
	for i := range in.Entries {
		e := &in.Entries[i]
		if e.Kind == dump.KindWeight {
			continue
		}
		sk := replay.StageKey{Step: int64(e.Step), Layer: e.Layer, Stage: e.Stage}
		mine := e.Kind == dump.KindStage && e.Request == res.Request
		oe, ok := out.Lookup(e.Key, e.Kind)
		if mine && dropped[sk] {
			if ok {
				t.Errorf("%s: dropped, but in the copy", e.Key)
			}
			continue
		}
		if !ok {
			t.Errorf("%s (%s): not in the copy", e.Key, e.Kind)
			continue
		}
		a, err := in.Read(e)
		if err != nil {
			t.Fatal(err)
		}
		b, err := out.Read(oe)
		if err != nil {
			t.Fatal(err)
		}
		same := a.DType == b.DType && engine.SameShape(a.Shape, b.Shape) && bytes.Equal(a.Data, b.Data)
		switch {
		case mine && changed[sk] && same:
			t.Errorf("%s: listed as changed but identical", e.Key)
		case !(mine && changed[sk]) && !same:
			t.Errorf("%s (%s): differs from the input but is not listed as changed", e.Key, e.Kind)
		}
	}
}

// TestFaultedCopyCarriesCache: a cache fault stays in the later steps' cache
// until a token overwrites its window slot — across the steps 129..253 the
// long dump does not hold (step 254 is state only) — and the outputs read
// from it change with it, up the layers: the layers above read the faulty
// stream (h_in), at the fault's step and wherever the carried rows change
// the layer's output again. The state those layers wrote at step 128
// cannot be followed through the steps not dumped: the copy says so
// (NotRecomputed). A fault that does not live in the cache changes its
// step only.
func TestFaultedCopyCarriesCache(t *testing.T) {
	d, src, m := openFaultInput(t, "gpu-v4-tiny-long")
	res, err := WriteFaulted(d, src, m, t.TempDir(), Options{Fault: Fault{Kind: FP8Scale, Step: 128, Layer: 0}})
	if err != nil {
		t.Fatal(err)
	}
	has := map[replay.StageKey]bool{}
	for _, k := range res.Changed {
		has[k] = true
	}
	// Token 128 sits in window slot 0 until token 256 overwrites it.
	for _, k := range []replay.StageKey{{Step: 128, Layer: 0, Stage: "kv"}, {Step: 128, Layer: 0, Stage: "kv_cache"}, {Step: 128, Layer: 0, Stage: "y"}, {Step: 254, Layer: 0, Stage: "kv_cache"}, {Step: 255, Layer: 0, Stage: "kv_cache"}, {Step: 255, Layer: 0, Stage: "o"},
		{Step: 128, Layer: 1, Stage: "h_in"}, {Step: 128, Layer: 3, Stage: "kv_cache"}, {Step: 255, Layer: 2, Stage: "h_in"}, {Step: 256, Layer: 3, Stage: "o"}} {
		if !has[k] {
			t.Errorf("%s not changed; changed: %v", k, res.Changed)
		}
	}
	for _, k := range res.Changed {
		upstream := k.Layer == 0 && k.Step == 128 && (k.Stage == "kv_raw" || k.Stage == "q")
		if upstream || (k.Layer == 0 && k.Step == 256) || (k.Step == 254 && k.Layer != 0) {
			t.Errorf("%s changed: upstream of the fault, past the overwrite, or a state the steps not dumped would have changed", k)
		}
	}
	if res.CarriedTo != 256 {
		t.Errorf("carried to step %d, want 256", res.CarriedTo)
	}
	if len(res.NotRecomputed) != 1 || !strings.Contains(res.NotRecomputed[0], "layers 1, 2, 3: the state the fault changed up to step 128") {
		t.Errorf("not recomputed: %q", res.NotRecomputed)
	}
	// The copy is deterministic: a second one is byte-identical.
	a, err := os.ReadFile(filepath.Join(res.Dir, SynthDumpFile))
	if err != nil {
		t.Fatal(err)
	}
	res2, err := WriteFaulted(d, src, m, t.TempDir(), Options{Fault: Fault{Kind: FP8Scale, Step: 128, Layer: 0}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(res2.Dir, SynthDumpFile))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a, b) {
		t.Error("two faulted copies of the same dump and fault differ")
	}

	res, err = WriteFaulted(d, src, m, t.TempDir(), Options{Fault: Fault{Kind: SplitKMerge, Step: 127, Layer: 3}})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range res.Changed {
		if k.Step != 127 || (k.Layer != 3 && k.Layer != dump.Global) {
			t.Errorf("splitk-merge@127,3 changed %s", k)
		}
	}
	if len(res.NotRecomputed) != 0 {
		t.Errorf("splitk-merge@127,3: not recomputed: %q", res.NotRecomputed)
	}
}

// TestFaultedCopyRefused: faults that cannot happen at the position asked
// for, or positions the dump does not hold, are errors, and nothing is
// written.
func TestFaultedCopyRefused(t *testing.T) {
	cases := []struct {
		dump, fault, want string
	}{
		{"official-v4-tiny", "topk-off-by-one@7,1", "selects every one of its Tc = 2"},
		// The hint names the first step the layer can take it at, and
		// which dumped steps can (none here).
		{"official-v4-tiny", "topk-off-by-one@5,1", "needs Tc > 16: step >= 67 on layer 1; this dump's decode steps (2..7) all come before it, so no step of it can take the fault"},
		{"gpu-v4-tiny-long", "topk-off-by-one@60,1", "from step 67 on; dumped steps that can: 126..128, 255..256"},
		{"v32-tiny", "topk-off-by-one@12,0", "(needs step >= 16; dumped steps that can: 16..21)"},
		{"v32-tiny", "topk-off-by-one@3,0", "from step 16 on; dumped steps that can: 16..21"},
		{"gpu-v4-tiny-long", "topk-off-by-one@255,0", "no indexer"},
		{"official-v4-tiny", "compressor-late@4,1", "not an emission step"},
		{"gpu-v4-tiny-long", "compressor-late@255,0", "no compressor"},
		{"gpu-v4-tiny-long", "window-order@128,0", "no -1 padding"},
		{"gpu-v4-tiny-long", "splitk-merge@200,1", "not a dumped decode step"},
		{"gpu-v4-tiny-long", "splitk-merge@254,1", "not a dumped decode step"},
		{"official-v4-tiny", "wrong-lse@9,1", "outside the dumped steps"},
		{"official-v4-tiny", "wrong-lse@3,4", "layer outside"},
	}
	for _, c := range cases {
		f, err := Parse(c.fault)
		if err != nil {
			t.Fatal(err)
		}
		d, src, m := openFaultInput(t, c.dump)
		dir := filepath.Join(t.TempDir(), "out")
		_, err = WriteFaulted(d, src, m, dir, Options{Fault: f})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s on %s: error %v, want one saying %q", c.fault, c.dump, err, c.want)
		}
		if _, serr := os.Stat(dir); serr == nil {
			t.Errorf("%s: refused, but %s was created", c.fault, dir)
		}
	}
	// A stale-prefix fault on a dump that already records a prefix hit, and
	// an output directory that is not empty.
	d, src, m := openFaultInput(t, "official-v4-tiny")
	first := filepath.Join(t.TempDir(), "first")
	if _, err := WriteFaulted(d, src, m, first, Options{Fault: Fault{Kind: StalePrefix, Step: 6, Layer: 1}}); err != nil {
		t.Fatal(err)
	}
	fd, fsrc, fm := openDumpModel(t, filepath.Join(first, SynthDumpFile))
	if _, err := WriteFaulted(fd, fsrc, fm, t.TempDir(), Options{Fault: Fault{Kind: StalePrefix, Step: 7, Layer: 3}}); err == nil || !strings.Contains(err.Error(), "already records a prefix-cache hit") {
		t.Errorf("second stale-prefix: error %v", err)
	}
	// An earlier copy is replaced; a directory with other files, or the
	// input's own, is refused.
	if _, err := WriteFaulted(fd, fsrc, fm, first, Options{Fault: Fault{Kind: WrongLSE, Step: 6, Layer: 1}}); err == nil || !strings.Contains(err.Error(), "it is an input of this command") {
		t.Errorf("output over the input: error %v", err)
	}
	if _, err := WriteFaulted(fd, fsrc, fm, filepath.Join(first, "inner"), Options{Fault: Fault{Kind: WrongLSE, Step: 6, Layer: 1}}); err == nil || !strings.Contains(err.Error(), "lies inside the input") {
		t.Errorf("output inside the input: error %v", err)
	}
	if _, err := WriteFaulted(d, src, m, first, Options{Fault: Fault{Kind: WrongLSE, Step: 6, Layer: 1}}); err != nil {
		t.Errorf("replacing an earlier copy: %v", err)
	}
	other := t.TempDir()
	if err := os.WriteFile(filepath.Join(other, "notes.txt"), []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := WriteFaulted(d, src, m, other, Options{Fault: Fault{Kind: WrongLSE, Step: 6, Layer: 1}}); err == nil || !strings.Contains(err.Error(), "not empty and was not made by sparsemla") {
		t.Errorf("directory with other files: error %v", err)
	}
}

// TestFaultedCopyOfSynth: a faulted copy of a clean synthetic dump (KV pages
// and split-K partials beside o) replays like a dump synthesised with the
// same fault: the pages and partials of the changed values are re-encoded and
// recomputed, so only the injected stage fails.
func TestFaultedCopyOfSynth(t *testing.T) {
	s, err := Synthesize(SynthOptions{Prefill: 6, Steps: 6, Seed: 5})
	if err != nil {
		t.Fatal(err)
	}
	in := t.TempDir()
	if err := s.Write(in); err != nil {
		t.Fatal(err)
	}
	d, src, m := openDumpModel(t, filepath.Join(in, SynthDumpFile))
	for _, f := range []Fault{{SplitKMerge, 8, 1}, {ScaleByte, 9, 3}} {
		dir := t.TempDir()
		res, err := WriteFaulted(d, src, m, dir, Options{Fault: f})
		if errors.Is(err, ErrInvisible) {
			t.Fatalf("%s: %v", f, err)
		}
		if err != nil {
			t.Fatal(err)
		}
		if f.Kind == ScaleByte && res.Pages == 0 {
			t.Errorf("%s: no page re-encoded", f)
		}
		fd, err := dump.Open(filepath.Join(dir, SynthDumpFile))
		if err != nil {
			t.Fatal(err)
		}
		fsrc, err := replay.NewDumpSource(fd, "")
		if err != nil {
			t.Fatal(err)
		}
		fm, err := replay.LoadModel(fd, fsrc, "")
		if err != nil {
			t.Fatal(err)
		}
		rep, err := replay.Run(context.Background(), fm, fsrc, replay.Options{})
		fd.Close()
		if err != nil {
			t.Fatal(err)
		}
		if rep.First == nil || rep.First.Step != f.Step || rep.First.Layer != f.Layer || rep.First.Stage != f.Stage() || rep.First.Kind != f.Diagnosis() || !strings.Contains(rep.First.Why, faultWhy[f.Kind]) {
			t.Fatalf("%s: first divergence %+v", f, rep.First)
		}
		if rep.Summary.Fail != 1 {
			t.Errorf("%s: %d stages fail, want 1", f, rep.Summary.Fail)
		}
	}
}

// TestExpertNoClampRefused: on the official golden no routed expert's gate
// or up reaches swiglu_limit, so a missing clamp cannot show anywhere; the
// fault is refused at every step and layer with that reason (ErrInvisible),
// and nothing is written.
func TestExpertNoClampRefused(t *testing.T) {
	d, src, m := openFaultInput(t, "official-v4-tiny")
	for _, p := range src.Steps() {
		for _, l := range src.Layers() {
			f := Fault{Kind: ExpertNoClamp, Step: p, Layer: l}
			dir := filepath.Join(t.TempDir(), "out")
			_, err := WriteFaulted(d, src, m, dir, Options{Fault: f})
			if !errors.Is(err, ErrInvisible) || !strings.Contains(err.Error(), "the clamp does not act") {
				t.Errorf("%s: %v, want the clamp-does-not-act refusal", f, err)
			}
			if _, err := os.Stat(dir); err == nil {
				t.Errorf("%s: refused, but %s was written", f, dir)
			}
		}
	}
}

// TestFaultedCopyDownstreamConsistent: a faulted copy is what a GPU with the
// bug would have dumped, downstream of the fault as well: every layer above
// the fault's reads the faulty stream (its dumped h_in is the dumped h_out
// of the layer below, bit for bit, at every step), the logits follow the
// last layer, and the later steps follow the changed caches and states.
// So a local replay fails at the fault's stage only, a replay of the steps
// after the fault agrees (each stage recomputed from the copy's own
// records), and a chained replay (the whole model from the token, where
// the stream above the fault differs from the copy's as it would from the
// buggy GPU's) fails nowhere before the fault or below its layer.
func TestFaultedCopyDownstreamConsistent(t *testing.T) {
	for _, c := range []struct {
		fault string
		later []replay.StageKey // changed records downstream of the fault's layer and step
	}{
		{"stale-prefix@6,1", []replay.StageKey{{Step: 6, Layer: 2, Stage: "h_in"}, {Step: 6, Layer: 3, Stage: "kv_cache"}, {Step: 6, Layer: dump.Global, Stage: "logits"},
			{Step: 7, Layer: 2, Stage: "h_in"}, {Step: 7, Layer: 3, Stage: "h_out"}, {Step: 7, Layer: dump.Global, Stage: "logits"}}},
		{"splitk-merge@5,1", []replay.StageKey{{Step: 5, Layer: 2, Stage: "h_in"}, {Step: 5, Layer: 3, Stage: "kv_cache"}, {Step: 5, Layer: dump.Global, Stage: "logits"},
			{Step: 6, Layer: 2, Stage: "o"}, {Step: 7, Layer: 3, Stage: "h_out"}, {Step: 7, Layer: dump.Global, Stage: "logits"}}},
		{"expert-nibble@4,2", []replay.StageKey{{Step: 4, Layer: 3, Stage: "h_in"}, {Step: 4, Layer: dump.Global, Stage: "logits"}, {Step: 5, Layer: 3, Stage: "o"}}},
	} {
		t.Run(c.fault, func(t *testing.T) {
			f, err := Parse(c.fault)
			if err != nil {
				t.Fatal(err)
			}
			d, src, m := openFaultInput(t, "official-v4-tiny")
			dir := t.TempDir()
			res, err := WriteFaulted(d, src, m, dir, Options{Fault: f})
			if err != nil {
				t.Fatal(err)
			}
			if len(res.NotRecomputed) != 0 {
				t.Errorf("not recomputed: %q", res.NotRecomputed)
			}
			has := map[replay.StageKey]bool{}
			for _, k := range res.Changed {
				has[k] = true
				if k.Step < f.Step || (k.Step == f.Step && k.Layer >= 0 && k.Layer < f.Layer) {
					t.Errorf("%s changed: before the fault", k)
				}
			}
			for _, k := range c.later {
				if !has[k] {
					t.Errorf("%s not changed", k)
				}
			}
			_, fsrc, fm := openDumpModel(t, filepath.Join(dir, SynthDumpFile))
			for _, p := range fsrc.Steps() {
				for _, l := range fsrc.Layers() {
					if l == 0 {
						continue
					}
					hin, ok1, err1 := fsrc.Stage(p, l, "h_in")
					hout, ok2, err2 := fsrc.Stage(p, l-1, "h_out")
					if err1 != nil || err2 != nil || !ok1 || !ok2 {
						t.Fatalf("step %d: h_in of layer %d or h_out of layer %d not in the copy", p, l, l-1)
					}
					if !bitIdentical(hin, hout) {
						t.Errorf("step %d: h_in of layer %d is not h_out of layer %d", p, l, l-1)
					}
				}
			}
			rep, err := replay.Run(context.Background(), fm, fsrc, replay.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if rep.Summary.Fail != 1 || rep.First == nil || rep.First.Step != f.Step || rep.First.Layer != f.Layer || rep.First.Stage != f.Stage() {
				t.Errorf("local replay: %d fail, first %s", rep.Summary.Fail, textOf(rep))
			}
			var after []int64
			for _, p := range fsrc.Steps() {
				if p > f.Step {
					after = append(after, p)
				}
			}
			for i := range after {
				w, err := replay.Run(context.Background(), fm, fsrc, replay.Options{Steps: after[i:]})
				if err != nil {
					t.Fatal(err)
				}
				if w.Verdict != replay.VerdictAgree {
					t.Errorf("replay of steps %s: %s", replay.StepList(after[i:]), textOf(w))
				}
			}
			ch, err := replay.Run(context.Background(), fm, fsrc, replay.Options{Mode: replay.Chained})
			if err != nil {
				t.Fatal(err)
			}
			if ch.First == nil || ch.First.Step != f.Step || ch.First.Layer != f.Layer || ch.First.Stage != f.Stage() {
				t.Errorf("chained replay: first %s", textOf(ch))
			}
			for _, r := range ch.Results {
				if r.Status == replay.StatusFail && (r.Step < f.Step || (r.Layer >= 0 && r.Layer < f.Layer)) {
					t.Errorf("chained replay: step %d layer %d stage %s fails: not downstream of the fault", r.Step, r.Layer, r.Stage)
				}
			}
		})
	}
}

// TestTopKHintFeasible: the first step a top-k off-by-one refusal names is
// one the fault can be written at (before, the refusal of @5,1 said "step
// >= 7", and @7,1 was refused again with "step >= 67").
func TestTopKHintFeasible(t *testing.T) {
	for _, c := range []struct {
		dump string
		bad  Fault
		good Fault // at the first dumped step the refusal names
	}{
		{"gpu-v4-tiny-long", Fault{Kind: TopKOffByOne, Step: 60, Layer: 1}, Fault{Kind: TopKOffByOne, Step: 126, Layer: 1}},
		{"v32-tiny", Fault{Kind: TopKOffByOne, Step: 12, Layer: 0}, Fault{Kind: TopKOffByOne, Step: 16, Layer: 0}},
	} {
		d, src, m := openFaultInput(t, c.dump)
		_, err := WriteFaulted(d, src, m, filepath.Join(t.TempDir(), "bad"), Options{Fault: c.bad})
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("dumped steps that can: %d", c.good.Step)) {
			t.Errorf("%s on %s: %v, want a refusal naming step %d first", c.bad, c.dump, err, c.good.Step)
		}
		if _, err := WriteFaulted(d, src, m, t.TempDir(), Options{Fault: c.good}); err != nil {
			t.Errorf("%s on %s, the step the refusal names: %v", c.good, c.dump, err)
		}
	}
	cfg, err := engine.Preset("v41-tiny")
	if err != nil {
		t.Fatal(err)
	}
	f := Fault{Kind: TopKOffByOne, Step: 3, Layer: 2} // r = 2, index_topk 4: Tc > 4 from step 9
	if err := checkV41Fault(cfg, f, 2, 4); err == nil || !strings.Contains(err.Error(), "from step 9 on at layer 2's r = 2; the dumped steps 2 … 4 all come before it") {
		t.Errorf("V4.1 %s: %v", f, err)
	}
	if err := checkV41Fault(cfg, f, 2, 12); err == nil || !strings.Contains(err.Error(), "steps 9 … 12 can") {
		t.Errorf("V4.1 %s in steps 2..12: %v", f, err)
	}
}

// TestFaultedCopyMissingLayer: where the dump lacks a layer between the
// fault's and the top, the stream above it cannot be recomputed: the copy
// keeps the layers above as dumped and says so (NotRecomputed, at every
// step the faulty stream reaches the gap), and its replay still fails at
// the fault only.
func TestFaultedCopyMissingLayer(t *testing.T) {
	in := rewriteGolden(t, "official-v4-tiny", func(e *dump.Entry, rec *dump.Record) bool { return e.Layer != 2 }, nil)
	gd, src, m := openDumpModel(t, filepath.Join(in, SynthDumpFile))
	f := Fault{Kind: StalePrefix, Step: 6, Layer: 1}
	out := t.TempDir()
	res, err := WriteFaulted(gd, src, m, out, Options{Fault: f})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.NotRecomputed) != 1 || !strings.HasPrefix(res.NotRecomputed[0], "steps 6..7: layer 2 is not in the dump: the layers above it and the logits keep their dumped values") {
		t.Errorf("not recomputed: %q", res.NotRecomputed)
	}
	for _, k := range res.Changed {
		if k.Layer == 3 || k.Layer == dump.Global {
			t.Errorf("%s changed: above the missing layer", k)
		}
	}
	_, fsrc, fm := openDumpModel(t, filepath.Join(out, SynthDumpFile))
	rep, err := replay.Run(context.Background(), fm, fsrc, replay.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Summary.Fail != 1 || rep.First == nil || rep.First.Step != 6 || rep.First.Layer != 1 || rep.First.Stage != "kv_cache" {
		t.Errorf("replay: %d fail, %s", rep.Summary.Fail, textOf(rep))
	}
}

// TestFaultedCopyGreedyToken: the tokens fed stay as dumped; where the
// dump's run is greedy (every token the argmax of the logits before it) and
// the faulty logits pick another token, the copy says that a greedy GPU
// would have fed it (official-v4-tiny's tokens are sampled: made greedy
// here).
func TestFaultedCopyGreedyToken(t *testing.T) {
	_, src, _ := openFaultInput(t, "official-v4-tiny")
	argmax := func(v []float32) int64 {
		b := 0
		for i, x := range v {
			if x > v[b] {
				b = i
			}
		}
		return int64(b)
	}
	greedy := map[int64]int64{} // step -> the token fed, the argmax of the logits of the step before
	for _, p := range src.Steps() {
		if lg, ok, err := src.Stage(p, dump.Global, "logits"); err == nil && ok {
			greedy[p+1] = argmax(lg.F)
		}
	}
	in := rewriteGolden(t, "official-v4-tiny", func(e *dump.Entry, rec *dump.Record) bool {
		if tok, ok := greedy[int64(e.Step)]; ok && e.Layer == dump.Global && e.Stage == "tok" && e.Kind == dump.KindStage {
			*rec = engine.RecordLike(*rec, engine.FromI(engine.KindI64, []int64{tok}, 1))
		}
		return true
	}, nil)
	gd, gsrc, gm := openDumpModel(t, filepath.Join(in, SynthDumpFile))
	noted := false
	var faults []Fault
	for p := int64(2); p <= 6; p++ {
		faults = append(faults, Fault{Kind: HeadNoNorm, Step: p, Layer: 3}, Fault{Kind: HCPostTransposed, Step: p, Layer: 3}, Fault{Kind: ExpertNibble, Step: p, Layer: 2})
	}
	for _, f := range faults {
		if noted {
			break
		}
		p := f.Step
		res, err := WriteFaulted(gd, gsrc, gm, t.TempDir(), Options{Fault: f})
		if errors.Is(err, ErrInvisible) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		_, fsrc, _ := openDumpModel(t, filepath.Join(res.Dir, SynthDumpFile))
		bad, ok, err := fsrc.Stage(p, dump.Global, "logits")
		if err != nil || !ok {
			t.Fatalf("%s: the faulty logits are not in the copy: %v", f, err)
		}
		want := ""
		if a := argmax(bad.F); a != greedy[p+1] {
			want = fmt.Sprintf("step %d: the token fed is kept as dumped (%d), though the dump's run is greedy and the faulty logits of the step before pick %d", p+1, greedy[p+1], a)
			noted = true
		}
		got := strings.Join(res.NotRecomputed, "\n")
		if (want == "") != (got == "") || !strings.Contains(got, want) {
			t.Errorf("%s: not recomputed %q, want %q", f, got, want)
		}
	}
	if !noted {
		t.Error("no step where the faulty logits pick another token: the note is not exercised")
	}
	f := Fault{Kind: HeadNoNorm, Step: 6, Layer: 3}
	// The sampled tokens of the GPU dump itself: nothing to say.
	d0, src0, m0 := openFaultInput(t, "official-v4-tiny")
	if res, err := WriteFaulted(d0, src0, m0, t.TempDir(), Options{Fault: f}); err != nil || len(res.NotRecomputed) != 0 {
		t.Errorf("sampled run: %v, not recomputed %q", err, res.NotRecomputed)
	}
}

// rewriteGolden writes into a temporary directory a native copy of the
// GPU golden name (its config.json and weights beside it), with each
// non-weight record passed through keep (which may change it; false drops
// it) and extra records added, and returns the directory.
func rewriteGolden(t *testing.T, name string, keep func(*dump.Entry, *dump.Record) bool, extra []dump.Record) string {
	t.Helper()
	d, _, _ := openFaultInput(t, name)
	dir := t.TempDir()
	var buf bytes.Buffer
	w, err := dump.NewWriter(&buf, d.Header)
	if err != nil {
		t.Fatal(err)
	}
	for i := range d.Entries {
		e := &d.Entries[i]
		if e.Kind == dump.KindWeight {
			continue
		}
		rec, err := d.Read(e)
		if err != nil {
			t.Fatal(err)
		}
		if !keep(e, &rec) {
			continue
		}
		if err := w.Write(&rec); err != nil {
			t.Fatal(err)
		}
	}
	for i := range extra {
		if err := w.Write(&extra[i]); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, SynthDumpFile), buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"config.json", "weights.safetensors"} {
		b, err := os.ReadFile(filepath.Join("..", "testdata", name, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// TestFaultedCopyUnmodeledStage: a stage record the reference neither
// computes nor reads, in a layer the fault reaches, stays as dumped and
// the copy says so.
func TestFaultedCopyUnmodeledStage(t *testing.T) {
	probe := engine.TensorRecord(engine.FromF(engine.KindF32, []float32{1, 2, 3}, 3), dump.Key{Step: 6, Layer: 2, Stage: "my_probe"}, dump.KindStage)
	in := rewriteGolden(t, "official-v4-tiny", func(*dump.Entry, *dump.Record) bool { return true }, []dump.Record{probe})
	d, src, m := openDumpModel(t, filepath.Join(in, SynthDumpFile))
	res, err := WriteFaulted(d, src, m, t.TempDir(), Options{Fault: Fault{Kind: StalePrefix, Step: 6, Layer: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.NotRecomputed) != 1 || res.NotRecomputed[0] != "step 6: layer 2: stage(s) my_probe are not part of the reference: kept as dumped, though the fault reaches the layer" {
		t.Errorf("not recomputed: %q", res.NotRecomputed)
	}
}
