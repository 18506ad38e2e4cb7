package prefixcheck

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

var update = flag.Bool("update", false, "rewrite the event-stream fixtures in testdata/prefixcheck")

const fixtureDir = "../testdata/prefixcheck"

// An encoder of KV-cache events written from vLLM's source
// (vllm/distributed/kv_events.py at commit 0181ea3173e53eea8cf04a86891488e3dc89bb34:
// EventBatch and the tag=True KVCacheEvent structs without array_like, so
// msgspec writes maps, the tag first as "type", fields in declaration order,
// fields equal to their default omitted) and from SGLang's
// (python/sglang/srt/disaggregation/kv_events.py at commit
// 006d053f182f9b488d2bd841afa06d5f9120a258: array_like=True everywhere, so an
// event is [tag, field, ...] and a batch [ts, events]).

type stored struct {
	hashes   []int64
	parent   *int64
	tokens   []int64
	bs       int
	loraID   *int64
	loraName *string
	medium   string
	extra    []string // per block: one string in a 1-tuple, "" for None; nil: no extra_keys
}

type removed struct {
	hashes []int64
	medium string
}

type cleared struct{}

func p64(v int64) *int64    { return &v }
func pstr(s string) *string { return &s }

type evEnc struct {
	buf bytes.Buffer
	e   *msgpack.Encoder
}

func newEvEnc() *evEnc {
	x := &evEnc{}
	x.e = msgpack.NewEncoder(&x.buf)
	return x
}

func (x *evEnc) must(err error) {
	if err != nil {
		panic(err)
	}
}

func (x *evEnc) ints(v []int64) {
	x.must(x.e.EncodeArrayLen(len(v)))
	for _, n := range v {
		x.must(x.e.EncodeInt(n))
	}
}

func (x *evEnc) optInt(v *int64) {
	if v == nil {
		x.must(x.e.EncodeNil())
	} else {
		x.must(x.e.EncodeInt(*v))
	}
}

func (x *evEnc) optStr(v *string) {
	if v == nil {
		x.must(x.e.EncodeNil())
	} else {
		x.must(x.e.EncodeString(*v))
	}
}

// vllmEvent writes one event the way msgspec encodes vLLM's structs.
func (x *evEnc) vllmEvent(ev any) {
	switch ev := ev.(type) {
	case stored:
		n := 8
		if ev.extra != nil {
			n++
		}
		x.must(x.e.EncodeMapLen(n))
		x.must(x.e.EncodeString("type"))
		x.must(x.e.EncodeString("BlockStored"))
		x.must(x.e.EncodeString("block_hashes"))
		x.ints(ev.hashes)
		x.must(x.e.EncodeString("parent_block_hash"))
		x.optInt(ev.parent)
		x.must(x.e.EncodeString("token_ids"))
		x.ints(ev.tokens)
		x.must(x.e.EncodeString("block_size"))
		x.must(x.e.EncodeInt(int64(ev.bs)))
		x.must(x.e.EncodeString("lora_id"))
		x.optInt(ev.loraID)
		x.must(x.e.EncodeString("medium"))
		x.must(x.e.EncodeString(ev.medium))
		x.must(x.e.EncodeString("lora_name"))
		x.optStr(ev.loraName)
		if ev.extra != nil {
			x.must(x.e.EncodeString("extra_keys"))
			x.must(x.e.EncodeArrayLen(len(ev.extra)))
			for _, k := range ev.extra {
				if k == "" {
					x.must(x.e.EncodeNil())
					continue
				}
				x.must(x.e.EncodeArrayLen(1))
				x.must(x.e.EncodeString(k))
			}
		}
	case removed:
		x.must(x.e.EncodeMapLen(3))
		x.must(x.e.EncodeString("type"))
		x.must(x.e.EncodeString("BlockRemoved"))
		x.must(x.e.EncodeString("block_hashes"))
		x.ints(ev.hashes)
		x.must(x.e.EncodeString("medium"))
		x.must(x.e.EncodeString(ev.medium))
	case cleared:
		x.must(x.e.EncodeMapLen(1))
		x.must(x.e.EncodeString("type"))
		x.must(x.e.EncodeString("AllBlocksCleared"))
	}
}

