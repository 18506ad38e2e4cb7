package replay_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/fault"
	"sparsemla/indexer"
	"sparsemla/replay"
)

var updateGolden = flag.Bool("update", false, "rewrite replay/testdata golden files")

// replaySynth replays a synthetic dump in local mode.
func replaySynth(t *testing.T, s *fault.Synth) *replay.Report {
	t.Helper()
	rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// TestReplayNaNPattern: NaN in some GPU heads of o is a divergence naming the
// heads, not an input error.
func TestReplayNaNPattern(t *testing.T) {
	s, err := fault.Synthesize(fault.SynthOptions{Prefill: 4, Steps: 3, Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	k := replay.StageKey{Step: 5, Layer: 1, Stage: "o"}
	o := s.Src.Values[k].Clone()
	D := o.Shape[1]
	o.F[2*D+17] = float32(math.NaN())
	s.Src.Values[k] = o
	rep := replaySynth(t, s)
	d := rep.First
	if d == nil || d.Step != 5 || d.Layer != 1 || d.Stage != "o" {
		t.Fatalf("first divergence %+v, want step 5 layer 1 o", d)
	}
	if len(d.Rows) != 1 || d.Rows[0] != 2 || !strings.Contains(d.Why, "NaN") {
		t.Fatalf("diagnosis %q rows %v: want NaN in head 2", d.Why, d.Rows)
	}
}

// TestReplayJSONDeterministic: the --json report is byte-identical at
// GOMAXPROCS 1 and 2 (units run in parallel, results assembled in order).
func TestReplayJSONDeterministic(t *testing.T) {
	f := fault.Fault{Kind: fault.SplitKMerge, Step: 8, Layer: 2}
	s, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 4, Seed: 3, Fault: &f})
	if err != nil {
		t.Fatal(err)
	}
	run := func(procs int, mode replay.Mode) []byte {
		old := runtime.GOMAXPROCS(procs)
		defer runtime.GOMAXPROCS(old)
		rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		var b bytes.Buffer
		if err := rep.WriteJSON(&b); err != nil {
			t.Fatal(err)
		}
		return b.Bytes()
	}
	for _, mode := range []replay.Mode{replay.Local, replay.Propagated} {
		a, b := run(1, mode), run(2, mode)
		if !bytes.Equal(a, b) {
			t.Fatalf("%s: JSON differs between GOMAXPROCS 1 and 2", mode)
		}
	}
}

// jsonPaths lists every key path of a JSON value ("stages[].metrics.max_ulp"),
// sorted and deduplicated: the structure of the schema, not its values.
func jsonPaths(v any, prefix string, out map[string]bool) {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			p := k
			if prefix != "" {
				p = prefix + "." + k
			}
			out[p] = true
			jsonPaths(e, p, out)
		}
	case []any:
		for _, e := range x {
			jsonPaths(e, prefix+"[]", out)
		}
	}
}

// TestReplayJSONSchema checks the structure of the --json report against the
// golden list of key paths in testdata/replay-schema.golden (regenerate with
// go test ./replay -run JSONSchema -update, and document the change in
// docs/replay-json.md with a new schema version if a field changed meaning).
func TestReplayJSONSchema(t *testing.T) {
	paths := map[string]bool{}
	for _, f := range []*fault.Fault{{Kind: fault.TopKOffByOne, Step: 9, Layer: 1}, {Kind: fault.StalePrefix, Step: 8, Layer: 3}} {
		s, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 4, Seed: 5, Fault: f})
		if err != nil {
			t.Fatal(err)
		}
		rep := replaySynth(t, s)
		if rep.Schema != replay.SchemaVersion {
			t.Fatalf("schema %q", rep.Schema)
		}
		var b bytes.Buffer
		if err := rep.WriteJSON(&b); err != nil {
			t.Fatal(err)
		}
		var v any
		if err := json.Unmarshal(b.Bytes(), &v); err != nil {
			t.Fatal(err)
		}
		jsonPaths(v, "", paths)
	}
	var list []string
	for p := range paths {
		list = append(list, p)
	}
	sort.Strings(list)
	got := strings.Join(list, "\n") + "\n"
	golden := filepath.Join("testdata", "replay-schema.golden")
	if *updateGolden {
		if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if got != string(want) {
		t.Fatalf("JSON structure changed (schema %s):\ngot:\n%s\nwant:\n%s", replay.SchemaVersion, got, want)
	}
}

