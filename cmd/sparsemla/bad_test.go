package main

// The bad-input corpus: every case of testdata/bad/cases.json is run through
// the CLI in-process (run(args, stdout, stderr)) and must end with the
// expected exit code and one clear line — never a panic, a stack trace, or an
// allocation sized by what a header claims. Inputs are either tiny committed
// files (testdata/bad/*, written by writeBadCorpus; -update-bad rewrites them)
// or made by the test from a small synthetic dump ("make": a mutation below).

import (
	"archive/zip"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"sparsemla/dump"
	"sparsemla/quant"
)

var (
	updateBad = flag.Bool("update-bad", false, "rewrite the committed files of testdata/bad from writeBadCorpus")
	truncAll  = flag.Bool("trunc-all", false, "TestBadTruncations: every cut (about 2200 cuts x 2 commands, a minute), not a sample")
)

const badDir = "../../testdata/bad"

// badCase is one row of testdata/bad/cases.json.
type badCase struct {
	Name string `json:"name"`
	// File is a committed input under testdata/bad; Make names an input made
	// by the test (badMakers: a mutation of the synthetic base dump, or a copy
	// of a golden dump that uses File). At least one is set.
	File string `json:"file,omitempty"`
	Make string `json:"make,omitempty"`
	// Args is the command line; "{in}" is replaced by the input path,
	// "{base}" by the clean synthetic dump, "{tmp}" by a new temp directory.
	Args []string `json:"args"`
	Exit int      `json:"exit"`
	// Note says why the expected behaviour is what it is (not checked).
	Note string `json:"note,omitempty"`
	// KnownBug marks a case whose expected behaviour is the right one but is
	// not met yet: it is skipped while it fails (with the bug and what went
	// wrong in the skip message) and fails once it passes, so the mark is
	// removed when the bug is fixed.
	KnownBug string `json:"known_bug,omitempty"`
	// Want are substrings of the one stderr line (exit 2) or of stdout
	// (exit 0 and 1). "{name}" is replaced by the input's base name.
	Want []string `json:"want"`
	// MaxAllocMB bounds the bytes the command may allocate (default 256).
	MaxAllocMB int `json:"max_alloc_mb,omitempty"`
	// MaxRSSMB bounds the peak resident memory the command adds (default
	// 256; measured with the kernel's high-water mark, see peakMeter).
	MaxRSSMB int `json:"max_rss_mb,omitempty"`
	// MaxSeconds bounds the command's wall time (default 20).
	MaxSeconds int `json:"max_seconds,omitempty"`
}

func loadBadCases(t *testing.T) []badCase {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(badDir, "cases.json"))
	if err != nil {
		t.Fatal(err)
	}
	var cases []badCase
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&cases); err != nil {
		t.Fatalf("cases.json: %v", err)
	}
	names := map[string]bool{}
	for _, c := range cases {
		if names[c.Name] || (c.File == "" && c.Make == "") || len(c.Args) == 0 {
			t.Fatalf("cases.json: case %q: duplicate name, or neither file nor make, or no args", c.Name)
		}
		names[c.Name] = true
	}
	return cases
}

// runBounds are the resource bounds of one bad-input run.
type runBounds struct {
	allocMB, rssMB, seconds int
	inputs                  []string // paths whose bytes the run must not change
}

// checkRun runs args and checks the exit code, the output shape, the
// allocation, peak-memory and time bounds, and that no byte of the inputs
// changed; it returns what is wrong (nil when all is well).
func checkRun(t *testing.T, args []string, exit int, want []string, bounds runBounds) []string {
	t.Helper()
	maxAllocMB := bounds.allocMB
	if maxAllocMB == 0 {
		maxAllocMB = 256
	}
	if bounds.rssMB == 0 {
		bounds.rssMB = 256
	}
	if bounds.seconds == 0 {
		bounds.seconds = 20
	}
	before0 := snapshot(bounds.inputs...)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	peak := startPeak()
	type result struct {
		code   int
		out, e string
	}
	done := make(chan result, 1)
	start := time.Now()
	go func() {
		code, out, e := rpRun(args...)
		done <- result{code, out, e}
	}()
	var res result
	select {
	case res = <-done:
	case <-time.After(time.Duration(bounds.seconds) * time.Second):
		// The run is left behind (a goroutine cannot be stopped): the case fails.
		return []string{fmt.Sprintf("%v: still running after %d s (bound)", args, bounds.seconds)}
	}
	elapsed := time.Since(start)
	rss := peak.addedMB()
	runtime.ReadMemStats(&after)
	code, out, e := res.code, res.out, res.e
	alloc := after.TotalAlloc - before.TotalAlloc
	if testing.Verbose() && os.Getenv("SPARSEMLA_BAD_SHOW") != "" {
		t.Logf("%v: exit %d\nstdout:\n%s\nstderr:\n%s", args, code, clip(out), e)
	}
	var bad []string
	errorf := func(format string, a ...any) { bad = append(bad, fmt.Sprintf(format, a...)) }
	if code != exit {
		errorf("%v: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", args, code, exit, clip(out), e)
	}
	if strings.Contains(e, "goroutine ") || strings.Contains(e, "panic") || strings.Contains(out, "goroutine ") || strings.Contains(out, "panic:") {
		errorf("%v: stack trace or panic in the output:\n%s%s", args, clip(out), e)
	}
	if alloc > uint64(maxAllocMB)<<20 {
		errorf("%v: allocated %d MiB, bound %d MiB", args, alloc>>20, maxAllocMB)
	}
	if rss > int64(bounds.rssMB) {
		errorf("%v: peak RSS grew by %d MiB, bound %d MiB", args, rss, bounds.rssMB)
	}
	if testing.Verbose() && os.Getenv("SPARSEMLA_BAD_SHOW") != "" {
		t.Logf("%v: %v, %d MiB allocated, peak RSS +%d MiB", args, elapsed.Round(time.Millisecond), alloc>>20, rss)
	}
	if changed := snapshotDiff(before0, snapshot(bounds.inputs...)); len(changed) > 0 {
		errorf("%v: changed its inputs: %v", args, changed)
	}
	text := out
	if exit == exitError {
		text = e
		if lines := strings.Count(strings.TrimRight(e, "\n"), "\n") + 1; lines != 1 || !strings.HasSuffix(e, "\n") {
			errorf("%v: stderr is %d lines, want one:\n%s", args, lines, e)
		}
		if !strings.HasPrefix(e, "sparsemla "+args[0]+": ") {
			errorf("%v: stderr does not start with %q: %q", args, "sparsemla "+args[0]+": ", e)
		}
	}
	for _, w := range want {
		if !strings.Contains(text, w) {
			errorf("%v: output lacks %q:\n%s", args, w, clip(text))
		}
	}
	return bad
}

