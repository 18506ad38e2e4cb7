package fault

import (
	"path/filepath"
	"testing"

	"sparsemla/dump"
	"sparsemla/prefixcheck"
)

// checkPrefixRun writes the run in form, reads it back as the command would and
// runs the check.
func checkPrefixRun(t *testing.T, s *PrefixRun, form string) *prefixcheck.Report {
	t.Helper()
	var tr *prefixcheck.Trace
	switch form {
	case FormEvents:
		data, err := prefixcheck.EncodeEvents(s.Events(), prefixcheck.EncodingMap)
		if err != nil {
			t.Fatal(err)
		}
		b, err := prefixcheck.DecodeEvents(data, "synth.msgpack")
		if err != nil {
			t.Fatal(err)
		}
		if tr, err = prefixcheck.EventsTrace(b, "synth.msgpack", prefixcheck.EventsOptions{}); err != nil {
			t.Fatal(err)
		}
	case FormNative:
		path := filepath.Join(t.TempDir(), "synth.smd")
		if err := s.WriteNative(path, dump.Header{}); err != nil {
			t.Fatal(err)
		}
		d, err := dump.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		if tr, err = prefixcheck.FromDump(d); err != nil {
			t.Fatal(err)
		}
	}
	rep, err := prefixcheck.Run(tr, s.Config())
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

func TestPrefixSynthCleanRunsAgree(t *testing.T) {
	for _, sc := range PrefixScenarios {
		for _, form := range []string{FormEvents, FormNative} {
			for seed := uint64(1); seed <= 4; seed++ {
				// Seed 4: the engine resumes only at request ends.
				s, err := SynthPrefix(PrefixOptions{Scenario: sc, Seed: seed, Requests: 40, NoNamespaces: form == FormNative, ResumeAtEndOnly: seed == 4 && form == FormNative})
				if err != nil {
					t.Fatal(err)
				}
				rep := checkPrefixRun(t, s, form)
				hits := 0
				for _, q := range s.Requests {
					P := s.Options.PageSize
					if form == FormNative || q.Hit/P*P < len(q.Tokens)/P*P { // an event stream has only requests that store pages
						hits += q.Hit
					}
				}
				unchecked := 0
				if hits == 0 && form == FormNative {
					unchecked = len(s.Requests) // a dump without prefix frames does not record hits
				}
				if rep.Summary.Diverged != 0 || rep.Summary.Warn != 0 || rep.Summary.Unchecked != unchecked || rep.Summary.RecordedTokens != hits || hits == 0 && !s.Options.ResumeAtEndOnly {
					t.Errorf("%s %s seed %d: %+v (engine reused %d tokens)\nfirst %+v", sc, form, seed, rep.Summary, hits, rep.First)
				}
				if sc == ScenarioEviction {
					ev := 0
					for _, q := range s.Requests {
						ev += len(q.Evicted)
					}
					if ev == 0 || rep.Summary.UnknownEvictions != 0 {
						t.Errorf("%s seed %d: %d evictions, %d unknown to the correct cache", sc, seed, ev, rep.Summary.UnknownEvictions)
					}
				}
			}
		}
	}
}

// Every fault kind replays to exactly its request and kind.
func TestPrefixFaultsReplayToTheirRequest(t *testing.T) {
	for _, kind := range PrefixFaultKinds() {
		form := PrefixFaultForms[kind]
		for _, sc := range PrefixScenarios {
			if form == FormNative && sc == ScenarioEviction {
				continue
			}
			if kind == prefixcheck.KindEvicted && sc != ScenarioEviction {
				continue
			}
			for seed := uint64(1); seed <= 3; seed++ {
				s, err := SynthPrefix(PrefixOptions{Scenario: sc, Seed: seed, Requests: 40, NoNamespaces: form == FormNative, ResumeAtEndOnly: kind == prefixcheck.KindResumeBeyond})
				if err != nil {
					t.Fatal(err)
				}
				id, err := s.Inject(kind, 20)
				if err != nil {
					t.Errorf("%s %s seed %d: %v", kind, sc, seed, err)
					continue
				}
				if form == FormEvents {
					id = s.EventID(id)
				}
				rep := checkPrefixRun(t, s, form)
				if rep.Summary.Diverged != 1 || rep.Summary.Warn != 0 || rep.First == nil || rep.First.ID != id || rep.First.Kind != kind {
					t.Errorf("%s %s seed %d: %+v\nfirst %+v", kind, sc, seed, rep.Summary, rep.First)
					for _, r := range rep.Requests {
						if r.Status != prefixcheck.StatusAgree {
							t.Logf("  %s %s %s %s", r.ID, r.Status, r.Kind, r.Detail)
						}
					}
				}
			}
		}
	}
}

func TestPrefixSynthErrors(t *testing.T) {
	if _, err := SynthPrefix(PrefixOptions{Scenario: "nope"}); err == nil {
		t.Fatal("unknown scenario accepted")
	}
	s, _ := SynthPrefix(PrefixOptions{Scenario: ScenarioEviction, Seed: 1, Requests: 40})
	if err := s.WriteNative(filepath.Join(t.TempDir(), "x.smd"), dump.Header{}); err == nil {
		t.Fatal("a run with namespaces written as a native dump")
	}
	if _, err := s.Inject("nope", 3); err == nil {
		t.Fatal("unknown fault accepted")
	}
	if _, err := s.Inject(prefixcheck.KindMissedHit, 0); err == nil {
		t.Fatal("position 0 accepted")
	}
}

// One run may carry several decision faults: each replays to its own request.
func TestPrefixRunWithEveryFault(t *testing.T) {
	for _, c := range []struct {
		form  string
		opt   PrefixOptions
		kinds []string
	}{
		{FormEvents, PrefixOptions{Scenario: ScenarioEviction, Seed: 2, Requests: 60},
			[]string{prefixcheck.KindNamespaceMix, prefixcheck.KindMissedHit, prefixcheck.KindEvicted, prefixcheck.KindOverwritten}},
		{FormNative, PrefixOptions{Scenario: ScenarioBranching, Seed: 2, Requests: 60, NoNamespaces: true, ResumeAtEndOnly: true},
			[]string{prefixcheck.KindHitTooLong, prefixcheck.KindBeyondCache, prefixcheck.KindResumeBeyond}},
	} {
		s, err := SynthPrefix(c.opt)
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]string{}
		for i, kind := range c.kinds {
			id, err := s.Inject(kind, 12+10*i)
			if err != nil {
				t.Fatalf("%s: %v", kind, err)
			}
			want[id] = kind
		}
		if c.form == FormEvents {
			ev := map[string]string{}
			for id, k := range want {
				ev[s.EventID(id)] = k
			}
			want = ev
		}
		rep := checkPrefixRun(t, s, c.form)
		got := map[string]string{}
		for _, r := range rep.Requests {
			if r.Status == prefixcheck.StatusDiverged || r.Status == prefixcheck.StatusWarn {
				got[r.ID] = r.Kind
			}
		}
		if len(got) != len(want) || rep.Summary.Warn != 0 {
			t.Errorf("%s: diverged %v, want %v (warn %d)", c.form, got, want, rep.Summary.Warn)
		}
		for id, k := range want {
			if got[id] != k {
				t.Errorf("%s: request %s: %q, want %q", c.form, id, got[id], k)
			}
		}
	}
}

func TestPrefixTwoFaultsOfOneKind(t *testing.T) {
	s, _ := SynthPrefix(PrefixOptions{Scenario: ScenarioBranching, Seed: 1, Requests: 40, NoNamespaces: true})
	a, err1 := s.Inject(prefixcheck.KindHitTooLong, 10)
	b, err2 := s.Inject(prefixcheck.KindHitTooLong, 25)
	if err1 != nil || err2 != nil || a == b {
		t.Fatalf("%q %q %v %v", a, b, err1, err2)
	}
	if rep := checkPrefixRun(t, s, FormNative); rep.Summary.Diverged != 2 {
		t.Fatalf("%+v", rep.Summary)
	}
}
