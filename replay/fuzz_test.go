package replay

import (
	"os"
	"path/filepath"

	"testing"
)

// The decoders of outside input in this package: the ModelArgs JSON (a dump
// header's model args, a config.json), the --tol-stage flag and the --tol
// file. Each must return an error, never panic, on any input.

// FuzzStageTol: the --tol-stage parser never panics and an accepted value
// has a valid mode and a stage name.
func FuzzStageTol(f *testing.F) {
	for _, s := range []string{"o=close,abs=2e-3,rel=0.02,cos=1e-5", "u=ulp,max_ulp=3", "q=exact", "topk_idxs=set",
		"q=ulp,max_ulp=99999999999999999999", "=ulp", "o=close,abs=NaN", "o=close,,", "o"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		name, st, err := ParseStageTol(s)
		if err != nil {
			return
		}
		if name == "" || !st.Mode.valid() {
			t.Fatalf("%q accepted as stage %q mode %q", s, name, st.Mode)
		}
		tol := DefaultTolerance()
		tol.Set(name, st)
		if got := tol.For(name); got.Mode != st.Mode {
			t.Fatalf("%q: Set then For gives mode %q", s, got.Mode)
		}
	})
}

// FuzzToleranceFile: the --tol JSON file loader never panics; what it
// accepts has valid modes everywhere.
func FuzzToleranceFile(f *testing.F) {
	f.Add([]byte(`{"stages": {"o": {"mode": "close", "abs": 2e-3, "rel": 0.02, "cos": 1e-5}}, "fallback": {"mode": "ulp", "max_ulp": 2}}`))
	f.Add([]byte(`{"stages": {"o": {"mode": "sideways"}}}`))
	f.Add([]byte(`{"stages": null, "fallback": null}`))
	f.Add([]byte(`{"stages": {"": {"mode": "exact"}}}`))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		p := filepath.Join(dir, "tol.json")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		tol := DefaultTolerance()
		if err := tol.LoadToleranceFile(p); err != nil {
			return
		}
		if !tol.Fallback.Mode.valid() {
			t.Fatalf("fallback mode %q accepted", tol.Fallback.Mode)
		}
		for name, st := range tol.Stages {
			if !st.Mode.valid() {
				t.Fatalf("stage %q mode %q accepted", name, st.Mode)
			}
		}
	})
}