func clip(s string) string {
	if len(s) > 3000 {
		return s[:3000] + "\n[...]"
	}
	return s
}

// TestBadCorpus runs every case of testdata/bad/cases.json.
func TestBadCorpus(t *testing.T) {
	cases := loadBadCases(t)
	base := badBase(t)
	tried, knownBugs := 0, 0
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			var in string
			if c.File != "" {
				in = filepath.Join(badDir, c.File)
				if _, err := os.Stat(in); err != nil {
					t.Fatal(err)
				}
			}
			if c.Make != "" {
				mk, ok := badMakers[c.Make]
				if !ok {
					t.Fatalf("unknown make %q", c.Make)
				}
				in = mk(t, base, t.TempDir(), in)
			}
			args := make([]string, len(c.Args))
			for i, a := range c.Args {
				args[i] = strings.NewReplacer("{in}", in, "{base}", base, "{tmp}", t.TempDir()).Replace(a)
			}
			want := make([]string, len(c.Want))
			for i, w := range c.Want {
				want[i] = strings.ReplaceAll(w, "{name}", filepath.Base(in))
			}
			bad := checkRun(t, args, c.Exit, want, runBounds{allocMB: c.MaxAllocMB, rssMB: c.MaxRSSMB, seconds: c.MaxSeconds, inputs: []string{in, base}})
			tried++
			switch {
			case c.KnownBug == "":
				for _, b := range bad {
					t.Error(b)
				}
			case len(bad) == 0:
				t.Errorf("known bug fixed (%s): remove known_bug from the case", c.KnownBug)
			default:
				knownBugs++
				t.Skipf("known bug: %s\n%s", c.KnownBug, strings.Join(bad, "\n"))
			}
		})
	}
	t.Logf("%d bad-input cases run, %d of them known bugs (skipped)", tried, knownBugs)
}