// TestBisect: a fault that stays in the cache (a stale page, a corrupted scale
// byte) is found at its step with about log2(steps) probes; the steps before
// it that were not probed are then scanned (the answer is a local replay's),
// and the steps after it are saved. With AssumePersistent only the probes
// run. A clean dump is replayed at every step and agrees; probing only, it
// is incomplete, never "agree".
func TestBisect(t *testing.T) {
	for _, f := range []fault.Fault{{Kind: fault.StalePrefix, Step: 9, Layer: 3}, {Kind: fault.ScaleByte, Step: 12, Layer: 0}} {
		s, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 16, Seed: 9, Fault: &f})
		if err != nil {
			t.Fatal(err)
		}
		for _, persistent := range []bool{false, true} {
			rep, err := replay.BisectWith(context.Background(), s.Model(), s.Src, replay.BisectOptions{AssumePersistent: persistent})
			if err != nil {
				t.Fatal(err)
			}
			if rep.First == nil || rep.First.Step != f.Step || rep.First.Layer != f.Layer || rep.First.Stage != f.Stage() || !rep.Diverged() {
				t.Fatalf("%s (persistent %v): bisect found %+v", f, persistent, rep.First)
			}
			before := int(f.Step - 6) // steps 6 … f.Step-1
			switch {
			case persistent && rep.StepsReplayed > 6:
				t.Fatalf("%s: %d steps probed of 16, want <= 6", f, rep.StepsReplayed)
			case persistent && len(rep.Coverage.StepsNotChecked) == 0:
				t.Fatalf("%s: probing only, no step reported as not checked", f)
			case !persistent && (rep.StepsReplayed > before+3 || len(rep.Coverage.StepsNotChecked) != 0):
				t.Fatalf("%s: %d steps replayed (want <= %d: the steps before it and a few probes), not checked %v", f, rep.StepsReplayed, before+3, rep.Coverage.StepsNotChecked)
			}
		}
	}
	s, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 8, Seed: 9})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := replay.Bisect(context.Background(), s.Model(), s.Src, nil)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Verdict != replay.VerdictAgree || rep.StepsReplayed != 8 {
		t.Fatalf("clean dump: verdict %s after %d replays, want agree after 8", rep.Verdict, rep.StepsReplayed)
	}
	rep, err = replay.BisectWith(context.Background(), s.Model(), s.Src, replay.BisectOptions{AssumePersistent: true})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Verdict != replay.VerdictIncomplete || rep.StepsReplayed != 1 || len(rep.Coverage.StepsNotChecked) != 7 {
		t.Fatalf("clean dump, probing only: verdict %s after %d replays, %d steps not checked; want incomplete, 1, 7", rep.Verdict, rep.StepsReplayed, len(rep.Coverage.StepsNotChecked))
	}
}

// TestDiffReferee: diffing a clean dump against a faulty one names the fault's
// stage and the referee says the clean side is right.
func TestDiffReferee(t *testing.T) {
	f := fault.Fault{Kind: fault.FP8Scale, Step: 8, Layer: 1}
	clean, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 4, Seed: 11})
	if err != nil {
		t.Fatal(err)
	}
	bad, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 4, Seed: 11, Fault: &f})
	if err != nil {
		t.Fatal(err)
	}
	for _, order := range []struct {
		a, b  *fault.Synth
		right string
	}{{clean, bad, "a"}, {bad, clean, "b"}} {
		rep, err := replay.Diff(context.Background(), clean.Cfg, clean.Model(), order.a.Src, order.b.Src, nil)
		if err != nil {
			t.Fatal(err)
		}
		if rep.First == nil || rep.First.Step != f.Step || rep.First.Layer != f.Layer || rep.First.Stage != "kv" {
			t.Fatalf("diff first %+v", rep.First)
		}
		if rep.Referee == nil || rep.Referee.Right != order.right {
			t.Fatalf("referee %+v, want %s right", rep.Referee, order.right)
		}
	}
}

