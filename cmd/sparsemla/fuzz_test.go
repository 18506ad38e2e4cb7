package main

import (
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"sparsemla/dump"
)

// FuzzReplay mutates the records of a small clean synthetic dump (a program
// of byte-coded edits: flip data bytes, write NaN/inf, reshape, change the
// dtype, move a record to another step/layer/stage, drop it) and replays the
// result through the CLI in local and propagated mode. Whatever the dump
// holds, the command must end with exit 0, 1 or 2, never panic, print one
// error line for exit 2, and never owe a skipped stage to a recovered
// runtime panic (a reason naming "runtime error" means a stage trusted a
// dumped shape it should have checked).
//
// Each execution writes and replays a whole synthetic dump (about 100 ms:
// the weights are loaded and packed every time), so the target runs 13 to
// 60 executions in .ci/run's 10 s on the 2-core VM (the baseline coverage
// of its corpus takes 2-6 s of it), not the 10k of the decoders: it is a
// smoke test of the replay on mutated dumps, not a fuzzer that explores;
// its own minimum only says that it executed at all:
// fuzz: min-execs 5
func FuzzReplay(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{0, 10, 3, 200})
	f.Add([]byte{1, 40, 0, 5, 1, 41, 1, 9})
	f.Add([]byte{2, 7, 1, 3, 2, 90, 0, 0})
	f.Add([]byte{3, 12, 5, 1, 4, 13, 2, 2})
	f.Add([]byte{5, 77, 0, 1, 6, 3, 0, 0, 7, 100, 1, 1})
	f.Add([]byte{6, 30, 9, 0, 6, 31, 14, 1, 6, 32, 20, 2})
	base := fuzzBase(f)
	dir := f.TempDir()
	for _, n := range []string{"config.json", "weights.safetensors"} {
		if err := os.Symlink(filepath.Join(base.dir, n), filepath.Join(dir, n)); err != nil {
			f.Fatal(err)
		}
	}
	f.Fuzz(func(t *testing.T, prog []byte) {
		if len(prog) > 64 {
			return
		}
		recs := make([]dump.Record, len(base.recs))
		for i, r := range base.recs {
			r.Data = append([]byte(nil), r.Data...)
			r.Shape = append([]int(nil), r.Shape...)
			recs[i] = r
		}
		drop := map[int]bool{}
		for i := 0; i+3 < len(prog); i += 4 {
			op, ri, a, b := prog[i], int(prog[i+1])*len(recs)/256, int(prog[i+2]), int(prog[i+3])
			mutate(&recs[ri], op%8, a, b, drop, ri)
		}
		p := filepath.Join(dir, "dump.smd")
		w, err := dump.Create(p, base.header)
		if err != nil {
			t.Fatal(err)
		}
		for i := range recs {
			if drop[i] {
				continue
			}
			_ = w.Write(&recs[i]) // the writer refuses invalid records and duplicate keys: skip them
		}
		for _, ph := range base.prefix {
			_ = w.WritePrefix(ph)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		mode := "local"
		if len(prog) > 0 && prog[0]&0x80 != 0 {
			mode = "propagated"
		}
		code, out, e := rpRun("replay", "--json", "--mode", mode, dir)
		if code < 0 || code > 3 {
			t.Fatalf("exit %d", code)
		}
		if strings.Contains(e, "goroutine ") || strings.Contains(e, "panic") {
			t.Fatalf("panic:\n%s", e)
		}
		if code == exitError && strings.Count(strings.TrimRight(e, "\n"), "\n") != 0 {
			t.Fatalf("exit 2 with %d stderr lines:\n%s", strings.Count(e, "\n"), e)
		}
		if code != exitError && strings.Contains(out, "runtime error") {
			i := strings.Index(out, "runtime error")
			t.Fatalf("a stage recovered from a runtime panic on dumped data: ...%s...", out[max(0, i-200):min(len(out), i+200)])
		}
	})
}

