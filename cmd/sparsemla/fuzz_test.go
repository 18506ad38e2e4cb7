package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"hash/crc32"
	"math"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/fault"
	"sparsemla/replay"
)

// FuzzReplay fuzzes what the replay does with hostile dump content. An
// input is a scope byte and a program of 4-byte edits applied to the
// records of a small clean synthetic dump: flip data bytes, write NaN/inf
// or extreme integers, reshape, change the dtype, move a record to another
// step/layer/stage/request, drop it, edit a KV page's layout/id/block
// table, add prefix-hit frames. The dump is encoded in memory (by
// dump.Writer: the frames of records no edit touched are the Writer's
// frames of the base dump), opened from those bytes by dump.OpenReaderAt
// (the reader dump.Open uses for a .smd file: the same checks and errors)
// and replayed (local or propagated, by the scope byte's top bit:
// fuzzScope) on a model loaded once (replay.LoadOptions.From: the weights
// are loaded and packed before the fuzzing, everything made from the dump
// — config, RoPE tables, layer and shape checks — is made from each
// execution's dump). Whatever the dump holds:
//   - nothing panics (nor recovers into replay's "internal error"), and no stage owes a skipped result to a recovered
//     runtime panic (a reason naming "runtime error" means a stage trusted
//     a dumped shape it should have checked);
//   - an error is one line (as the CLI prints it, exit 2);
//   - a report's exit code, verdict, summary and first divergence agree:
//     exit 0/1/3 for "agree"/"diverged"/"incomplete"; "diverged" ⇔ a
//     first divergence, which names the first failing stage when there
//     is one (a failing stage is always "diverged"); "agree" only with a
//     complete coverage;
//   - the replay is deterministic: a second replay of the same dump on the
//     same model gives the same JSON (--json's, without its indentation),
//     byte for byte, and so the model was not changed by the first;
//     checked on every eighth input (by a checksum of its bytes, so that a
//     failing input fails again), as it doubles an execution's time; the
//     other inputs are not encoded as JSON.
//
// The model is the smallest the engine replays every stage and page record
// of (fuzzReplayCfg), loaded once: its dims are the smallest the config
// validation and the v4-model1 page layout allow (dim, q_lora_rank and
// o_lora_rank 128, one head, head_dim 512), so a smaller model is no lever.
// An execution cost about 2 ms of CPU on the seeds (BenchmarkFuzzReplayExec)
// and 2.7 ms under -fuzz instrumentation, where every comparison and loop
// test is a call; the replay's hot loops now do less of that (CompareFloat's
// whole-tensor path for identical tensors, four-a-turn f32/bf16 decoding, a
// local unit's judged records not decoded again as inputs, the RoPE
// hypotheses built only for a failing table, the ModelArgs parse reused) and
// the multi-unit scopes are rarer (fuzzScope). Measured with .ci/run's flags
// on a prebuilt -fuzz binary and an empty fuzz cache, on the shared 2-core
// machine at load 8-9: 290-340 executions a CPU-second (245-265 before),
// 3.2-4.2k executions in 10 s (2.2-3.1k before); ~6-7k idle (4.3-5.3k):
// what is left is the replay itself (the stages computed and compared, the
// frames' msgpack decoded, the r = 128 compressor states allocated) and the
// determinism check. So .ci/run gives this target four times the others'
// budget (40 s at the default FUZZTIME) and holds it to the same minimum of
// 10k executions as every other target.
// fuzz: budget 4x (see above: an execution replays a whole dump)
func FuzzReplay(f *testing.F) {
	for _, seed := range fuzzReplaySeeds() {
		f.Add(seed)
	}
	exec := fuzzReplayExec(f)
	f.Fuzz(func(t *testing.T, prog []byte) { exec(t, prog) })
}

