package prefixcheck

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// bad builds a stream by hand: raw bytes written after a msgpack prefix.
func rawBatch(f func(x *evEnc)) []byte {
	x := newEvEnc()
	f(x)
	return x.buf.Bytes()
}

func mapBatchWith(ev func(x *evEnc)) []byte {
	return rawBatch(func(x *evEnc) {
		x.must(x.e.EncodeArrayLen(2))
		x.must(x.e.EncodeFloat64(1))
		x.must(x.e.EncodeArrayLen(1))
		ev(x)
	})
}

func storedMap(x *evEnc, fields ...func()) {
	x.must(x.e.EncodeMapLen(1 + len(fields)))
	x.must(x.e.EncodeString("type"))
	x.must(x.e.EncodeString("BlockStored"))
	for _, f := range fields {
		f()
	}
}

func TestBadEventStreams(t *testing.T) {
	kv := func(x *evEnc, k string, v func()) func() {
		return func() { x.must(x.e.EncodeString(k)); v() }
	}
	cases := []struct {
		name string
		data []byte
		want string
	}{
		{"empty", nil, "no event batches"},
		{"not msgpack batch", []byte{0x05}, "want an array"},
		{"array claims 4G elements", []byte{0xdd, 0xff, 0xff, 0xff, 0xff}, "array of 4294967295 elements claimed, 0 bytes left"},
		{"map claims 4G entries", []byte{0xdf, 0xff, 0xff, 0xff, 0xff, 0}, "map of 4294967295 entries claimed"},
		{"string claims 4G bytes", []byte{0x81, 0xdb, 0xff, 0xff, 0xff, 0xff, 'a'}, "4294967295 bytes claimed"},
		{"truncated float", []byte{0x92, 0xcb, 0x40}, "ts"},
		{"batch without events", rawBatch(func(x *evEnc) { x.must(x.e.EncodeArrayLen(1)); x.must(x.e.EncodeFloat64(1)) }), "without ts or events"},
		{"duplicate batch key", rawBatch(func(x *evEnc) {
			x.must(x.e.EncodeMapLen(2))
			x.must(x.e.EncodeString("ts"))
			x.must(x.e.EncodeFloat64(1))
			x.must(x.e.EncodeString("ts"))
			x.must(x.e.EncodeFloat64(2))
		}), `key "ts" twice`},
		{"unknown event type", mapBatchWith(func(x *evEnc) {
			x.must(x.e.EncodeArrayLen(1))
			x.must(x.e.EncodeString("BlockMoved"))
		}), `unknown event type "BlockMoved"`},
		{"event without tag", mapBatchWith(func(x *evEnc) { x.must(x.e.EncodeArrayLen(0)) }), "no tag"},
		{"field before the tag", mapBatchWith(func(x *evEnc) {
			x.must(x.e.EncodeMapLen(2))
			x.must(x.e.EncodeString("block_size"))
			x.must(x.e.EncodeInt(4))
		}), `field "block_size" before the "type" tag`},
		{"stored without tokens", mapBatchWith(func(x *evEnc) {
			storedMap(x, kv(x, "block_hashes", func() { x.ints([]int64{1}) }), kv(x, "block_size", func() { x.must(x.e.EncodeInt(4)) }))
		}), "BlockStored without token_ids"},
		{"tokens do not fill the blocks", mapBatchWith(func(x *evEnc) {
			storedMap(x, kv(x, "block_hashes", func() { x.ints([]int64{1}) }), kv(x, "token_ids", func() { x.ints([]int64{1, 2, 3}) }),
				kv(x, "block_size", func() { x.must(x.e.EncodeInt(4)) }))
		}), "3 token ids for 1 blocks of 4 tokens"},
		{"negative token", mapBatchWith(func(x *evEnc) {
			storedMap(x, kv(x, "token_ids", func() { x.ints([]int64{-1}) }))
		}), "token id -1 outside"},
		{"token above int32", mapBatchWith(func(x *evEnc) {
			storedMap(x, kv(x, "token_ids", func() { x.ints([]int64{1 << 40}) }))
		}), "outside [0, 2^31)"},
		{"zero block size", mapBatchWith(func(x *evEnc) {
			storedMap(x, kv(x, "block_size", func() { x.must(x.e.EncodeInt(0)) }))
		}), "block_size: 0"},
		{"hash of 100 bytes", mapBatchWith(func(x *evEnc) {
			storedMap(x, kv(x, "block_hashes", func() { x.must(x.e.EncodeArrayLen(1)); x.must(x.e.EncodeBytes(make([]byte, 100))) }))
		}), "a 100-byte hash"},
		{"hash as a string", mapBatchWith(func(x *evEnc) {
			storedMap(x, kv(x, "block_hashes", func() { x.must(x.e.EncodeArrayLen(1)); x.must(x.e.EncodeString("h")) }))
		}), "want an int or bytes block hash"},
		{"extra keys nested too deep", mapBatchWith(func(x *evEnc) {
			storedMap(x, kv(x, "extra_keys", func() {
				x.must(x.e.EncodeArrayLen(1))
				for i := 0; i < 40; i++ {
					x.must(x.e.EncodeArrayLen(1))
				}
				x.must(x.e.EncodeNil())
			}))
		}), "nested deeper than 32"},
		{"extension type in an unknown field", mapBatchWith(func(x *evEnc) {
			storedMap(x, kv(x, "session", func() { x.buf.Write([]byte{0xd4, 0x01, 0x00}) }))
		}), "extension type"},
		{"extra keys for the wrong number of blocks", mapBatchWith(func(x *evEnc) {
			storedMap(x, kv(x, "block_hashes", func() { x.ints([]int64{1}) }), kv(x, "token_ids", func() { x.ints([]int64{1}) }),
				kv(x, "block_size", func() { x.must(x.e.EncodeInt(1)) }), kv(x, "extra_keys", func() { x.must(x.e.EncodeArrayLen(0)) }))
		}), "0 extra keys for 1 blocks"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := DecodeEvents(c.data, "bad.msgpack")
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want %q", err, c.want)
			}
			if !strings.Contains(err.Error(), "bad.msgpack") {
				t.Fatalf("error %v does not name the input", err)
			}
		})
	}
}