func (x *evEnc) vllmBatch(ts float64, evs ...any) {
	x.must(x.e.EncodeMapLen(3))
	x.must(x.e.EncodeString("ts"))
	x.must(x.e.EncodeFloat64(ts))
	x.must(x.e.EncodeString("events"))
	x.must(x.e.EncodeArrayLen(len(evs)))
	for _, ev := range evs {
		x.vllmEvent(ev)
	}
	x.must(x.e.EncodeString("data_parallel_rank"))
	x.must(x.e.EncodeInt(0))
}

// sglangEvent writes one event as SGLang's array_like structs encode.
func (x *evEnc) sglangEvent(ev any) {
	switch ev := ev.(type) {
	case stored:
		x.must(x.e.EncodeArrayLen(6))
		x.must(x.e.EncodeString("BlockStored"))
		x.ints(ev.hashes)
		x.optInt(ev.parent)
		x.ints(ev.tokens)
		x.must(x.e.EncodeInt(int64(ev.bs)))
		x.optInt(ev.loraID)
	case removed:
		x.must(x.e.EncodeArrayLen(2))
		x.must(x.e.EncodeString("BlockRemoved"))
		x.ints(ev.hashes)
	case cleared:
		x.must(x.e.EncodeArrayLen(1))
		x.must(x.e.EncodeString("AllBlocksCleared"))
	}
}

func (x *evEnc) sglangBatch(ts float64, evs ...any) {
	x.must(x.e.EncodeArrayLen(2))
	x.must(x.e.EncodeFloat64(ts))
	x.must(x.e.EncodeArrayLen(len(evs)))
	for _, ev := range evs {
		x.sglangEvent(ev)
	}
}

func seqTok(from, n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = int64(from + i)
	}
	return out
}

func cat64(a ...[]int64) []int64 {
	var out []int64
	for _, x := range a {
		out = append(out, x...)
	}
	return out
}

// vllmFixture is the vLLM scenario (block size 4) and the verdict every
// BlockStored event must get.
func vllmFixture() ([]byte, []want) {
	S1, S2, S3 := seqTok(1000, 4), seqTok(2000, 4), seqTok(3000, 4)
	img := []int64{7, 7, 7, 7}
	x := newEvEnc()
	// A system prompt of three blocks.
	x.vllmBatch(1.0, stored{hashes: []int64{101, 102, 103}, tokens: cat64(S1, S2, S3), bs: 4, medium: "GPU"})
	// B shares two blocks (parent 102); C has the same tokens under a LoRA
	// adapter; a CPU-tier store is skipped.
	x.vllmBatch(2.0,
		stored{hashes: []int64{104}, parent: p64(102), tokens: seqTok(4000, 4), bs: 4, medium: "GPU"},
		stored{hashes: []int64{201, 202}, tokens: cat64(S1, S2), bs: 4, loraID: p64(1), loraName: pstr("sql-adapter"), medium: "GPU"},
		stored{hashes: []int64{901}, tokens: S1, bs: 4, medium: "CPU"})
	// The engine evicts A's last block, then builds on it.
	x.vllmBatch(3.0,
		removed{hashes: []int64{103}, medium: "GPU"},
		stored{hashes: []int64{105}, parent: p64(103), tokens: seqTok(5000, 4), bs: 4, medium: "GPU"})
	// E recomputes A's first block under another hash (a missed hit); F and G
	// store one hash with two contents; I and J: same image tokens, different
	// images.
	x.vllmBatch(4.0,
		stored{hashes: []int64{301}, tokens: S1, bs: 4, medium: "GPU"},
		stored{hashes: []int64{302}, parent: p64(101), tokens: seqTok(6000, 4), bs: 4, medium: "GPU"},
		stored{hashes: []int64{302}, parent: p64(101), tokens: seqTok(6100, 4), bs: 4, medium: "GPU"},
		stored{hashes: []int64{401, 402}, tokens: cat64(img, img), bs: 4, medium: "GPU", extra: []string{"mm-cat", "mm-cat"}},
		stored{hashes: []int64{403}, tokens: img, bs: 4, medium: "GPU", extra: []string{"mm-dog"}})
	// A cache reset, then a store on a block of the old cache.
	x.vllmBatch(5.0, cleared{},
		stored{hashes: []int64{501}, parent: p64(101), tokens: seqTok(7000, 4), bs: 4, medium: "GPU"})
	return x.buf.Bytes(), []want{
		{"b0.e0", StatusAgree, "", "", ""},
		{"b1.e0", StatusAgree, "", "", ""},
		{"b1.e1", StatusAgree, KindMissedHit, CauseNamespace, `request "b0.e0" of namespace ""`},
		{"b2.e1", StatusDiverged, KindEvicted, "", `page 2 (tokens [8, 12), cached by request "b0.e0") was evicted by the engine before request "b2.e1"`},
		{"b3.e0", StatusDiverged, KindMissedHit, CauseNone, "the correct cache held 4 resumable tokens"},
		{"b3.e1", StatusAgree, "", "", ""},
		{"b3.e2", StatusDiverged, KindOverwritten, "", `page id 302 (tokens [4, 8)) is stored with this request's content while it still holds request "b3.e1"'s`},
		{"b3.e3", StatusAgree, "", "", ""},
		{"b3.e4", StatusAgree, "", "", ""},
		{"b4.e1", StatusDiverged, KindEvicted, "", `evicted by the engine before request "b4.e1"`},
	}
}