// TestBadCorpusFiles: the committed corpus is what writeBadCorpus writes,
// byte for byte (so its README stays true); -update-bad rewrites it.
func TestBadCorpusFiles(t *testing.T) {
	dir := t.TempDir()
	files := writeBadCorpus(t, dir)
	if *updateBad {
		for name, b := range files {
			if err := os.WriteFile(filepath.Join(badDir, name), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	total := 0
	for name, b := range files {
		got, err := os.ReadFile(filepath.Join(badDir, name))
		if err != nil {
			t.Errorf("%s: %v (run go test -run TestBadCorpusFiles -update-bad ./cmd/sparsemla)", name, err)
			continue
		}
		if !bytes.Equal(got, b) {
			t.Errorf("%s differs from writeBadCorpus (run with -update-bad)", name)
		}
		total += len(b)
	}
	if total > 64<<10 {
		t.Errorf("corpus is %d bytes; keep it tiny", total)
	}
}

// ---- the synthetic base dump ----

var (
	badBaseOnce sync.Once
	badBaseDir  string
	badBaseErr  string
)

// badBase writes (once per test binary) a small clean synthetic dump: steps
// 6..8 of the tiny config (layers of ratio 0, 4, 128, 4; step 7 emits a
// compressed row on the ratio-4 layers).
func badBase(t *testing.T) string {
	t.Helper()
	badBaseOnce.Do(func() {
		dir, err := os.MkdirTemp("", "sparsemla-bad-base")
		if err != nil {
			badBaseErr = err.Error()
			return
		}
		badBaseDir = filepath.Join(dir, "base")
		if code, _, e := rpRun("synth", "--out", badBaseDir, "--steps", "3", "--seed", "3"); code != exitOK {
			badBaseErr = e
		}
	})
	if badBaseErr != "" {
		t.Fatal("synth base: " + badBaseErr)
	}
	return badBaseDir
}

func TestMain(m *testing.M) {
	code := m.Run()
	if badBaseDir != "" {
		os.RemoveAll(filepath.Dir(badBaseDir))
	}
	os.Exit(code)
}

// readAll reads every record, the header and the prefix hits of a native file.
func readAll(t testing.TB, path string) (dump.Header, []dump.Record, []dump.PrefixHit) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sr, err := dump.NewStreamReader(f, path)
	if err != nil {
		t.Fatal(err)
	}
	var recs []dump.Record
	for {
		r, err := sr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		recs = append(recs, r)
	}
	return sr.Header, recs, sr.Prefix()
}

// derive makes dir a copy of the base dump whose records pass through edit
// (return false to drop one) and whose header passes through editHeader; the
// config and weights are linked, not copied. It returns dir.
func derive(t *testing.T, base, dir string, editHeader func(*dump.Header), edit func(*dump.Record) bool) string {
	t.Helper()
	for _, f := range []string{"config.json", "weights.safetensors"} {
		if err := os.Symlink(filepath.Join(base, f), filepath.Join(dir, f)); err != nil {
			t.Fatal(err)
		}
	}
	h, recs, prefix := readAll(t, filepath.Join(base, "dump.smd"))
	if editHeader != nil {
		editHeader(&h)
	}
	w, err := dump.Create(filepath.Join(dir, "dump.smd"), h)
	if err != nil {
		t.Fatal(err)
	}
	for i := range recs {
		if edit != nil && !edit(&recs[i]) {
			continue
		}
		if err := w.Write(&recs[i]); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range prefix {
		if err := w.WritePrefix(p); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return dir
}

// at selects the stage record (request B, the synthetic dump's replayed one).
func at(r *dump.Record, step, layer int, stage string) bool {
	return r.Kind == dump.KindStage && r.Request == "B" && r.Step == step && r.Layer == layer && r.Stage == stage
}

func setI(r *dump.Record, i int, v int64) {
	switch r.DType {
	case dump.I32:
		binary.LittleEndian.PutUint32(r.Data[4*i:], uint32(int32(v)))
	case dump.I64:
		binary.LittleEndian.PutUint64(r.Data[8*i:], uint64(v))
	default:
		panic("bad_test: setI on " + r.DType.String())
	}
}

func getI(r *dump.Record, i int) int64 {
	switch r.DType {
	case dump.I32:
		return int64(int32(binary.LittleEndian.Uint32(r.Data[4*i:])))
	case dump.I64:
		return int64(binary.LittleEndian.Uint64(r.Data[8*i:]))
	}
	panic("bad_test: getI on " + r.DType.String())
}

func setBF16(r *dump.Record, i int, v float32) {
	if r.DType != dump.BF16 {
		panic("bad_test: setBF16 on " + r.DType.String())
	}
	binary.LittleEndian.PutUint16(r.Data[2*i:], quant.BF16Bits(v))
}

func setF32(r *dump.Record, i int, v float32) {
	if r.DType != dump.F32 {
		panic("bad_test: setF32 on " + r.DType.String())
	}
	binary.LittleEndian.PutUint32(r.Data[4*i:], math.Float32bits(v))
}

func editModelArgs(key string, value any) func(*dump.Header) {
	return func(h *dump.Header) {
		var m map[string]any
		if err := json.Unmarshal([]byte(h.ModelArgs), &m); err != nil {
			panic(err)
		}
		m[key] = value
		b, _ := json.Marshal(m)
		h.ModelArgs = string(b)
	}
}

// badMakers are the mutations of the base dump cases.json names. Each
// returns the input path given to the command.
var badMakers = map[string]func(t *testing.T, base, dir, file string) string{
	"clean": func(t *testing.T, base, dir, _ string) string { return derive(t, base, dir, nil, nil) },
	// Another run: the base's steps with other seeded weights and inputs.
	"other-seed": func(t *testing.T, _, dir, _ string) string {
		out := filepath.Join(dir, "other")
		if code, _, e := rpRun("synth", "--out", out, "--steps", "3", "--seed", "4"); code != exitOK {
			t.Fatal(e)
		}
		return out
	},
	// The same run dumped for fewer steps.
	"other-steps": func(t *testing.T, _, dir, _ string) string {
		out := filepath.Join(dir, "fewer")
		if code, _, e := rpRun("synth", "--out", out, "--steps", "2", "--seed", "3"); code != exitOK {
			t.Fatal(e)
		}
		return out
	},
	// The base with another rope_theta in its header's ModelArgs.
	"other-config": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, func(h *dump.Header) {
			var m map[string]any
			if err := json.Unmarshal([]byte(h.ModelArgs), &m); err != nil {
				t.Fatal(err)
			}
			m["rope_theta"] = 20000.0
			b, err := json.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			h.ModelArgs = string(b)
		}, nil)
	},
	// A tolerance file naming a stage that does not exist (a typo).
	"tol-unknown-stage": func(t *testing.T, _, dir, _ string) string {
		p := filepath.Join(dir, "tol.json")
		if err := os.WriteFile(p, []byte(`{"stages": {"kvcache": {"mode": "exact"}}}`), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	},
	// A step missing its inputs: layer 1's x at step 8 is not in the dump.
	"missing-x": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool { return !at(r, 8, 1, "x") })
	},
	// The start state (kv_cache of layer 2) is missing.
	"missing-start-state": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			return !(r.Kind == dump.KindState && r.Layer == 2 && r.Stage == "kv_cache")
		})
	},
	// topk_idxs holds a compressed row past the cache.
	"topk-out-of-range": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if at(r, 8, 1, "topk_idxs") {
				setI(r, r.Len()-1, 4096)
			}
			return true
		})
	},
	// topk_idxs names one compressed row twice.
	"topk-repeated": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if at(r, 8, 1, "topk_idxs") {
				setI(r, r.Len()-1, getI(r, r.Len()-2))
			}
			return true
		})
	},
	// index_topk (the indexer's top-k) repeats a row.
	"index-topk-repeated": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if at(r, 8, 1, "index_topk") {
				setI(r, 1, getI(r, 0))
			}
			return true
		})
	},
	// index_topk names a row past Tc.
	"index-topk-out-of-range": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if at(r, 8, 1, "index_topk") {
				setI(r, 0, 77)
			}
			return true
		})
	},
	// A -1 (empty slot) among the valid window entries of topk_idxs.
	"topk-minus-one-inside": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if at(r, 8, 0, "topk_idxs") {
				setI(r, 0, -1)
			}
			return true
		})
	},
	// A -1 where the indexer must name a compressed row.
	"topk-minus-one-compressed": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if at(r, 8, 1, "topk_idxs") {
				setI(r, r.Len()-1, -1)
			}
			return true
		})
	},
	// A value below -1.
	"topk-minus-two": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if at(r, 8, 0, "topk_idxs") {
				setI(r, 3, -2)
			}
			return true
		})
	},
	// NaN in two heads of the GPU's attention output (reference finite).
	"nan-in-o": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if at(r, 8, 2, "o") {
				D := r.Shape[1]
				for _, h := range []int{1, 3} {
					for d := 0; d < D; d += 7 {
						setBF16(r, h*D+d, float32(math.NaN()))
					}
				}
			}
			return true
		})
	},
	// +inf in one element of the GPU's attention output y.
	"inf-in-y": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if at(r, 7, 3, "y") {
				setBF16(r, 5, float32(math.Inf(1)))
			}
			return true
		})
	},
	// NaN in the start state (an input the replay cannot check).
	"nan-in-start-state": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if r.Kind == dump.KindState && r.Layer == 0 && r.Stage == "kv_cache" {
				setBF16(r, 3*r.Shape[1]+10, float32(math.NaN()))
			}
			return true
		})
	},
	// NaN in the compressor state of a ratio-4 layer.
	"nan-in-cmp-state": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if at(r, 7, 1, "cmp_kv_state") {
				setF32(r, 2, float32(math.NaN()))
			}
			return true
		})
	},
	// One UE8M0 scale byte of a KV page set to 0xFF (the NaN code).
	"ue8m0-ff-page": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if r.Kind == dump.KindPage && r.Request == "B" && r.Step == 8 && r.Layer == 2 && r.Stage == "kv_cache/0" {
				// v4-model1: the scale bytes of the page follow the 576-byte
				// token rows (spec tools-and-formats.md §2.1); byte 1 of the
				// first token's scales.
				r.Data[64*576+1] = 0xFF
			}
			return true
		})
	},
	// A stale-prefix dump whose prefix-hit record names a request the dump
	// does not hold, or claims 2^40 reused tokens.
	"prefix-unknown-source": prefixEdit(func(p *dump.PrefixHit) { p.Source = "nobody" }),
	"prefix-huge-tokens":    prefixEdit(func(p *dump.PrefixHit) { p.Tokens = 1 << 40 }),
	"prefix-self":           prefixEdit(func(p *dump.PrefixHit) { p.Source = p.Request }),
	// KV page records with hostile page info.
	"page-bad-layout":  pageEdit(func(pi *dump.PageInfo) { pi.Layout = "fp9-sideways" }),
	"page-zero-block":  pageEdit(func(pi *dump.PageInfo) { pi.BlockSize = 0 }),
	"page-huge-block":  pageEdit(func(pi *dump.PageInfo) { pi.BlockSize = 1 << 40 }),
	"page-negative-id": pageEdit(func(pi *dump.PageInfo) { pi.PageID = -7 }),
	"page-table-out-of-range": pageEdit(func(pi *dump.PageInfo) {
		for i := range pi.BlockTable {
			pi.BlockTable[i] = 1 << 40
		}
	}),
	"page-short-bytes": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if r.Kind == dump.KindPage && r.Request == "B" && r.Step == 8 && r.Layer == 2 && r.Stage == "kv_cache/0" {
				r.Data = r.Data[:len(r.Data)-100]
				r.Shape = []int{len(r.Data)}
			}
			return true
		})
	},
	// The dump's model args name other dims than its records and weights.
	"config-dim-mismatch": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, editModelArgs("n_heads", 8), nil)
	},
	"config-window-mismatch": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, editModelArgs("window_size", 64), nil)
	},
	"config-huge-window": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, editModelArgs("window_size", 1<<40), nil)
	},
	// A huge max_seq_len and no GPU RoPE tables: the reference would compute
	// a table of max_seq_len rows.
	"config-huge-seq-len": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, editModelArgs("max_seq_len", 1<<40), func(r *dump.Record) bool { return r.Kind != dump.KindTable })
	},
	"config-huge-topk": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, editModelArgs("index_topk", 1<<40), nil)
	},
	"config-broken-json": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, func(h *dump.Header) { h.ModelArgs = `{"dim": 256,` }, nil)
	},
	"config-negative-dim": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, editModelArgs("head_dim", -512), nil)
	},
	// The weights lack layer 1's wkv.
	"weights-missing": func(t *testing.T, base, dir, _ string) string {
		derive(t, base, dir, nil, nil)
		w := filepath.Join(dir, "weights.safetensors")
		os.Remove(w)
		rewriteSafetensors(t, filepath.Join(base, "weights.safetensors"), w, func(r *dump.Record) bool {
			return r.Name != "layers.1.attn.wkv.weight"
		})
		return dir
	},
	// A UE8M0 block scale of an FP8 weight is 0xFF (the NaN code).
	"weights-scale-ff": func(t *testing.T, base, dir, _ string) string {
		derive(t, base, dir, nil, nil)
		w := filepath.Join(dir, "weights.safetensors")
		os.Remove(w)
		found := false
		rewriteSafetensors(t, filepath.Join(base, "weights.safetensors"), w, func(r *dump.Record) bool {
			if r.Name == "layers.1.attn.wkv.scale" {
				r.Data[1] = 0xFF
				found = true
			}
			return true
		})
		if !found {
			t.Fatal("no layers.1.attn.wkv.scale in the synthetic weights")
		}
		return dir
	},
	// NaN in a weight (the attention sink of layer 2).
	"weights-nan-sink": func(t *testing.T, base, dir, _ string) string {
		derive(t, base, dir, nil, nil)
		w := filepath.Join(dir, "weights.safetensors")
		os.Remove(w)
		rewriteSafetensors(t, filepath.Join(base, "weights.safetensors"), w, func(r *dump.Record) bool {
			if r.Name == "layers.2.attn.attn_sink" {
				switch r.DType {
				case dump.F32:
					setF32(r, 1, float32(math.NaN()))
				case dump.BF16:
					setBF16(r, 1, float32(math.NaN()))
				default:
					t.Fatalf("attn_sink dtype %s", r.DType)
				}
			}
			return true
		})
		return dir
	},
	// A weight with the wrong shape.
	"weights-wrong-shape": func(t *testing.T, base, dir, _ string) string {
		derive(t, base, dir, nil, nil)
		w := filepath.Join(dir, "weights.safetensors")
		os.Remove(w)
		rewriteSafetensors(t, filepath.Join(base, "weights.safetensors"), w, func(r *dump.Record) bool {
			if r.Name == "layers.2.attn.attn_sink" {
				r.Shape = []int{r.Shape[0] / 2}
				r.Data = r.Data[:len(r.Data)/2]
			}
			return true
		})
		return dir
	},
	// The dump holds a layer the model does not have.
	"layer-outside-model": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, editModelArgs("n_layers", 2), nil)
	},
	// A truncated weights file.
	"weights-truncated": func(t *testing.T, base, dir, _ string) string {
		derive(t, base, dir, nil, nil)
		w := filepath.Join(dir, "weights.safetensors")
		b, err := os.ReadFile(filepath.Join(base, "weights.safetensors"))
		if err != nil {
			t.Fatal(err)
		}
		os.Remove(w)
		if err := os.WriteFile(w, b[:len(b)/3], 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	},
	// The official-v4-tiny golden dump with the committed config.json.
	"official-config": func(t *testing.T, _, dir, file string) string {
		src := filepath.Join("..", "..", "testdata", "official-v4-tiny")
		ents, err := os.ReadDir(src)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			if e.Name() == "config.json" || e.IsDir() {
				continue
			}
			abs, _ := filepath.Abs(filepath.Join(src, e.Name()))
			if err := os.Symlink(abs, filepath.Join(dir, e.Name())); err != nil {
				t.Fatal(err)
			}
		}
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "config.json"), b, 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	},
	// The official golden with one routed expert id of step 4, layer 1
	// out of range (moe_indices[0] = 99 of 4 experts): a fault of the MoE
	// there must be refused with one line, never a panic.
	"official-moe-index": func(t *testing.T, _, dir, _ string) string {
		src := filepath.Join("..", "..", "testdata", "official-v4-tiny")
		ents, err := os.ReadDir(src)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			if e.Name() == "step_4.safetensors" || e.IsDir() {
				continue
			}
			abs, _ := filepath.Abs(filepath.Join(src, e.Name()))
			if err := os.Symlink(abs, filepath.Join(dir, e.Name())); err != nil {
				t.Fatal(err)
			}
		}
		from := filepath.Join(src, "step_4.safetensors")
		st, err := dump.OpenSafetensors(from)
		if err != nil {
			t.Fatal(err)
		}
		meta := st.Metadata
		st.Close()
		var recs []dump.Record
		rewriteSafetensors(t, from, filepath.Join(dir, "step_4.safetensors"), func(r *dump.Record) bool {
			if r.Name == "L1.moe_indices" {
				setI(r, 0, 99)
			}
			recs = append(recs, *r)
			return true
		})
		writeSafetensorsFileMeta(t, filepath.Join(dir, "step_4.safetensors"), recs, meta)
		return dir
	},
	// A request the dump does not hold (the case's args add --request).
	"clean-dir": func(t *testing.T, base, dir, _ string) string { return derive(t, base, dir, nil, nil) },
	// A safetensors copy of the dump's stage records with a name map that
	// matches nothing.
	"map-matches-nothing": func(t *testing.T, base, dir, _ string) string {
		_, recs, _ := readAll(t, filepath.Join(base, "dump.smd"))
		var st []dump.Record
		for _, r := range recs {
			if r.Kind == dump.KindStage && r.Step == 7 {
				r.Name = fmt.Sprintf("model.layers.%d.self_attn.%s", r.Layer, r.Stage)
				if r.Request != "B" {
					continue
				}
				st = append(st, r)
			}
		}
		writeSafetensorsFile(t, filepath.Join(dir, "step_7.safetensors"), st)
		m := `{"name": "nothing", "files": [{"file": "^nope_(?P<step>\\d+)\\.bin$", "rules": [{"match": "^zzz$"}]}]}`
		if err := os.WriteFile(filepath.Join(dir, "nothing.map.json"), []byte(m), 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	},
}

