package prefixcheck

import (
	"fmt"
	"strings"
	"testing"
)

// SGLang's cache_salt in KV events, as its source encodes it:
//
//   - sgl-project/sglang PR #30827 (SGLang 0.5.18): a salted node's pages are
//     BlockStoredWithMetadata(BlockStored, tag="BlockStored", kw_only=True)
//     with metadata: BlockStoredMetadata (a msgspec Struct without array_like,
//     so a map {"cache_salt": str}); KVCacheEvent is array_like, so the event
//     is ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium,
//     {"cache_salt": ...}]: the map at position 7, where vLLM's array had
//     lora_name. The event hashes are seeded by SHA-256("sglang-cache-salt-v1\0"
//     + salt), so two salts never share a hash (python/sglang/srt/disaggregation/
//     kv_events.py, mem_cache/events.py, mem_cache/utils.py
//     compute_node_event_hash_values). PR #37482's description adds
//     session_id to the same map.
//   - sgl-project/sglang PR #37482 as merged (issue #38561): events are tagged
//     maps, cache_salt and session_id optional fields of BlockStored itself;
//     PR #37271 (closed) had the map under a "metadata" key.
//
// session_id "does not participate in block hashing or cache identity" (PR
// #37482), so it is no namespace.

// sgStored is an SGLang BlockStored with the fields PR #30827 and #37482 add.
type sgStored struct {
	stored
	salt, session *string
}

// sglangSaltedEvent writes ev as SGLang >= 0.5.18 does: the legacy 7-element
// array, plus the metadata map when a salt or session is set.
func (x *evEnc) sglangSaltedEvent(ev sgStored) {
	n := 7
	if ev.salt != nil || ev.session != nil {
		n = 8
	}
	x.must(x.e.EncodeArrayLen(n))
	x.must(x.e.EncodeString("BlockStored"))
	x.ints(ev.hashes)
	x.optInt(ev.parent)
	x.ints(ev.tokens)
	x.must(x.e.EncodeInt(int64(ev.bs)))
	x.optInt(ev.loraID)
	x.must(x.e.EncodeString(ev.medium))
	if n == 8 {
		x.metadataMap(ev.salt, ev.session)
	}
}

// metadataMap writes BlockStoredMetadata (omit_defaults: absent fields left out).
func (x *evEnc) metadataMap(salt, session *string) {
	n := 0
	if salt != nil {
		n++
	}
	if session != nil {
		n++
	}
	x.must(x.e.EncodeMapLen(n))
	if salt != nil {
		x.must(x.e.EncodeString("cache_salt"))
		x.must(x.e.EncodeString(*salt))
	}
	if session != nil {
		x.must(x.e.EncodeString("session_id"))
		x.must(x.e.EncodeString(*session))
	}
}

// kv is one key of a map a test encoder writes, and its value.
type kv struct {
	k string
	v func()
}

// sglangStoredMap writes an SGLang BlockStored as a tagged map (msgspec
// without array_like: declaration order, None defaults omitted): the seven
// fields every one has, then more.
func (x *evEnc) sglangStoredMap(ev stored, more ...kv) {
	x.must(x.e.EncodeMapLen(7 + len(more)))
	for _, f := range append([]kv{
		{"type", func() { x.must(x.e.EncodeString("BlockStored")) }},
		{"block_hashes", func() { x.ints(ev.hashes) }},
		{"parent_block_hash", func() { x.optInt(ev.parent) }},
		{"token_ids", func() { x.ints(ev.tokens) }},
		{"block_size", func() { x.must(x.e.EncodeInt(int64(ev.bs))) }},
		{"lora_id", func() { x.optInt(ev.loraID) }},
		{"medium", func() { x.must(x.e.EncodeString(ev.medium)) }},
	}, more...) {
		x.must(x.e.EncodeString(f.k))
		f.v()
	}
}

// sglangMapEvent writes ev as a tagged map: PR #37482's (cache_salt and
// session_id fields, omitted when None) or, nested, PR #37271's ("metadata").
func (x *evEnc) sglangMapEvent(ev sgStored, nested bool) {
	var more []kv
	if ev.salt != nil {
		more = append(more, kv{"cache_salt", func() { x.must(x.e.EncodeString(*ev.salt)) }})
	}
	if ev.session != nil {
		more = append(more, kv{"session_id", func() { x.must(x.e.EncodeString(*ev.session)) }})
	}
	if nested && len(more) > 0 {
		more = []kv{{"metadata", func() { x.metadataMap(ev.salt, ev.session) }}}
	}
	x.sglangStoredMap(ev.stored, more...)
}