// fuzzScope decodes an input's scope byte: the layer kept (-1: all
// three), the decode steps kept (0 the first, 1 the second, -1 both) and
// the mode. Bits 0-1: 0 SWA, 1 CSA, 2 HCA, 3 all layers when bits 4 and 6
// are set (else CSA); bits 2-3: 0 and 2 the first step, 1 the second, 3
// both when bits 5 and 6 are set (else the second); bit 7 propagated mode.
// One step of one layer, the cheap case, is 225 in 256 inputs; a whole
// layer of two steps or all three layers cost 2-6 times as much and are
// one in sixteen each (one in eight before: the cost of an average input
// fell by a fifth).
func fuzzScope(scope byte) (layer, step int, mode replay.Mode) {
	layer, step, mode = int(scope&3), int(scope>>2&3), replay.Local
	if layer == 3 {
		layer = 1
		if scope&0x50 == 0x50 {
			layer = -1
		}
	}
	switch step {
	case 2:
		step = 0
	case 3:
		step = 1
		if scope&0x60 == 0x60 {
			step = -1
		}
	}
	if scope&0x80 != 0 {
		mode = replay.Propagated
	}
	return layer, step, mode
}

// fuzzReplaySeeds are FuzzReplay's seed inputs: every scope (fuzzScope),
// then programs of edits.
func fuzzReplaySeeds() [][]byte {
	var seeds [][]byte
	for _, scope := range []byte{0, 1, 2, 0x53, 4, 5, 6, 0x6c, 0x6d, 0x6e, 0x7f, 0x80, 0x81, 0x82, 0xec, 0xed, 0xee} {
		seeds = append(seeds, []byte{scope})
	}
	return append(seeds,
		[]byte{1, 0, 10, 3, 200},
		[]byte{0x81, 1, 40, 0, 5, 1, 41, 1, 9},
		[]byte{2, 2, 7, 1, 3, 2, 90, 0, 0},
		[]byte{1, 3, 12, 5, 1, 4, 13, 2, 2},
		[]byte{0x53, 5, 77, 0, 1, 6, 3, 0, 0, 7, 100, 1, 1},
		[]byte{1, 6, 30, 9, 0, 6, 31, 14, 1, 6, 32, 20, 2},
		[]byte{0, 8, 250, 0, 3, 8, 251, 2, 200, 8, 252, 3, 1},
		[]byte{0x81, 9, 0, 1, 7, 9, 0, 2, 19, 10, 20, 1, 1},
	)
}