// prefixEdit writes a synthetic dump with a stale-prefix fault (layer 3,
// step 9) and edits its prefix-hit record.
func prefixEdit(edit func(*dump.PrefixHit)) func(t *testing.T, base, dir, _ string) string {
	return func(t *testing.T, _, dir, _ string) string {
		src := filepath.Join(t.TempDir(), "stale")
		if code, _, e := rpRun("synth", "--out", src, "--steps", "5", "--seed", "3", "--fault", "stale-prefix@9,3"); code != exitOK {
			t.Fatal(e)
		}
		for _, f := range []string{"config.json", "weights.safetensors"} {
			if err := os.Rename(filepath.Join(src, f), filepath.Join(dir, f)); err != nil {
				t.Fatal(err)
			}
		}
		h, recs, prefix := readAll(t, filepath.Join(src, "dump.smd"))
		if len(prefix) == 0 {
			t.Fatal("the stale-prefix dump has no prefix-hit record")
		}
		w, err := dump.Create(filepath.Join(dir, "dump.smd"), h)
		if err != nil {
			t.Fatal(err)
		}
		for i := range recs {
			if err := w.Write(&recs[i]); err != nil {
				t.Fatal(err)
			}
		}
		for _, p := range prefix {
			edit(&p)
			if err := w.WritePrefix(p); err != nil {
				t.Fatal(err)
			}
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		return dir
	}
}

// pageEdit edits the page info of the first page of layer 2 at step 8.
func pageEdit(edit func(*dump.PageInfo)) func(t *testing.T, base, dir, _ string) string {
	return func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if r.Kind == dump.KindPage && r.Request == "B" && r.Step == 8 && r.Layer == 2 && r.Stage == "kv_cache/0" {
				pi := *r.Page
				pi.BlockTable = append([]int(nil), pi.BlockTable...)
				edit(&pi)
				r.Page = &pi
			}
			return true
		})
	}
}