// sglangSaltBatch writes one SGLang batch [ts, events, attn_dp_rank] of
// events in the given shape ("array": PR #30827, "map": #37482, "nested":
// #37271).
func (x *evEnc) sglangSaltBatch(shape string, ts float64, evs ...sgStored) {
	x.must(x.e.EncodeArrayLen(3))
	x.must(x.e.EncodeFloat64(ts))
	x.must(x.e.EncodeArrayLen(len(evs)))
	for _, ev := range evs {
		switch shape {
		case "array":
			x.sglangSaltedEvent(ev)
		default:
			x.sglangMapEvent(ev, shape == "nested")
		}
	}
	x.must(x.e.EncodeInt(0))
}

// saltStream: request A stores a 2-page prompt under salt saltA; request B
// stores the same prompt from the root (no hit) under saltB, with a session
// id; then C builds on A's chain (a hit).
func saltStream(shape string, saltA, saltB *string) []byte {
	P := seqTok(100, 4)
	x := newEvEnc()
	x.sglangSaltBatch(shape, 1, sgStored{stored: stored{hashes: []int64{11, 12}, tokens: P, bs: 2, medium: "GPU"}, salt: saltA, session: pstr("sess-1")})
	x.sglangSaltBatch(shape, 2, sgStored{stored: stored{hashes: []int64{21, 22}, tokens: P, bs: 2, medium: "GPU"}, salt: saltB, session: pstr("sess-2")})
	x.sglangSaltBatch(shape, 3, sgStored{stored: stored{hashes: []int64{13}, parent: p64(12), tokens: []int64{7, 8}, bs: 2, medium: "GPU"}, salt: saltA})
	return x.buf.Bytes()
}