// TestReplayMalformedDump: dumped tensors of the wrong shape, dtype or range
// are divergences of the stage that holds them (and skips downstream), never
// a panic.
func TestReplayMalformedDump(t *testing.T) {
	s, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 2, Seed: 13})
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		key  replay.StageKey
		bad  engine.Tensor
		want string
	}{
		{replay.StageKey{6, 0, "q"}, engine.FromF(engine.KindBF16, make([]float32, 3), 3), "shape"},
		{replay.StageKey{6, 1, "kv_cache"}, engine.FromI(engine.KindI64, make([]int64, 4), 4), "dtype"},
		{replay.StageKey{7, 2, "topk_idxs"}, engine.FromI(engine.KindI32, []int64{0, 999999, -7}, 3), "shape"},
		{replay.StageKey{7, 3, "index_topk"}, engine.FromI(engine.KindI64, []int64{5, 5}, 2), "index_topk"},
	}
	for _, c := range cases {
		old := s.Src.Values[c.key]
		s.Src.Values[c.key] = c.bad
		rep := replaySynth(t, s)
		s.Src.Values[c.key] = old
		d := rep.First
		if d == nil || d.Step != c.key.Step || d.Layer != c.key.Layer || d.Stage != c.key.Stage {
			t.Fatalf("%v: first divergence %+v", c.key, d)
		}
		if !strings.Contains(d.Text, c.want) {
			t.Errorf("%v: %q lacks %q", c.key, d.Text, c.want)
		}
	}
}

// BenchmarkReplayLocal measures a local replay of the official GPU dump
// (6 steps x 4 layers, every stage recomputed and compared).
func BenchmarkReplayLocal(b *testing.B) {
	dir := filepath.Join("..", "testdata", "official-v4-tiny")
	if _, err := os.Stat(dir); err != nil {
		b.Skip(dir + " absent")
	}
	d, err := dump.Open(dir)
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	src, err := replay.NewDumpSource(d, "")
	if err != nil {
		b.Fatal(err)
	}
	m, err := replay.LoadModel(d, src, "")
	if err != nil {
		b.Fatal(err)
	}
	var stages int
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		rep, err := replay.Run(context.Background(), m, src, replay.Options{})
		if err != nil {
			b.Fatal(err)
		}
		stages = rep.Summary.Compared
	}
	b.ReportMetric(float64(stages)*float64(b.N)/b.Elapsed().Seconds(), "stages/s")
}

// An error in a propagated (or local) replay names the same step and layer
// on every run and at any GOMAXPROCS: the first in (step, layer) order, not
// whichever layer's goroutine failed first.
func TestReplayErrorDeterministic(t *testing.T) {
	s, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 6, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	// Layer 3 loses its x at step 8, layer 0 at step 9: a propagated replay
	// meets step 8 layer 3 first.
	delete(s.Src.Values, replay.StageKey{Step: 8, Layer: 3, Stage: "x"})
	delete(s.Src.Values, replay.StageKey{Step: 9, Layer: 0, Stage: "x"})
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, procs := range []int{1, 4} {
		runtime.GOMAXPROCS(procs)
		for run := 0; run < 5; run++ {
			_, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{Mode: replay.Propagated})
			if err == nil || !strings.Contains(err.Error(), "step 8 layer 3: no x") {
				t.Fatalf("GOMAXPROCS %d run %d: %v", procs, run, err)
			}
		}
	}
}

// A GPU whose indexer query skips the Hadamard rotation, dumping only its
// index scores and its top-k (consistent with those scores): judged against
// its own scores the selection would pass; judged against the reference's
// scores (from the dumped cq, x and icache) it selects other rows, which is
// reported as a divergence of index_score with the rows and both scores,
// and hypothesis "no-hadamard" reproduces the GPU's scores bit for bit.
func TestSelectionJudgedBothWays(t *testing.T) {
	found := 0
	for seed := uint64(1); seed <= 6 && found == 0; seed++ {
		s, err := fault.Synthesize(fault.SynthOptions{Prefill: 75, Steps: 1, Seed: seed})
		if err != nil {
			t.Fatal(err)
		}
		m := s.Model()
		p := int64(75)
		for _, l := range []int{1, 3} {
			ix := m.Weights[l].Indexer
			get := func(n string) engine.Tensor { return s.Src.Values[replay.StageKey{Step: p, Layer: l, Stage: n}] }
			roped, ic, iw := get("iq_roped"), get("icache"), get("iw")
			iq := make([]float32, len(roped.F))
			ix.Query(iq, roped.F) // FQ4 without the rotation
			tc := ic.Shape[0]
			qk := make([]float32, ix.NHeads*tc)
			indexer.IndexQK(qk, iq, ic.F, ix.NHeads, ix.HeadDim)
			sc := make([]float32, tc)
			indexer.IndexScore(sc, qk, iw.F)
			k := ix.K(tc)
			sel, _ := indexer.TopK(sc, k)
			ref := get("index_score").F
			if d := indexer.CompareSelection(sel, ref, k); d.Verdict != indexer.Diverged {
				continue // the rotation does not change this step's selection
			}
			found++
			for _, n := range []string{"iq_b", "iq_roped", "iq_had", "iq", "index_qk", "index_sel", "topk_idxs", "o", "o_inv", "u", "y"} {
				delete(s.Src.Values, replay.StageKey{Step: p, Layer: l, Stage: n})
			}
			s.Src.Put(p, l, "index_score", engine.FromF(engine.KindBF16, sc, tc))
			s.Src.Put(p, l, "index_topk", engine.FromI(engine.KindI64, sel, k))
			rep := replaySynth(t, s)
			d := rep.First
			if d == nil || d.Step != p || d.Layer != l || d.Stage != "index_score" || d.Kind != replay.KindIndexScore {
				t.Fatalf("seed %d layer %d: first divergence %+v", seed, l, d)
			}
			if !strings.Contains(d.Why, "the reference selects row") || !strings.Contains(d.Why, "GPU score") {
				t.Fatalf("seed %d layer %d: %s", seed, l, d.Why)
			}
			if d.Hypothesis == nil || d.Hypothesis.Best == nil || d.Hypothesis.Best.Name != "no-hadamard" || !d.Hypothesis.Best.Exact {
				t.Fatalf("seed %d layer %d: hypothesis %+v\n%s", seed, l, d.Hypothesis, d.Why)
			}
			t.Logf("%s", d.Text)
			break
		}
	}
	if found == 0 {
		t.Fatal("no synthetic step where skipping the Hadamard rotation changes the selection")
	}
}