// fuzzReplayExec prepares FuzzReplay (the base dump and its model, loaded
// once) and returns one execution.
func fuzzReplayExec(tb testing.TB) func(t testing.TB, prog []byte) {
	base := fuzzReplayBase(tb)
	fr := newFrameCache(tb, base)
	// The live heap is a few MiB and an execution allocates about as much:
	// at the default GOGC the collector ran several times an execution
	// (GOGC 1000: 10-15 % of an execution less); the memory limit bounds
	// the heap that lets grow.
	gc, limit := debug.SetGCPercent(1000), debug.SetMemoryLimit(512<<20)
	tb.Cleanup(func() { debug.SetGCPercent(gc); debug.SetMemoryLimit(limit) })
	var (
		recs  []dump.Record
		idx   []int // base index of recs[i]
		owned = map[int]bool{}
		drop  = map[int]bool{}
		seen  = map[recID]bool{}
		out   []byte
	)
	return func(t testing.TB, prog []byte) {
		if len(prog) == 0 || len(prog) > 65 {
			return
		}
		layer, step, mode := fuzzScope(prog[0])
		edits := prog[1:]
		recs, idx = recs[:0], idx[:0]
		for i, r := range base.recs {
			if layer >= 0 && r.Layer != dump.Global && r.Layer != layer {
				continue
			}
			if step >= 0 && r.Kind == dump.KindStage && r.Step != base.first+step {
				continue
			}
			recs, idx = append(recs, r), append(idx, i)
		}
		prefix := append([]dump.PrefixHit(nil), base.prefix...)
		// The records share the base's bytes until an edit touches one:
		// it is then copied first (own).
		clear(owned)
		clear(drop)
		own := func(i int) {
			if owned[i] {
				return
			}
			owned[i] = true
			r := &recs[i]
			r.Data = append([]byte(nil), r.Data...)
			r.Shape = append([]int(nil), r.Shape...)
			if r.Page != nil {
				pg := *r.Page
				pg.BlockTable = append([]int(nil), pg.BlockTable...)
				r.Page = &pg
			}
		}
		for i := 0; i+3 < len(edits); i += 4 {
			op, ri, a, b := edits[i], int(edits[i+1])*len(recs)/256, int(edits[i+2]), int(edits[i+3])
			if op%11 == 9 { // add a prefix-hit frame
				prefix = append(prefix, dump.PrefixHit{Request: []string{"", "A", "B"}[a%3], Source: []string{"", "A", "B", "C"}[b%4], Tokens: b%24 - 2})
				continue
			}
			own(ri)
			mutate(&recs[ri], op%11, a, b, drop, ri)
		}
		// The dump as one dump.Writer writes these records in this order
		// (it refuses invalid records and duplicate keys: they are
		// skipped): a record no edit touched is its frame as the Writer
		// wrote it for the base dump; an edited one and the prefix hits are
		// written by a Writer now.
		out = append(out[:0], fr.header...)
		clear(seen)
		var w *frameWriter // made at the first edited record or prefix hit
		n := 0
		for i := range recs {
			r := &recs[i]
			id := recID{r.Key, r.Kind}
			if drop[i] || seen[id] {
				continue
			}
			if owned[i] {
				if w == nil {
					w = fr.writer(t)
				}
				f, err := w.record(r)
				if err != nil {
					continue
				}
				out = append(out, f...)
			} else {
				out = append(out, fr.frames[idx[i]]...)
			}
			seen[id] = true
			n++
		}
		for _, ph := range prefix {
			if w == nil {
				w = fr.writer(t)
			}
			if f, err := w.prefix(ph); err == nil {
				out = append(out, f...)
			}
		}
		out = append(out, fr.end(t, n)...)
		// Every eighth input (by a checksum of its bytes, so that a
		// failing input fails again) is replayed twice, with its JSON.
		twice := crc32.ChecksumIEEE(prog)%8 == 0
		code, rep, js, e := fuzzReplayOnce(out, base.model, mode, twice)
		if code == exitError {
			if strings.Count(strings.TrimRight(e, "\n"), "\n") != 0 {
				t.Fatalf("exit 2 with %d stderr lines:\n%s", strings.Count(e, "\n"), e)
			}
			if strings.Contains(e, "internal error") {
				t.Fatalf("a replay unit panicked (recovered into exit 2): %s", e)
			}
			return
		}
		texts := []string{}
		for _, r := range rep.Results {
			texts = append(texts, r.Reason)
		}
		if d := rep.First; d != nil {
			texts = append(append(texts, d.Why, d.Text), d.Detail...)
		}
		for _, s := range texts {
			if strings.Contains(s, "runtime error") {
				t.Fatalf("a stage recovered from a runtime panic on dumped data: %s", s)
			}
		}
		firstFail := -1
		for i, r := range rep.Results {
			if r.Status == replay.StatusFail {
				firstFail = i
				break
			}
		}
		diverged := rep.Verdict == replay.VerdictDiverged
		want := map[string]int{replay.VerdictAgree: exitOK, replay.VerdictDiverged: exitDiverged, replay.VerdictIncomplete: exitIncomplete}
		switch wantCode, ok := want[rep.Verdict]; {
		case !ok:
			t.Fatalf("verdict %q", rep.Verdict)
		case code != wantCode:
			t.Fatalf("exit %d with verdict %q", code, rep.Verdict)
		case (rep.Summary.Fail > 0 || firstFail >= 0) && !diverged:
			t.Fatalf("verdict %q with %d failing stages (first at %d)", rep.Verdict, rep.Summary.Fail, firstFail)
		case diverged != (rep.First != nil):
			t.Fatalf("verdict %q with first divergence %v", rep.Verdict, rep.First)
		case rep.Verdict == replay.VerdictAgree && !rep.Coverage.Complete:
			t.Fatalf("verdict agree with an incomplete coverage")
		}
		if firstFail >= 0 {
			ff := rep.Results[firstFail]
			if d := rep.First; d.Step != ff.Step || d.Layer != ff.Layer || d.Stage != ff.Stage {
				t.Fatalf("first divergence at step %d layer %d stage %s, the first failing stage is step %d layer %d stage %s",
					d.Step, d.Layer, d.Stage, ff.Step, ff.Layer, ff.Stage)
			}
		}
		if !twice {
			return
		}
		code2, _, js2, e2 := fuzzReplayOnce(out, base.model, mode, true)
		if code2 != code || js2 != js || e2 != e {
			t.Fatalf("a second replay of the same dump differs: exit %d then %d, stderr %q then %q, reports equal: %v", code, code2, e, e2, js == js2)
		}
	}
}