func rewriteSafetensors(t *testing.T, from, to string, edit func(*dump.Record) bool) {
	t.Helper()
	st, err := dump.OpenSafetensors(from)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	var recs []dump.Record
	for _, n := range st.Names() {
		r, err := st.Read(n)
		if err != nil {
			t.Fatal(err)
		}
		r.Name = n
		if edit(&r) {
			recs = append(recs, r)
		}
	}
	writeSafetensorsFile(t, to, recs)
}

func writeSafetensorsFile(t *testing.T, path string, recs []dump.Record) {
	t.Helper()
	writeSafetensorsFileMeta(t, path, recs, nil)
}

func writeSafetensorsFileMeta(t *testing.T, path string, recs []dump.Record, meta map[string]string) {
	t.Helper()
	var buf bytes.Buffer
	if err := dump.WriteSafetensors(&buf, recs, meta); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

// ---- the committed corpus ----

// rawFrame encodes one native frame with sorted msgpack keys (so the bytes
// are reproducible) followed by data.
func rawFrame(meta map[string]any, data []byte) []byte {
	var mb bytes.Buffer
	enc := msgpack.NewEncoder(&mb)
	enc.SetSortMapKeys(true)
	if err := enc.Encode(meta); err != nil {
		panic(err)
	}
	var l [4]byte
	binary.LittleEndian.PutUint32(l[:], uint32(mb.Len()))
	return append(append(l[:], mb.Bytes()...), data...)
}

func rawFile(version uint32, frames ...[]byte) []byte {
	b := []byte(dump.Magic)
	b = binary.LittleEndian.AppendUint32(b, version)
	for _, f := range frames {
		b = append(b, f...)
	}
	return b
}

var (
	rawHeader = rawFrame(map[string]any{"t": "header", "header": map[string]any{"model_args": `{"dim": 64}`}, "nbytes": 0}, nil)
	rawEnd    = func(n int) []byte { return rawFrame(map[string]any{"t": "end", "records": n, "nbytes": 0}, nil) }
)

func rawTensor(stage, dtype string, shape []int64, nbytes int64, data []byte) []byte {
	return rawFrame(map[string]any{"t": "tensor", "request": "", "step": 3, "layer": 0, "stage": stage,
		"kind": "stage", "dtype": dtype, "shape": shape, "nbytes": nbytes}, data)
}

func safetensorsRaw(header string, data []byte) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	return append(append(b, header...), data...)
}