func sglangFixture() ([]byte, []want) {
	x := newEvEnc()
	x.sglangBatch(10.5, stored{hashes: []int64{-5, 1 << 40}, tokens: seqTok(10, 4), bs: 2})
	// The same block stored again (a second copy); two removals evict it.
	x.sglangBatch(11.5, stored{hashes: []int64{1 << 40}, parent: p64(-5), tokens: []int64{12, 13}, bs: 2})
	x.sglangBatch(12.5, removed{hashes: []int64{1 << 40}}, removed{hashes: []int64{1 << 40}},
		stored{hashes: []int64{78}, parent: p64(1 << 40), tokens: []int64{90, 91}, bs: 2})
	return x.buf.Bytes(), []want{
		{"b0.e0", StatusAgree, "", "", ""},
		{"b1.e0", StatusWarn, KindMissedHit, CauseNone, "already cached with the same hash"},
		{"b2.e2", StatusDiverged, KindEvicted, "", "evicted by the engine"},
	}
}

// sglangPerPageFixture: SGLang before PR #13488 (per-page hashes, Python's
// hash of one page's tokens; one BlockStored per page, its parent the hash
// of the page before, hash(()) under the root), page size 1. The prompt
// 5 7 5 9 holds page "5" at two places: the third store is no overwritten
// page, and the fourth, whose parent hash two cached pages have, cannot be
// placed (unchecked). Then 7 alone from the root.
func sglangPerPageFixture() ([]byte, []want) {
	h5, h7, h9, root := ppHash(5), ppHash(7), ppHash(9), ppHash()
	x := newEvEnc()
	x.sglangBatch(1, stored{hashes: []int64{h5}, parent: p64(root), tokens: []int64{5}, bs: 1},
		stored{hashes: []int64{h7}, parent: p64(h5), tokens: []int64{7}, bs: 1},
		stored{hashes: []int64{h5}, parent: p64(h7), tokens: []int64{5}, bs: 1},
		stored{hashes: []int64{h9}, parent: p64(h5), tokens: []int64{9}, bs: 1})
	x.sglangBatch(2, stored{hashes: []int64{h7}, parent: p64(root), tokens: []int64{7}, bs: 1})
	return x.buf.Bytes(), []want{
		{"b0.e0", StatusAgree, "", "", ""},
		{"b0.e1", StatusAgree, "", "", ""},
		{"b0.e2", StatusAgree, "", "", ""},
		{"b0.e3", StatusUnchecked, "", "", "2 cached pages have"},
		{"b1.e0", StatusAgree, "", "", ""},
	}
}