// fuzzReplayOnce does what 'sparsemla replay --json --mode MODE DUMP'
// does after parsing its flags (rpOpenDump, replay.Run, rpExit, rpFail) for
// a native dump file holding b, with the layer weights taken from m
// instead of the weights file. The report comes back (nil for exit 2),
// with its JSON (less the indentation) as stdout when asJSON.
func fuzzReplayOnce(b []byte, m *engine.Model, mode replay.Mode, asJSON bool) (code int, rep *replay.Report, stdout, stderr string) {
	var out, errw bytes.Buffer
	fail := func(err error) (int, *replay.Report, string, string) {
		return rpFail(&errw, "replay", err), nil, out.String(), errw.String()
	}
	d, err := dump.OpenReaderAt("dump.smd", bytes.NewReader(b), int64(len(b)))
	if err != nil {
		return fail(err)
	}
	src, err := replay.NewDumpSource(d, "")
	if err != nil {
		return fail(err)
	}
	model, err := replay.LoadModelWith(d, src, replay.LoadOptions{From: m})
	if err != nil {
		return fail(err)
	}
	tol := replay.DefaultTolerance()
	if mode == replay.Propagated {
		tol = replay.PropagatedTolerance()
	}
	rep, err = replay.Run(context.Background(), model, src, replay.Options{Mode: mode, Tol: tol})
	if err != nil {
		return fail(err)
	}
	if asJSON {
		// The report's JSON as --json prints it, less its indentation
		// (appendIndent was two thirds of the encoding's time).
		if err := json.NewEncoder(&out).Encode(rep); err != nil {
			return fail(err)
		}
	}
	return rpExit(rep), rep, out.String(), errw.String()
}

// recID is a record's (key, kind): the dump's unique index.
type recID struct {
	dump.Key
	Kind dump.Kind
}

// frameCache holds the base dump as dump.Writer wrote it, cut into frames
// (the file header and header frame, one frame per record), and the end
// frames by record count; a frameWriter writes the frames of edited
// records and prefix hits. The Writer stays the only encoder of the
// format: a frame is cut out of its output by flushing the buffer it
// writes into (a bufio.Writer of its own size, which dump.NewWriter takes
// as its buffer) after each call.
type frameCache struct {
	head   dump.Header
	header []byte
	frames [][]byte
	ends   map[int][]byte
	fw     *frameWriter
}