func TestReadEventsLimit(t *testing.T) {
	data, _ := vllmFixture()
	if _, err := ReadEvents(bytes.NewReader(data), "x", int64(len(data)-1)); err == nil || !strings.Contains(err.Error(), "longer than") {
		t.Fatalf("error %v", err)
	}
	if b, err := ReadEvents(bytes.NewReader(data), "x", int64(len(data))); err != nil || len(b) != 5 {
		t.Fatalf("%d batches, %v", len(b), err)
	}
}

// Every cut of a valid stream decodes to whole batches or fails; never panics.
func TestTruncatedEventStreams(t *testing.T) {
	data, _ := vllmFixture()
	full, err := DecodeEvents(data, "x")
	if err != nil {
		t.Fatal(err)
	}
	for n := 0; n < len(data); n++ {
		b, err := DecodeEvents(data[:n], "x")
		if err == nil && len(b) >= len(full) {
			t.Fatalf("cut at %d decodes %d batches", n, len(b))
		}
	}
}

func TestEventsTraceErrors(t *testing.T) {
	x := newEvEnc()
	x.vllmBatch(1, stored{hashes: []int64{1}, tokens: seqTok(0, 4), bs: 4, medium: "GPU"},
		stored{hashes: []int64{2}, parent: p64(1), tokens: seqTok(0, 2), bs: 2, medium: "GPU"})
	b, err := DecodeEvents(x.buf.Bytes(), "x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := EventsTrace(b, "x", EventsOptions{}); err == nil || !strings.Contains(err.Error(), "block size 2, earlier events 4") {
		t.Fatalf("error %v", err)
	}
	x = newEvEnc()
	x.vllmBatch(1, stored{hashes: []int64{1}, tokens: seqTok(0, 4), bs: 4, medium: "CPU"})
	b, _ = DecodeEvents(x.buf.Bytes(), "x")
	if _, err := EventsTrace(b, "x", EventsOptions{}); err == nil || !strings.Contains(err.Error(), "no BlockStored events") {
		t.Fatalf("error %v", err)
	}
	// A stream that starts mid-run: the parent is unknown, the request unchecked.
	x = newEvEnc()
	x.vllmBatch(1, stored{hashes: []int64{2}, parent: p64(1), tokens: seqTok(0, 4), bs: 4, medium: "GPU"},
		removed{hashes: []int64{9}, medium: "GPU"})
	b, _ = DecodeEvents(x.buf.Bytes(), "x")
	tr, err := EventsTrace(b, "x", EventsOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := Run(tr, Config{PageSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Requests[0].Status != StatusUnchecked || rep.Diverged() || len(rep.Notes) != 1 {
		t.Fatalf("%+v notes %v", rep.Requests[0], rep.Notes)
	}
}

// A hash that recurs along a chain: SGLang hashes a page's tokens alone, so
// with pages of one token a prompt 5 7 5 9 stores 5, then 7 on 5, then 5 again
// on 7, then 9 on that 5. A block's parent is the block its parent hash named
// when it was stored, so no block becomes its own ancestor and every request
// holds its prefix as stored (reading parents by hash looped forever here).
func TestEventsRecurringHashes(t *testing.T) {
	type req struct {
		tokens []int32
		ids    []string
		hit    int
		source string
	}
	cases := []struct {
		name string
		evs  []any
		want []req
	}{
		// One event stores hash 1 twice (the second on the first), the next
		// builds on 1 (53 bytes of msgpack).
		{"one hash twice in an event", []any{
			stored{hashes: []int64{1, 1}, tokens: []int64{5, 6}, bs: 1},
			stored{hashes: []int64{2}, parent: p64(1), tokens: []int64{7}, bs: 1},
		}, []req{
			{[]int32{5, 6}, []string{"1", "1"}, 0, ""},
			{[]int32{5, 6, 7}, []string{"1", "1", "2"}, 2, "b0.e0"},
		}},
		{"a hash stored again under its child", []any{
			stored{hashes: []int64{5}, tokens: []int64{5}, bs: 1},
			stored{hashes: []int64{7}, parent: p64(5), tokens: []int64{7}, bs: 1},
			stored{hashes: []int64{5}, parent: p64(7), tokens: []int64{5}, bs: 1},
			stored{hashes: []int64{9}, parent: p64(5), tokens: []int64{9}, bs: 1},
			stored{hashes: []int64{8}, parent: p64(7), tokens: []int64{8}, bs: 1},
		}, []req{
			{[]int32{5}, []string{"5"}, 0, ""},
			{[]int32{5, 7}, []string{"5", "7"}, 1, "b0.e0"},
			{[]int32{5, 7, 5}, []string{"5", "7", "5"}, 2, "b0.e1"},
			{[]int32{5, 7, 5, 9}, []string{"5", "7", "5", "9"}, 3, "b0.e2"},
			{[]int32{5, 7, 8}, []string{"5", "7", "8"}, 2, "b0.e1"},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			x := newEvEnc()
			x.sglangBatch(1, c.evs...)
			b, err := DecodeEvents(x.buf.Bytes(), "x")
			if err != nil {
				t.Fatal(err)
			}
			tr, err := EventsTrace(b, "x", EventsOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if len(tr.Requests) != len(c.want) {
				t.Fatalf("%d requests, want %d", len(tr.Requests), len(c.want))
			}
			for i, w := range c.want {
				q := tr.Requests[i]
				if !equal32(q.Tokens, w.tokens) || strings.Join(q.PageIDs, " ") != strings.Join(w.ids, " ") || q.Hit == nil || q.Hit.Tokens != w.hit || q.Hit.Source != w.source {
					t.Fatalf("request %d: tokens %v ids %v hit %+v, want %+v", i, q.Tokens, q.PageIDs, q.Hit, w)
				}
			}
			if _, err := Run(tr, Config{PageSize: 1}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// The guard of chain: a cycle of parents (which stored never makes) is an
// error, not an endless walk.
func TestEventsChainGuard(t *testing.T) {
	a := &evBlock{hash: "1", tokens: []int32{1}, depth: 2}
	a.parent = &evBlock{hash: "2", parent: a, tokens: []int32{2}, depth: 1}
	r := &eventsReader{t: &Trace{PageSize: 1}, floor: prefixBytesFloor}
	if _, _, _, _, err := r.chain(a, 0, 0); err == nil || !strings.Contains(err.Error(), "cycle of parents") {
		t.Fatalf("error %v", err)
	}
}

// chainStream is one batch of n BlockStored events of one token, each on the
// block the one before stored (every request holds the whole chain so far),
// then, when evict, the removal of each block from the leaf up (every
// eviction holds the chain it cuts).
func chainStream(n int, evict bool) []byte {
	var evs []any
	for i := 0; i < n; i++ {
		ev := stored{hashes: []int64{int64(i + 1)}, tokens: []int64{7}, bs: 1}
		if i > 0 {
			ev.parent = p64(int64(i))
		}
		evs = append(evs, ev)
	}
	for i := n; evict && i > 0; i-- {
		evs = append(evs, removed{hashes: []int64{int64(i)}})
	}
	x := newEvEnc()
	x.sglangBatch(1, evs...)
	return x.buf.Bytes()
}

// The prefixes a stream's requests and evictions hold grow with the square
// of a chain's length; beyond the budget for the stream's size EventsTrace
// fails. Here the floor is lowered from 128 MiB to 1 MiB and 300 KiB: 2,000
// chained events (47 KB) would build 72 MB, 200 build 0.7 MB and their
// evictions as much again.
func TestEventsPrefixBudget(t *testing.T) {
	cases := []struct {
		name      string
		data      []byte
		floor     int64
		fromEvent int // the error names an event from this one on (-1: no error)
	}{
		{"long chain", chainStream(2000, false), 1 << 20, 0},
		{"chain within the budget", chainStream(200, false), 300 << 10, -1},
		{"its evictions beyond it", chainStream(200, true), 300 << 10, 200},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, err := DecodeEvents(c.data, "x")
			if err != nil {
				t.Fatal(err)
			}
			_, err = eventsTrace(b, "x", EventsOptions{}, c.floor)
			if c.fromEvent < 0 {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil {
				t.Fatal("no error")
			}
			var ev, at int
			if n, _ := fmt.Sscanf(err.Error(), "prefixcheck: x: batch 0 event %d (byte %d): a chain of ", &ev, &at); n != 2 || ev < c.fromEvent ||
				!strings.Contains(err.Error(), fmt.Sprintf("over the limit of %d for the %d bytes of the stream before this event", c.floor+prefixBytesPerStreamByte*int64(at), at)) ||
				!strings.HasSuffix(err.Error(), "this stream's chains are too long and too many to check") {
				t.Fatalf("error %v", err)
			}
		})
	}
}

func FuzzEvents(f *testing.F) {
	for _, name := range []string{"vllm-kv-events.msgpack", "sglang-kv-events.msgpack", "sglang-perpage-kv-events.msgpack", "sglang-salted-kv-events.msgpack"} {
		data, err := os.ReadFile(filepath.Join(fixtureDir, name))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Add([]byte{0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add(mapBatchWith(func(x *evEnc) { x.sglangEvent(cleared{}) }))
	x := newEvEnc() // a hash stored on itself, then built on
	x.sglangBatch(1, stored{hashes: []int64{1, 1}, tokens: []int64{5, 6}, bs: 1}, stored{hashes: []int64{2}, parent: p64(1), tokens: []int64{7}, bs: 1})
	f.Add(x.buf.Bytes())
	// SGLang's salted stores: BlockStoredWithMetadata arrays (PR #30827),
	// tagged maps with cache_salt and session_id (PR #37482), the map under
	// "metadata" (PR #37271), and a metadata map with a bad salt.
	for _, shape := range []string{"array", "map", "nested"} {
		f.Add(saltStream(shape, pstr("tenant-a"), pstr("tenant-b")))
	}
	f.Add(saltStream("array", nil, pstr("")))
	f.Add(mapBatchWith(func(x *evEnc) {
		x.must(x.e.EncodeArrayLen(8))
		x.must(x.e.EncodeString("BlockStored"))
		x.ints([]int64{1})
		x.must(x.e.EncodeNil())
		x.ints([]int64{1, 2})
		x.must(x.e.EncodeInt(2))
		x.must(x.e.EncodeNil())
		x.must(x.e.EncodeString("GPU"))
		x.must(x.e.EncodeMapLen(2))
		x.must(x.e.EncodeString("cache_salt"))
		x.must(x.e.EncodeInt(5))
	}))
	// SGLang's per-component events (BlockStoredWithComponentType and its
	// salted and removal forms), arrays and maps, with a mamba checkpoint.
	for _, shape := range []string{"array", "map"} {
		f.Add(componentStream(shape, nil))
		f.Add(componentStream(shape, pstr("tenant-a")))
		f.Add(mambaStream(shape))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := DecodeEvents(data, "fuzz")
		if err != nil {
			return
		}
		tr, err := EventsTrace(b, "fuzz", EventsOptions{})
		if err != nil {
			return
		}
		if tr.PageSize > 64 {
			return
		}
		rep, err := Run(tr, Config{PageSize: tr.PageSize, Schedule: testCfg.Schedule})
		if err != nil {
			return
		}
		var buf bytes.Buffer
		rep.WriteText(&buf)
		if err := rep.WriteJSON(&buf); err != nil {
			t.Fatal(err)
		}
	})
}

// EncodeEvents writes back exactly the bytes of both fixtures it decoded.
func TestEncodeEventsRoundTrip(t *testing.T) {
	for _, c := range []struct{ file, enc string }{{"vllm-kv-events.msgpack", EncodingMap}, {"sglang-kv-events.msgpack", EncodingArray}} {
		data, err := os.ReadFile(filepath.Join(fixtureDir, c.file))
		if err != nil {
			t.Fatal(err)
		}
		b, err := DecodeEvents(data, c.file)
		if err != nil {
			t.Fatal(err)
		}
		out, err := EncodeEvents(b, c.enc)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out, data) {
			t.Fatalf("%s: re-encoded %d bytes differ from the %d read", c.file, len(out), len(data))
		}
	}
}

// keyPaths lists every key path of a JSON value ("a.b[].c").
func keyPaths(v any, prefix string, out map[string]bool) {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			p := prefix + "." + k
			if prefix == "" {
				p = k
			}
			if prefix == "summary.kinds" {
				p = prefix + ".<status:kind>"
			}
			out[p] = true
			keyPaths(e, p, out)
		}
	case []any:
		for _, e := range x {
			keyPaths(e, prefix+"[]", out)
		}
	}
}

// The JSON report's key paths (docs/prefix-json.md) for the vLLM fixture's
// report; go test -run JSONSchema -update rewrites the golden list.
func TestJSONSchema(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(fixtureDir, "vllm-kv-events.msgpack"))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := DecodeEvents(data, "vllm-kv-events.msgpack")
	tr, _ := EventsTrace(b, "vllm-kv-events.msgpack", EventsOptions{})
	rep, err := Run(tr, Config{PageSize: 4, Schedule: testCfg.Schedule})
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	var v any
	if err := json.Unmarshal(buf.Bytes(), &v); err != nil {
		t.Fatal(err)
	}
	paths := map[string]bool{}
	keyPaths(v, "", paths)
	var list []string
	for p := range paths {
		list = append(list, p)
	}
	sort.Strings(list)
	got := strings.Join(list, "\n") + "\n"
	golden := "testdata/prefix-schema.golden"
	if *update {
		if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if got != string(want) {
		t.Fatalf("JSON key paths changed (update docs/prefix-json.md and rerun with -update):\n%s", got)
	}
}

// A hybrid model's sliding-window group is skipped: the full-attention group
// is checked (vLLM's group_idx and kv_cache_spec_kind).
func TestEventsGroupSelection(t *testing.T) {
	g0, g1 := int64(0), int64(1)
	toks := []int32{1, 2, 3, 4}
	b := []EventBatch{{TS: 1, Events: []Event{
		{Type: "BlockStored", BlockHashes: []BlockHash{"7"}, TokenIDs: toks, BlockSize: 4, Medium: "GPU", GroupIdx: &g1, SpecKind: "sliding_window"},
		{Type: "BlockStored", BlockHashes: []BlockHash{"8"}, TokenIDs: toks, BlockSize: 4, Medium: "GPU", GroupIdx: &g0, SpecKind: "full_attention"},
		{Type: "BlockRemoved", BlockHashes: []BlockHash{"7"}, Medium: "GPU", GroupIdx: &g1},
		{Type: "BlockStored", BlockHashes: []BlockHash{"9"}, Parent: "8", TokenIDs: toks, BlockSize: 4, Medium: "GPU", GroupIdx: &g0, SpecKind: "full_attention"},
		{Type: "BlockStored", BlockHashes: []BlockHash{"10"}, BlockSize: 4, Medium: "GPU", GroupIdx: &g0},
	}}}
	data, err := EncodeEvents(b, EncodingMap)
	if err != nil {
		t.Fatal(err)
	}
	back, err := DecodeEvents(data, "x")
	if err != nil {
		t.Fatal(err)
	}
	if back[0].Events[0].SpecKind != "sliding_window" || *back[0].Events[1].GroupIdx != 0 {
		t.Fatalf("decoded %+v", back[0].Events[:2])
	}
	tr, err := EventsTrace(back, "x", EventsOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.Requests) != 2 || tr.Requests[1].Hit.Tokens != 4 {
		t.Fatalf("requests %+v", tr.Requests)
	}
	notes := strings.Join(tr.Notes, "; ")
	if !strings.Contains(notes, "2 events of other KV-cache groups than 0 skipped") || !strings.Contains(notes, "1 BlockStored event without token ids") {
		t.Fatalf("notes %q", notes)
	}
	if _, err := EncodeEvents(b, EncodingArray); err == nil {
		t.Fatal("group_idx written in the array encoding")
	}
}

// Data-parallel ranks have their own caches: a mixed stream needs a rank.
func TestEventsDataParallelRanks(t *testing.T) {
	r0, r1 := int64(0), int64(1)
	st := func(h BlockHash) Event {
		return Event{Type: "BlockStored", BlockHashes: []BlockHash{h}, TokenIDs: []int32{1, 2}, BlockSize: 2, Medium: "GPU"}
	}
	b := []EventBatch{{TS: 1, DPRank: &r0, Events: []Event{st("1")}}, {TS: 2, DPRank: &r1, Events: []Event{st("2"), st("3")}}}
	if _, err := EventsTrace(b, "x", EventsOptions{}); err == nil || !strings.Contains(err.Error(), "data-parallel rank 1") {
		t.Fatalf("error %v", err)
	}
	tr, err := EventsTrace(b, "x", EventsOptions{DPRank: &r1})
	if err != nil || len(tr.Requests) != 2 {
		t.Fatalf("%v %+v", err, tr)
	}
}