// sglangSaltedFixture: SGLang 0.5.18 (PR #30827), a salted node's pages as
// BlockStoredWithMetadata arrays: request A stores a 2-page prompt under
// salt "tenant-a", B the same prompt under "tenant-b" from the root (no hit:
// salts never share), C builds on A's chain.
func sglangSaltedFixture() ([]byte, []want) {
	return saltStream("array", pstr("tenant-a"), pstr("tenant-b")), []want{
		{"b0.e0", StatusAgree, "", "", ""},
		{"b1.e0", StatusAgree, KindMissedHit, CauseNamespace, `request "b0.e0" of namespace "salt:\"tenant-a\""`},
		{"b2.e0", StatusAgree, "", "", ""},
	}
}

func checkWants(t *testing.T, rep *Report, wants []want) {
	t.Helper()
	byID := map[string]Result{}
	for _, r := range rep.Requests {
		byID[r.ID] = r
	}
	if len(rep.Requests) != len(wants) {
		t.Errorf("%d requests, want %d", len(rep.Requests), len(wants))
	}
	for _, w := range wants {
		r, ok := byID[w.id]
		if !ok || r.Status != w.status || r.Kind != w.kind || r.Cause != w.cause || !bytes.Contains([]byte(r.Detail), []byte(w.detail)) {
			t.Errorf("request %s: %s %s (%s): %q\n    want %s %s (%s) containing %q", w.id, r.Status, r.Kind, r.Cause, r.Detail, w.status, w.kind, w.cause, w.detail)
		}
	}
}

// The committed fixtures are exactly what the encoders write (go test -run
// Fixture -update rewrites them), and each gives its per-request verdicts.
func TestEventFixtures(t *testing.T) {
	for _, f := range []struct {
		file    string
		make    func() ([]byte, []want)
		cfg     Config
		verdict string
	}{
		{"vllm-kv-events.msgpack", vllmFixture, Config{PageSize: 4, Schedule: testCfg.Schedule}, "diverged"},
		{"sglang-kv-events.msgpack", sglangFixture, Config{PageSize: 2, Schedule: testCfg.Schedule}, "diverged"},
		// One request unchecked (its parent hash names two cached pages), none
		// wrong: incomplete, exit 3, not an agreement.
		{"sglang-perpage-kv-events.msgpack", sglangPerPageFixture, Config{PageSize: 1, Schedule: testCfg.Schedule}, VerdictIncomplete},
		{"sglang-salted-kv-events.msgpack", sglangSaltedFixture, Config{PageSize: 2, Schedule: testCfg.Schedule}, "agree"},
	} {
		t.Run(f.file, func(t *testing.T) {
			data, wants := f.make()
			path := filepath.Join(fixtureDir, f.file)
			if *update {
				if err := os.WriteFile(path, data, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			committed, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(committed, data) {
				t.Fatalf("%s differs from what the encoder writes (rerun with -update if the scenario changed)", path)
			}
			batches, err := DecodeEvents(committed, f.file)
			if err != nil {
				t.Fatal(err)
			}
			tr, err := EventsTrace(batches, f.file, EventsOptions{})
			if err != nil {
				t.Fatal(err)
			}
			rep, err := Run(tr, f.cfg)
			if err != nil {
				t.Fatal(err)
			}
			checkWants(t, rep, wants)
			if rep.Verdict != f.verdict || rep.Diverged() != (f.verdict == "diverged") || rep.Incomplete() != (f.verdict == VerdictIncomplete) {
				t.Errorf("verdict %s, want %s", rep.Verdict, f.verdict)
			}
			if testing.Verbose() {
				var b bytes.Buffer
				rep.WriteText(&b)
				t.Log("\n" + b.String())
			}
		})
	}
}