func newFrameCache(tb testing.TB, base *fuzzReplayBaseDump) *frameCache {
	fc := &frameCache{head: base.header, ends: map[int][]byte{}}
	fw, err := newFrameWriter(base.header)
	if err != nil {
		tb.Fatal(err)
	}
	fc.header = bytes.Clone(fw.buf.Bytes())
	for i := range base.recs {
		f, err := fw.record(&base.recs[i])
		if err != nil {
			tb.Fatalf("base record %d: %v", i, err)
		}
		fc.frames = append(fc.frames, bytes.Clone(f))
	}
	end, err := fw.close()
	if err != nil {
		tb.Fatal(err)
	}
	fc.ends[len(base.recs)] = bytes.Clone(end)
	// The cut is exact: the frames put together are the Writer's file.
	var whole bytes.Buffer
	w, err := dump.NewWriter(&whole, base.header)
	if err != nil {
		tb.Fatal(err)
	}
	for i := range base.recs {
		if err := w.Write(&base.recs[i]); err != nil {
			tb.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		tb.Fatal(err)
	}
	if got := slices.Concat(append([][]byte{fc.header}, append(fc.frames, end)...)...); !bytes.Equal(got, whole.Bytes()) {
		tb.Fatalf("the base dump cut into frames (%d bytes) is not the Writer's file (%d bytes)", len(got), whole.Len())
	}
	return fc
}

// writer returns a new frameWriter for this execution's edited records,
// made in the storage of the previous execution's.
func (fc *frameCache) writer(tb testing.TB) *frameWriter {
	if fc.fw == nil {
		fc.fw = &frameWriter{}
		fc.fw.bw = bufio.NewWriterSize(&fc.fw.buf, 1<<20)
	}
	if err := fc.fw.reset(fc.head); err != nil {
		tb.Fatal(err)
	}
	return fc.fw
}

// end is the end frame of a file of n tensor records.
func (fc *frameCache) end(tb testing.TB, n int) []byte {
	if f, ok := fc.ends[n]; ok {
		return f
	}
	fw, err := newFrameWriter(fc.head)
	if err != nil {
		tb.Fatal(err)
	}
	for i := range n {
		r := dump.Record{Key: dump.Key{Step: i, Layer: dump.Global, Stage: "x"}, Kind: dump.KindStage, DType: dump.U8, Shape: []int{1}, Data: []byte{0}}
		if _, err := fw.record(&r); err != nil {
			tb.Fatal(err)
		}
	}
	f, err := fw.close()
	if err != nil {
		tb.Fatal(err)
	}
	fc.ends[n] = bytes.Clone(f)
	return fc.ends[n]
}

// frameWriter is a dump.Writer whose every frame can be cut out of its
// output: buf[:len] after NewWriter is the file header and header frame,
// and each call returns the bytes its frame added (valid until the next
// call).
type frameWriter struct {
	buf bytes.Buffer
	bw  *bufio.Writer
	w   *dump.Writer
}

func newFrameWriter(h dump.Header) (*frameWriter, error) {
	fw := &frameWriter{}
	fw.bw = bufio.NewWriterSize(&fw.buf, 1<<20) // dump.NewWriter's own size: it writes into bw
	return fw, fw.reset(h)
}

// reset starts a new file of header h.
func (fw *frameWriter) reset(h dump.Header) error {
	fw.buf.Reset()
	fw.bw.Reset(&fw.buf)
	w, err := dump.NewWriter(fw.bw, h)
	if err != nil {
		return err
	}
	fw.w = w
	return fw.bw.Flush()
}

// cut runs one call of the Writer and returns the bytes it wrote.
func (fw *frameWriter) cut(call func() error) ([]byte, error) {
	if err := fw.bw.Flush(); err != nil {
		return nil, err
	}
	start := fw.buf.Len()
	if err := call(); err != nil {
		return nil, err
	}
	if err := fw.bw.Flush(); err != nil {
		return nil, err
	}
	return fw.buf.Bytes()[start:], nil
}

func (fw *frameWriter) record(r *dump.Record) ([]byte, error) {
	return fw.cut(func() error { return fw.w.Write(r) })
}

func (fw *frameWriter) prefix(p dump.PrefixHit) ([]byte, error) {
	return fw.cut(func() error { return fw.w.WritePrefix(p) })
}

func (fw *frameWriter) close() ([]byte, error) { return fw.cut(fw.w.Close) }

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
	case 8: // edit a KV page's meta: layout, page id, block size, block table
		if r.Page == nil {
			return
		}
		switch a % 4 {
		case 0:
			r.Page.Layout = []string{dump.LayoutV4Model1, dump.LayoutV32, dump.LayoutIndexerFP8, dump.LayoutMXFP4, "bf16", "", "v9"}[b%7]
		case 1:
			r.Page.PageID = b%8 - 2
		case 2:
			r.Page.BlockSize = []int{0, 1, 4, 63, 64, 65, 128, -1}[b%8]
		case 3:
			if len(r.Page.BlockTable) > 0 && b%2 == 0 {
				r.Page.BlockTable[b/2%len(r.Page.BlockTable)] = b%9 - 3
			} else {
				r.Page.BlockTable = append(r.Page.BlockTable, b%9-3)
			}
		}
	case 10: // move the record to another request
		r.Request = []string{"", "A", "B", "C"}[b%4]
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

// fuzzReplayCfg is the smallest model whose every stage and KV page record
// the replay runs: the tiny preset with one query and one indexer head,
// 128-wide projections (the FP8 activation block), a 4-token window, top-2
// selection and 16 positions; three layers, one of each kind (SWA, CSA,
// HCA). head_dim stays 512: the v4-model1 KV pages the dump carries have
// 448 FP8 + 64 bf16 values per entry.
func fuzzReplayCfg() *engine.Config {
	c, err := engine.Preset("tiny")
	if err != nil {
		panic(err)
	}
	c.Dim, c.NHeads, c.QLoraRank, c.OGroups, c.OLoraRank = 128, 1, 128, 1, 128
	c.WindowSize, c.IndexNHeads, c.IndexTopK, c.MaxSeqLen = 4, 1, 2, 16
	c.NLayers, c.CompressRatios = 3, []int{0, 4, 128}
	return c
}

type fuzzReplayBaseDump struct {
	header dump.Header
	recs   []dump.Record
	prefix []dump.PrefixHit
	first  int           // the first decode step
	model  *engine.Model // loaded once from the dump's weights, as the CLI does (prepared)
}

// fuzzReplayBase is a clean synthetic dump of fuzzReplayCfg, two decode
// steps (11, an emission step of the CSA layer with 3 compressed rows for
// its top-2, and 12), read into memory, and its model.
func fuzzReplayBase(f testing.TB) *fuzzReplayBaseDump {
	f.Helper()
	const prefill = 11
	s, err := fault.Synthesize(fault.SynthOptions{Cfg: fuzzReplayCfg(), PageBlock: 4, Steps: 2, Prefill: prefill, Seed: 5})
	if err != nil {
		f.Fatal(err)
	}
	dir := filepath.Join(f.TempDir(), "base")
	if err := s.Write(dir); err != nil {
		f.Fatal(err)
	}
	h, recs, prefix := readAll(f, filepath.Join(dir, fault.SynthDumpFile))
	d, err := dump.Open(dir)
	if err != nil {
		f.Fatal(err)
	}
	defer d.Close()
	src, err := replay.NewDumpSource(d, "")
	if err != nil {
		f.Fatal(err)
	}
	m, err := replay.LoadModelWith(d, src, replay.LoadOptions{Prepared: true})
	if err != nil {
		f.Fatal(err)
	}
	rep, err := replay.Run(context.Background(), m, src, replay.Options{})
	if err != nil || rep.Diverged() {
		f.Fatalf("the clean base dump does not replay clean: %v %v", err, rep.First)
	}
	return &fuzzReplayBaseDump{header: h, recs: recs, prefix: prefix, first: prefill, model: m}
}

// BenchmarkFuzzReplayExec is one FuzzReplay execution on its seed inputs
// in turn (the fuzzer's cost of an execution, without its instrumentation).
func BenchmarkFuzzReplayExec(b *testing.B) {
	exec := fuzzReplayExec(b)
	seeds := fuzzReplaySeeds()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		exec(b, seeds[i%len(seeds)])
	}
}