func runStream(t *testing.T, data []byte) *Report {
	t.Helper()
	b, err := DecodeEvents(data, "salt.msgpack")
	if err != nil {
		t.Fatal(err)
	}
	tr, err := EventsTrace(b, "salt.msgpack", EventsOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := Run(tr, Config{PageSize: 2, Schedule: testCfg.Schedule})
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// Two requests with the same prompt and different salts share nothing in
// SGLang (and in the correct cache): no divergence. The control, the same
// two requests under one salt (different session ids, which do not
// separate), is the missed-hit divergence.
func TestSaltedRequestsDoNotShare(t *testing.T) {
	for _, shape := range []string{"array", "map", "nested"} {
		t.Run(shape, func(t *testing.T) {
			rep := runStream(t, saltStream(shape, pstr("tenant-a"), pstr("tenant-b")))
			checkWants(t, rep, []want{
				{"b0.e0", StatusAgree, "", "", ""},
				{"b1.e0", StatusAgree, KindMissedHit, CauseNamespace, `request "b0.e0" of namespace "salt:\"tenant-a\""`},
				{"b2.e0", StatusAgree, "", "", ""},
			})
			if rep.Diverged() {
				t.Fatalf("verdict %s", rep.Verdict)
			}
			// An empty salt is a namespace of its own, not the unsalted one.
			rep = runStream(t, saltStream(shape, nil, pstr("")))
			if rep.Diverged() {
				t.Fatalf("salt \"\" after no salt: verdict %s", rep.Verdict)
			}

			rep = runStream(t, saltStream(shape, pstr("tenant-a"), pstr("tenant-a")))
			checkWants(t, rep, []want{
				{"b0.e0", StatusAgree, "", "", ""},
				{"b1.e0", StatusDiverged, KindMissedHit, CauseNone, "the correct cache held 4 resumable tokens"},
				{"b2.e0", StatusAgree, "", "", ""},
			})
			if !rep.Diverged() {
				t.Fatalf("same salt: verdict %s", rep.Verdict)
			}
		})
	}
}

// A malformed metadata map is a bounded error naming the byte of the bad
// value.
func TestBadSaltMetadata(t *testing.T) {
	// prefix writes a salted array event up to position 7 and returns the
	// byte offset where the metadata starts.
	head := func(x *evEnc) int {
		x.must(x.e.EncodeArrayLen(2))
		x.must(x.e.EncodeFloat64(1))
		x.must(x.e.EncodeArrayLen(1))
		x.must(x.e.EncodeArrayLen(8))
		x.must(x.e.EncodeString("BlockStored"))
		x.ints([]int64{1})
		x.must(x.e.EncodeNil())
		x.ints([]int64{1, 2})
		x.must(x.e.EncodeInt(2))
		x.must(x.e.EncodeNil())
		x.must(x.e.EncodeString("GPU"))
		return x.buf.Len()
	}
	cases := []struct {
		name string
		f    func(x *evEnc) int // writes the bad part, returns the offset the error must name
		want string
	}{
		{"salt not a string", func(x *evEnc) int {
			x.must(x.e.EncodeMapLen(1))
			x.must(x.e.EncodeString("cache_salt"))
			at := x.buf.Len()
			x.must(x.e.EncodeInt(5))
			return at
		}, "BlockStored.metadata.cache_salt: want a string, found msgpack code 0x05"},
		{"session not a string", func(x *evEnc) int {
			x.must(x.e.EncodeMapLen(1))
			x.must(x.e.EncodeString("session_id"))
			at := x.buf.Len()
			x.must(x.e.EncodeArrayLen(0))
			return at
		}, "BlockStored.metadata.session_id: want a string"},
		{"key not a string", func(x *evEnc) int {
			at := x.buf.Len() + 1
			x.must(x.e.EncodeMapLen(1))
			x.must(x.e.EncodeInt(1))
			x.must(x.e.EncodeInt(1))
			return at
		}, "BlockStored.metadata key: want a string"},
		{"key twice", func(x *evEnc) int {
			x.must(x.e.EncodeMapLen(2))
			x.must(x.e.EncodeString("cache_salt"))
			x.must(x.e.EncodeString("a"))
			at := x.buf.Len()
			x.must(x.e.EncodeString("cache_salt"))
			x.must(x.e.EncodeString("a"))
			return at
		}, `BlockStored.metadata: key "cache_salt" twice`},
		{"map claims 4G entries", func(x *evEnc) int {
			at := x.buf.Len()
			x.buf.Write([]byte{0xdf, 0xff, 0xff, 0xff, 0xff, 0xa0})
			return at
		}, "BlockStored.metadata: map of 4294967295 entries claimed, 1 bytes left"},
		{"salt claims 4G bytes", func(x *evEnc) int {
			x.must(x.e.EncodeMapLen(1))
			x.must(x.e.EncodeString("cache_salt"))
			at := x.buf.Len()
			x.buf.Write([]byte{0xdb, 0xff, 0xff, 0xff, 0xff, 'a'})
			return at
		}, "BlockStored.metadata.cache_salt: 4294967295 bytes claimed"},
		{"salt over 64 KiB", func(x *evEnc) int {
			x.must(x.e.EncodeMapLen(1))
			x.must(x.e.EncodeString("cache_salt"))
			at := x.buf.Len()
			x.must(x.e.EncodeString(strings.Repeat("s", maxStrBytes+1)))
			return at
		}, "BlockStored.metadata.cache_salt: string of 65537 bytes (at most 65536)"},
		{"unknown key nested too deep", func(x *evEnc) int {
			x.must(x.e.EncodeMapLen(1))
			x.must(x.e.EncodeString("future"))
			for i := 0; i < 40; i++ {
				x.must(x.e.EncodeArrayLen(1))
			}
			x.must(x.e.EncodeNil())
			return -1
		}, "BlockStored.metadata.future: nested deeper than 32"},
		{"truncated", func(x *evEnc) int {
			x.must(x.e.EncodeMapLen(1))
			at := x.buf.Len()
			x.must(x.e.EncodeString("cache_salt"))
			x.buf.Truncate(at + 3)
			return at
		}, "BlockStored.metadata key: 10 bytes claimed, 2 left"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			x := newEvEnc()
			head(x)
			at := c.f(x)
			_, err := DecodeEvents(x.buf.Bytes(), "bad.msgpack")
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want %q", err, c.want)
			}
			if at >= 0 && !strings.Contains(err.Error(), fmt.Sprintf("bad.msgpack: byte %d: ", at)) {
				t.Fatalf("error %v does not name byte %d", err, at)
			}
			if len(err.Error()) > 400 {
				t.Fatalf("error of %d bytes", len(err.Error()))
			}
		})
	}
	// Map encoding: a salt given twice (the field and PR #37271's metadata)
	// with two values is refused; the same value twice is one salt.
	for _, same := range []bool{true, false} {
		x := newEvEnc()
		x.must(x.e.EncodeArrayLen(2))
		x.must(x.e.EncodeFloat64(1))
		x.must(x.e.EncodeArrayLen(1))
		storedMap(x, func() { x.must(x.e.EncodeString("block_hashes")); x.ints([]int64{1}) },
			func() { x.must(x.e.EncodeString("token_ids")); x.ints([]int64{1}) },
			func() { x.must(x.e.EncodeString("block_size")); x.must(x.e.EncodeInt(1)) },
			func() { x.must(x.e.EncodeString("cache_salt")); x.must(x.e.EncodeString("a")) },
			func() {
				x.must(x.e.EncodeString("metadata"))
				v := "a"
				if !same {
					v = "b"
				}
				x.metadataMap(&v, nil)
			})
		_, err := DecodeEvents(x.buf.Bytes(), "bad.msgpack")
		if same && err != nil {
			t.Fatalf("same salt twice: %v", err)
		}
		if !same && (err == nil || !strings.Contains(err.Error(), `BlockStored.metadata.cache_salt: "b", but cache_salt "a" given before`)) {
			t.Fatalf("two salts: %v", err)
		}
	}
}