func npyRaw(version byte, dict string, data []byte) []byte {
	b := append([]byte("\x93NUMPY"), version, 0)
	if version == 1 {
		b = binary.LittleEndian.AppendUint16(b, uint16(len(dict)))
	} else {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(dict)))
	}
	return append(append(b, dict...), data...)
}

// npzClaim is an .npz whose zip directory says its one stored member holds
// 64 GiB (with an npy header to match); the archive is a few hundred bytes.
func npzClaim(t *testing.T) []byte {
	const claim = 1 << 36
	dict := "{'descr': '<u2', 'fortran_order': False, 'shape': (34359738304,), }"
	for (10+len(dict)+1)%64 != 0 {
		dict += " "
	}
	npy := npyRaw(1, dict+"\n", make([]byte, 16))
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	w, err := zw.CreateRaw(&zip.FileHeader{Name: "L0.q.npy", Method: zip.Store, CompressedSize64: claim, UncompressedSize64: claim})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(npy); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// torchZipRaw wraps a pickle as the data.pkl of a torch.save zip (stored,
// with its byteorder member and storages f/data/0, 1, …).
func torchZipRaw(t *testing.T, pkl []byte, storages ...[]byte) []byte {
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	type member struct {
		name string
		b    []byte
	}
	members := []member{{"f/data.pkl", pkl}, {"f/byteorder", []byte("little")}}
	for k, st := range storages {
		members = append(members, member{fmt.Sprintf("f/data/%d", k), st})
	}
	for _, m := range members {
		w, err := zw.CreateHeader(&zip.FileHeader{Name: m.name, Method: zip.Store, Modified: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write(m.b); err != nil {
			t.Fatal(err)
		}
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// pickleBroadcastTensor is a protocol-2 pickle of {"x": a float32 tensor of
// size (2^30, 2^30) and stride (0, 0) on storage 0 of one element}: a
// broadcast view that claims 4 EiB (it once made the reader allocate them).
func pickleBroadcastTensor() []byte {
	str := func(x string) []byte {
		return append(binary.LittleEndian.AppendUint32([]byte{'X'}, uint32(len(x))), x...)
	}
	p := append([]byte{0x80, 2, '}', 'q', 0}, str("x")...)
	p = append(p, "ctorch._utils\n_rebuild_tensor_v2\n(("...)
	p = append(p, str("storage")...)
	p = append(p, "ctorch\nFloatStorage\n"...)
	p = append(p, str("0")...)
	p = append(p, str("cpu")...)
	p = append(p, 'K', 1, 't', 'Q', 'K', 0,
		'(', 'J', 0, 0, 0, 0x40, 'J', 0, 0, 0, 0x40, 't', // size (2^30, 2^30)
		'(', 'K', 0, 'K', 0, 't', 't', 'R', 's', '.') // stride (0, 0)
	return p
}

// pickleMemoDoubling is a protocol-2 pickle of n nested tuples, each holding
// the one before twice through the memo (BINGET): 2^n leaves in 7n + 6 bytes.
func pickleMemoDoubling(n int) []byte {
	p := []byte{0x80, 0x02, ']', 'q', 0}
	for i := range n {
		p = append(p, 'h', byte(i), 'h', byte(i), 0x86, 'q', byte(i+1))
	}
	return append(p, '.')
}

// writeBadCorpus returns the committed files of testdata/bad by name.
func writeBadCorpus(t *testing.T, dir string) map[string][]byte {
	x8 := make([]byte, 8)
	files := map[string][]byte{
		"empty.smd":           {},
		"wrong_magic.smd":     append([]byte("SPMLDUNP\x01\x00\x00\x00"), rawHeader...),
		"short_magic.smd":     []byte("SPML"),
		"future_version.smd":  rawFile(2, rawHeader, rawEnd(0)),
		"no_header_frame.smd": rawFile(1, rawTensor("q", "bf16", []int64{4}, 8, x8), rawEnd(1)),
		"shape_mismatch.smd":  rawFile(1, rawHeader, rawTensor("q", "bf16", []int64{4}, 6, x8[:6]), rawEnd(1)),
		"shape_overflow.smd":  rawFile(1, rawHeader, rawTensor("q", "bf16", []int64{1 << 40, 1 << 40}, 8, x8), rawEnd(1)),
		"negative_dim.smd":    rawFile(1, rawHeader, rawTensor("q", "bf16", []int64{-4}, 8, x8), rawEnd(1)),
		// A header claiming a 1 TB tensor, with 8 data bytes in the file.
		"claims_1tb.smd":       rawFile(1, rawHeader, rawTensor("kv_cache", "bf16", []int64{1 << 39}, 1<<40, x8)),
		"unknown_dtype.smd":    rawFile(1, rawHeader, rawTensor("q", "bf17", []int64{4}, 8, x8), rawEnd(1)),
		"duplicate_record.smd": rawFile(1, rawHeader, rawTensor("q", "bf16", []int64{4}, 8, x8), rawTensor("q", "bf16", []int64{4}, 8, x8), rawEnd(2)),
		"meta_len_huge.smd":    append(rawFile(1, rawHeader), 0xff, 0xff, 0xff, 0xff, 0x81),
		"meta_not_msgpack.smd": rawFile(1, rawHeader, []byte{5, 0, 0, 0, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1}),
		"end_count_wrong.smd":  rawFile(1, rawHeader, rawTensor("q", "bf16", []int64{4}, 8, x8), rawEnd(5)),
		"data_after_end.smd":   append(rawFile(1, rawHeader, rawEnd(0)), 1, 2, 3, 4, 5),
		"unknown_frame.smd":    rawFile(1, rawHeader, rawFrame(map[string]any{"t": "sideways", "nbytes": 0}, nil)),
		"unknown_kind.smd": rawFile(1, rawHeader, rawFrame(map[string]any{"t": "tensor", "step": 3, "layer": 0, "stage": "q",
			"kind": "bogus", "dtype": "bf16", "shape": []int64{4}, "nbytes": 8}, x8), rawEnd(1)),
		"header_twice.smd": rawFile(1, rawHeader, rawHeader, rawEnd(0)),
		// safetensors
		"st_header_len_1tb.safetensors": binary.LittleEndian.AppendUint64(nil, 1<<40),
		"st_bad_json.safetensors":       safetensorsRaw(`{"q": {"dtype": "BF16", "shape": [4], `, x8),
		"st_offsets_past_end.safetensors": safetensorsRaw(
			`{"q": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 1099511627776]}}`, x8),
		"st_shape_mismatch.safetensors": safetensorsRaw(`{"q": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}}`, x8),
		"st_unknown_dtype.safetensors":  safetensorsRaw(`{"q": {"dtype": "BF17", "shape": [4], "data_offsets": [0, 8]}}`, x8),
		"st_overlap.safetensors": safetensorsRaw(`{"a": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}, `+
			`"b": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 8]}}`, x8),
		"st_shape_overflow.safetensors": safetensorsRaw(`{"q": {"dtype": "BF16", "shape": [4294967296, 4294967296, 4294967296], "data_offsets": [0, 8]}}`, x8),
		// npy
		"bad_magic.npy":      append([]byte("\x93NUMPZ\x01\x00"), x8...),
		"npy_claims_1tb.npy": npyRaw(1, "{'descr': '<u2', 'fortran_order': False, 'shape': (549755813888,), }\n", x8),
		"npy_fortran.npy":    npyRaw(1, "{'descr': '<u2', 'fortran_order': True, 'shape': (4,), }\n", x8),
		"npy_big_endian.npy": npyRaw(1, "{'descr': '>u2', 'fortran_order': False, 'shape': (4,), }\n", x8),
		"npz_claims_64g.npz": npzClaim(t),
		"npy_hlen_huge.npy":  append(append([]byte("\x93NUMPY\x02\x00"), 0xff, 0xff, 0xff, 0x7f), x8...),
		// torch.save zips whose pickle memo shares containers: a dict that
		// holds itself, used as a persistent id (its error once printed it:
		// a stack overflow), and 40 nested tuples that each hold the one
		// before twice (2^40 values, once a walk that never ended)
		"pt_self_ref.pt":  torchZipRaw(t, []byte("\x80\x02}q\x00(X\x01\x00\x00\x00kh\x00uh\x00Q.")),
		"pt_memo_2e40.pt": torchZipRaw(t, pickleMemoDoubling(40)),
		"pt_broadcast.pt": torchZipRaw(t, pickleBroadcastTensor(), make([]byte, 4)),
		// a KV event stream (msgpack) in which block 1 is stored under
		// parent 1, then 5 and 6 under 1, then 2 under 7: read as a parent
		// cycle, it once looped until memory ran out
		"events_cycle.events": []byte("\x92\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\x92" +
			"\x96\xabBlockStored\x92\x01\x01\xc0\x92\x05\x06\x01\xc0" +
			"\x96\xabBlockStored\x91\x02\x01\x91\x07\x01\xc0"),
		// name maps
		"map_bad_json.map.json":     []byte(`{"name": "x", "files": [`),
		"map_bad_regexp.map.json":   []byte(`{"name": "x", "files": [{"file": "^step_(?P<step>\\d+$", "rules": [{"match": ".*"}]}]}`),
		"map_unknown_kind.map.json": []byte(`{"name": "x", "files": [{"file": ".*", "kind": "sideways", "rules": [{"match": ".*"}]}]}`),
		// configs
		"config_bad_json.json": []byte(`{"dim": 256, "n_heads": `),
		"config_zero_heads.json": []byte(`{"dim": 256, "n_layers": 2, "n_heads": 0, "head_dim": 512, "rope_head_dim": 64, "q_lora_rank": 128, ` +
			`"o_groups": 2, "o_lora_rank": 128, "window_size": 128, "compress_ratios": [0, 4]}`),
	}
	for name, b := range claimCorpus() {
		files[name] = b
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return files
}

// TestBadTruncations cuts a valid native dump at every frame boundary and
// inside every section of every frame (length prefix, meta, data) and
// replays and inspects each cut. A cut inside a frame is one error line
// naming the file, the record and the offset (exit 2). A cut at a frame
// boundary leaves intact records (a crashed capture): the commands read
// them and say the file has no end frame.
func TestBadTruncations(t *testing.T) {
	base := badBase(t)
	src := filepath.Join(base, "dump.smd")
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	cuts := frameCuts(t, b)
	if !*truncAll {
		// By default: the cuts in the file header and the first frames, and
		// every 53rd after (a prime stride, so every kind of cut is met);
		// .ci/run passes -trunc-all.
		var keep []truncCut
		for i, c := range cuts {
			if i < 24 || i%53 == 0 || i == len(cuts)-1 {
				keep = append(keep, c)
			}
		}
		cuts = keep
	}
	dir := t.TempDir()
	for _, f := range []string{"config.json", "weights.safetensors"} {
		if err := os.Symlink(filepath.Join(base, f), filepath.Join(dir, f)); err != nil {
			t.Fatal(err)
		}
	}
	p := filepath.Join(dir, "dump.smd")
	tried := 0
	for _, c := range cuts {
		if err := os.WriteFile(p, b[:c.at], 0o644); err != nil {
			t.Fatal(err)
		}
		for _, cmd := range []string{"inspect", "replay"} {
			args := []string{cmd, p}
			if cmd == "inspect" {
				args = append(args, "--summary")
			}
			code, out, e := rpRun(args...)
			tried++
			if strings.Contains(e, "goroutine ") || strings.Contains(e, "panic") {
				t.Fatalf("%s cut at %d (%s): panic:\n%s", cmd, c.at, c.where, e)
			}
			if c.boundary {
				// Intact records: inspect lists them; replay replays them or
				// refuses (nothing to replay yet) with one line.
				if cmd == "inspect" && (code != exitOK || !strings.Contains(out, "no end frame")) {
					t.Errorf("inspect cut at frame boundary %d (%s): exit %d, want 0 with a warning\n%s%s", c.at, c.where, code, out, e)
				}
				if code == exitError && strings.Count(strings.TrimRight(e, "\n"), "\n") != 0 {
					t.Errorf("%s cut at %d (%s): stderr is not one line:\n%s", cmd, c.at, c.where, e)
				}
				continue
			}
			if code != exitError {
				t.Errorf("%s cut at %d (%s): exit %d, want %d\n%s%s", cmd, c.at, c.where, code, exitError, clip(out), e)
				continue
			}
			if strings.Count(strings.TrimRight(e, "\n"), "\n") != 0 || !strings.Contains(e, "dump.smd") || !strings.Contains(e, "offset") {
				t.Errorf("%s cut at %d (%s): want one line naming the file and the offset, got %q", cmd, c.at, c.where, e)
			}
			if c.frame > 0 && !strings.Contains(e, "record") {
				t.Errorf("%s cut at %d (%s): error does not name the record: %q", cmd, c.at, c.where, e)
			}
		}
	}
	t.Logf("%d truncations x 2 commands = %d runs", len(cuts), tried)
}

type truncCut struct {
	at       int
	frame    int
	where    string
	boundary bool // at a frame boundary: the prefix is a readable (incomplete) dump
}

// frameCuts lists the cut points of a native file: inside the file header,
// and for every frame its start (a boundary), inside its length prefix,
// inside its meta, at the start of its data and inside its data.
func frameCuts(t *testing.T, b []byte) []truncCut {
	t.Helper()
	cuts := []truncCut{{0, 0, "empty file", false}, {4, 0, "inside the magic", false}, {10, 0, "inside the version", false}}
	off := len(dump.Magic) + 4
	for i := 0; off < len(b); i++ {
		ml := int(binary.LittleEndian.Uint32(b[off:]))
		var meta struct {
			T      string `msgpack:"t"`
			NBytes int64  `msgpack:"nbytes"`
		}
		if err := msgpack.Unmarshal(b[off+4:off+4+ml], &meta); err != nil {
			t.Fatalf("frame %d at %d: %v", i, off, err)
		}
		where := func(s string) string { return fmt.Sprintf("frame %d (%s) %s", i, meta.T, s) }
		// A cut right after the header frame is a boundary, but a file
		// without a tensor frame has nothing to read: not a boundary cut.
		cuts = append(cuts,
			truncCut{off, i, where("start"), i > 0},
			truncCut{off + 2, i, where("length prefix"), false},
			truncCut{off + 4 + ml/2, i, where("meta"), false})
		if meta.NBytes > 0 {
			cuts = append(cuts,
				truncCut{off + 4 + ml, i, where("data start"), false},
				truncCut{off + 4 + ml + int(meta.NBytes)/2, i, where("data"), false})
		}
		off += 4 + ml + int(meta.NBytes)
	}
	if off != len(b) {
		t.Fatalf("frames end at %d, file has %d bytes", off, len(b))
	}
	sort.Slice(cuts, func(i, j int) bool { return cuts[i].at < cuts[j].at })
	return cuts
}

// TestBadSafetensorsTruncations cuts one step file of the official-v4-tiny
// golden (a safetensors dump read through its name map) inside the 8-byte
// header length, inside the JSON header, and at the start, middle and end of
// every tensor's data, and replays and inspects the directory: always one
// error line naming the file (exit 2), never a panic or a replay of partial
// data.
func TestBadSafetensorsTruncations(t *testing.T) {
	src := filepath.Join("..", "..", "testdata", "official-v4-tiny")
	b, err := os.ReadFile(filepath.Join(src, "step_3.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	hlen := int(binary.LittleEndian.Uint64(b))
	var hdr map[string]json.RawMessage
	if err := json.Unmarshal(b[8:8+hlen], &hdr); err != nil {
		t.Fatal(err)
	}
	cuts := []int{0, 4, 8, 8 + hlen/3, 8 + hlen - 1}
	for name, raw := range hdr {
		if name == "__metadata__" {
			continue
		}
		var e struct {
			Offsets [2]int `json:"data_offsets"`
		}
		if err := json.Unmarshal(raw, &e); err != nil {
			t.Fatal(err)
		}
		a, z := 8+hlen+e.Offsets[0], 8+hlen+e.Offsets[1]
		cuts = append(cuts, a+1, (a+z)/2, z-1)
	}
	sort.Ints(cuts)
	if !*truncAll {
		var keep []int
		for i, c := range cuts {
			if i < 12 || i%17 == 0 {
				keep = append(keep, c)
			}
		}
		cuts = keep
	}
	dir := t.TempDir()
	ents, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.Name() == "step_3.safetensors" {
			continue
		}
		abs, _ := filepath.Abs(filepath.Join(src, e.Name()))
		if err := os.Symlink(abs, filepath.Join(dir, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	p := filepath.Join(dir, "step_3.safetensors")
	runs := 0
	for _, c := range cuts {
		if err := os.WriteFile(p, b[:c], 0o644); err != nil {
			t.Fatal(err)
		}
		for _, args := range [][]string{{"inspect", "--summary", dir}, {"replay", dir}} {
			code, out, e := rpRun(args...)
			runs++
			if code != exitError || strings.Count(strings.TrimRight(e, "\n"), "\n") != 0 || !strings.Contains(e, "step_3.safetensors") ||
				strings.Contains(e, "panic") || strings.Contains(e, "goroutine ") {
				t.Errorf("%s cut at %d of %d: exit %d, want 2 with one line naming step_3.safetensors; stderr %q\n%s", args[0], c, len(b), code, e, clip(out))
			}
		}
	}
	t.Logf("%d cuts x 2 commands = %d runs", len(cuts), runs)
}