// mutate applies one coded edit to r.
func mutate(r *dump.Record, op byte, a, b int, drop map[int]bool, idx int) {
	switch op {
	case 0: // flip a data byte
		if len(r.Data) > 0 {
			r.Data[(a*257+b)%len(r.Data)] ^= byte(1 << (b % 8))
		}
	case 1: // write NaN or inf into an element
		sz := r.DType.Bits() / 8
		if sz == 0 || len(r.Data) < sz {
			return
		}
		at := (a * 131 % (len(r.Data) / sz)) * sz
		switch r.DType {
		case dump.BF16:
			binary.LittleEndian.PutUint16(r.Data[at:], []uint16{0x7fc0, 0x7f80, 0xff80}[b%3])
		case dump.F32:
			binary.LittleEndian.PutUint32(r.Data[at:], math.Float32bits([]float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))}[b%3]))
		case dump.I32:
			binary.LittleEndian.PutUint32(r.Data[at:], uint32([]int32{-1, math.MaxInt32, math.MinInt32}[b%3]))
		case dump.I64:
			binary.LittleEndian.PutUint64(r.Data[at:], uint64([]int64{-1, math.MaxInt64, math.MinInt64}[b%3]))
		default:
			r.Data[at] = 0xff
		}
	case 2: // change one dimension (data resized to match)
		if len(r.Shape) == 0 {
			return
		}
		d := a % len(r.Shape)
		r.Shape[d] = b % 160
		resize(r)
	case 3: // add or remove a leading dimension
		if a%2 == 0 && len(r.Shape) > 0 {
			r.Shape = r.Shape[1:]
		} else {
			r.Shape = append([]int{1 + b%3}, r.Shape...)
		}
		resize(r)
	case 4: // change the dtype (data resized)
		dts := []dump.DType{dump.F32, dump.BF16, dump.F16, dump.I32, dump.I64, dump.U8, dump.E4M3, dump.FP4}
		r.DType = dts[a%len(dts)]
		resize(r)
	case 5: // move the record to another step or layer
		if a%2 == 0 {
			r.Step += b%5 - 2
		} else {
			r.Layer = b%6 - 1
		}
	case 6: // rename the stage to another canonical one
		st := dump.Stages
		r.Stage = st[(a*7+b)%len(st)].Name
	case 7: // drop the record
		drop[idx] = true
	}
}

// resize fits r.Data to r.Shape (zero-extended or cut); an FP4 shape with an
// odd element count is made even.
func resize(r *dump.Record) {
	n, err := dump.NumElements(r.Shape)
	if err != nil || n > 1<<22 {
		r.Shape = []int{1}
		n = 1
	}
	if r.DType == dump.FP4 && n%2 == 1 {
		r.Shape = append(r.Shape, 2)
		n *= 2
	}
	want, err := r.DType.ByteLen(n)
	if err != nil {
		return
	}
	data := make([]byte, want)
	copy(data, r.Data)
	r.Data = data
}

type fuzzBaseDump struct {
	dir    string
	header dump.Header
	recs   []dump.Record
	prefix []dump.PrefixHit
}

var (
	fuzzBaseOnce sync.Once
	fuzzBaseVal  fuzzBaseDump
)

// fuzzBase is a clean synthetic dump of two decode steps (7 and 8: an
// emission step of the ratio-4 layers and the one after), read into memory.
func fuzzBase(f *testing.F) *fuzzBaseDump {
	f.Helper()
	fuzzBaseOnce.Do(func() {
		dir := filepath.Join(f.TempDir(), "base")
		if code, _, e := rpRun("synth", "--out", dir, "--steps", "2", "--prefill", "7", "--seed", "5"); code != exitOK {
			f.Fatal("synth: " + e)
		}
		h, recs, prefix := readAll(f, filepath.Join(dir, "dump.smd"))
		fuzzBaseVal = fuzzBaseDump{dir: dir, header: h, recs: recs, prefix: prefix}
	})
	return &fuzzBaseVal
}
