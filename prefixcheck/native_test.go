package prefixcheck

import (
	"encoding/binary"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"

	"sparsemla/dump"
)

// writeNative writes a native dump with one tok record per position of each
// request (from position from[id], default 0) and the given prefix hits.
func writeNative(t *testing.T, reqs [][2]string, from map[string]int, hits []dump.PrefixHit) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "run.smd")
	w, err := dump.Create(path, dump.Header{ModelArgs: `{"window_size": 4}`, CompressRatios: []int{0, 4, 128}})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range reqs {
		for p, c := range r[1] {
			if p < from[r[0]] {
				continue
			}
			data := make([]byte, 8)
			binary.LittleEndian.PutUint64(data, uint64(c))
			rec := dump.Record{Key: dump.Key{Request: r[0], Step: p, Layer: -1, Stage: "tok"}, Kind: dump.KindStage, DType: dump.I64, Shape: []int{1}, Data: data}
			if err := w.Write(&rec); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, h := range hits {
		if err := w.WritePrefix(h); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestFromNativeDump(t *testing.T) {
	path := writeNative(t,
		[][2]string{{"B", "abcdxyzw"}, {"A", "abcdefgh"}, {"C", "abcdefgh"}, {"D", "abcdefgh"}, {"E", "wxyzwxyz"}, {"F", "wxyzwxyz"}},
		map[string]int{"D": 4},
		[]dump.PrefixHit{{Request: "B", Source: "A", Tokens: 8}, {Request: "C", Source: "A", Tokens: 8},
			{Request: "D", Source: "A", Tokens: 4}, {Request: "E", Source: "Z", Tokens: 4}, {Request: "F", Source: "E", Tokens: 8}})
	d, err := dump.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	tr, err := FromDump(d)
	if err != nil {
		t.Fatal(err)
	}
	// B appears first but hits A: A is placed before it.
	var order []string
	for _, q := range tr.Requests {
		order = append(order, q.ID)
	}
	if strings.Join(order, " ") != "A B C D E F" {
		t.Fatalf("arrival order %v", order)
	}
	cfg, err := ConfigFromDump(d)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Schedule.Window != 4 || len(cfg.Schedule.Ratios) != 3 {
		t.Fatalf("config %+v", cfg)
	}
	cfg.PageSize = 4
	rep, err := Run(tr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	checkWants(t, rep, []want{
		{"A", StatusAgree, "", "", ""},
		{"B", StatusDiverged, KindHitTooLong, "", "token 4 is 120 here, 101 there"},
		{"C", StatusAgree, "", "", ""},
		{"D", StatusUnchecked, "", "", "tok records start at position 4"},
		{"E", StatusUnchecked, "", "", `source request "Z" is not in the dump`},
		// E is not judged but is cached: F's hit on it agrees.
		{"F", StatusAgree, "", "", ""},
	})
	if rep.ExitCode() != 1 || rep.First.ID != "B" {
		t.Fatalf("exit %d first %+v", rep.ExitCode(), rep.First)
	}
}

func TestFromNativeDumpErrors(t *testing.T) {
	path := writeNative(t, [][2]string{{"A", "ab"}, {"B", "ab"}}, nil,
		[]dump.PrefixHit{{Request: "A", Source: "B", Tokens: 2}, {Request: "B", Source: "A", Tokens: 2}})
	d, err := dump.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := FromDump(d); err == nil || !strings.Contains(err.Error(), "cycle") {
		t.Fatalf("error %v", err)
	}
	path = writeNative(t, [][2]string{{"A", "ab"}}, nil,
		[]dump.PrefixHit{{Request: "A", Source: "B", Tokens: 2}, {Request: "A", Source: "C", Tokens: 1}})
	d2, err := dump.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	if _, err := FromDump(d2); err == nil || !strings.Contains(err.Error(), "second prefix hit") {
		t.Fatalf("error %v", err)
	}
}

func TestFromNativeDumpWithoutHits(t *testing.T) {
	path := writeNative(t, [][2]string{{"A", "abcdefgh"}, {"B", "abcdefgh"}}, nil, nil)
	d, err := dump.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	tr, err := FromDump(d)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := Run(tr, Config{PageSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Summary.Unchecked != 2 || rep.Diverged() || len(rep.Notes) != 1 || rep.Requests[1].Truth.Tokens != 8 {
		t.Fatalf("%+v %v", rep.Summary, rep.Notes)
	}
}

// A long chain of prefix hits (each request reused the one before) is placed
// without recursion: under a 1 MiB stack limit, a recursive placement of
// 20,000 chained hits overflows the stack (a fatal error, not a test
// failure).
func TestFromDumpLongHitChain(t *testing.T) {
	defer debug.SetMaxStack(debug.SetMaxStack(1 << 20))
	const n = 20000
	d := &dump.Dump{Path: "chain.smd"}
	// Newest first: r<n> reused r<n-1>, ..., r1 reused r0, which reused
	// nothing.
	for i := n; i >= 1; i-- {
		d.Prefix = append(d.Prefix, dump.PrefixHit{Request: "r" + strconv.Itoa(i), Source: "r" + strconv.Itoa(i-1), Tokens: 1})
	}
	d.Prefix = append(d.Prefix, dump.PrefixHit{Request: "r0"})
	tr, err := FromDump(d)
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.Requests) != n+1 {
		t.Fatalf("%d requests, want %d", len(tr.Requests), n+1)
	}
	for i, q := range tr.Requests {
		if want := "r" + strconv.Itoa(i); q.ID != want {
			t.Fatalf("request %d is %q, want %q (every source before its request)", i, q.ID, want)
		}
	}
	// Closing the chain into a cycle is still an error.
	d.Prefix[n] = dump.PrefixHit{Request: "r0", Source: "r" + strconv.Itoa(n), Tokens: 1}
	if _, err := FromDump(d); err == nil || !strings.Contains(err.Error(), "prefix hits form a cycle") {
		t.Fatalf("error %v", err)
	}
}