// A new K written to the wrong window slot (slot p+1: the oldest row
// overwritten early, slot p stale) is a cache-write error, named by its
// hypothesis — not a prefix-cache hit, which the dump does not record.
func TestCacheWriteWrongSlot(t *testing.T) {
	s, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 4, Seed: 4})
	if err != nil {
		t.Fatal(err)
	}
	p, l := int64(8), 1
	key := replay.StageKey{Step: p, Layer: l, Stage: "kv_cache"}
	kc := s.Src.Values[key].Clone()
	prev := s.Src.Values[replay.StageKey{Step: p - 1, Layer: l, Stage: "kv_cache"}]
	kv := s.Src.Values[replay.StageKey{Step: p, Layer: l, Stage: "kv"}]
	D, W := kc.Shape[1], s.Cfg.WindowSize
	slot := int(p) % W
	copy(kc.F[slot*D:(slot+1)*D], prev.F[slot*D:(slot+1)*D]) // slot p keeps its old row
	copy(kc.F[(slot+1)*D:(slot+2)*D], kv.F)                  // the new K lands in slot p+1
	s.Src.Values[key] = kc
	// Later steps read the dumped cache of step 8 as their previous cache.
	for q := p + 1; q < 10; q++ {
		delete(s.Src.Values, replay.StageKey{Step: q, Layer: l, Stage: "kv_cache"})
	}
	rep := replaySynth(t, s)
	d := rep.First
	if d == nil || d.Step != p || d.Layer != l || d.Stage != "kv_cache" || d.Kind != replay.KindCacheWrite {
		t.Fatalf("first divergence %+v", d)
	}
	if d.Hypothesis == nil || d.Hypothesis.Best == nil || d.Hypothesis.Best.Name != "window-slot p+1" || !strings.Contains(d.Why, "instead") {
		t.Fatalf("hypothesis %+v: %s", d.Hypothesis, d.Why)
	}
	t.Log(d.Text)
}

// A window K the GPU never FP8-quantised is said to be that (hypothesis
// no-fq8), not "not FQ8 with a power-of-two neighbour of the scale".
func TestUnquantisedKV(t *testing.T) {
	s, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 3, Seed: 2})
	if err != nil {
		t.Fatal(err)
	}
	p, l := int64(7), 2
	roped := s.Src.Values[replay.StageKey{Step: p, Layer: l, Stage: "kv_roped"}]
	s.Src.Put(p, l, "kv", roped.Clone())
	rep := replaySynth(t, s)
	d := rep.First
	if d == nil || d.Step != p || d.Layer != l || d.Stage != "kv" || d.Kind != replay.KindFP8Cache {
		t.Fatalf("first divergence %+v", d)
	}
	if exact := d.Hypothesis; exact == nil || exact.Best == nil || exact.Best.Name != "no-fq8" || !exact.Best.Exact ||
		strings.Contains(d.Why, "power-of-two neighbour") || !strings.Contains(d.Why, `hypothesis "no-fq8"`) {
		t.Fatalf("%s", d.Text)
	}
}
