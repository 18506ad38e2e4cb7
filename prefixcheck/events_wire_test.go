package prefixcheck

import (
	"encoding/binary"
	"math"
	"reflect"
	"strings"
	"testing"
)

// The event shapes current SGLang and vLLM publish, written byte by byte by a
// msgpack writer of their own (wire, below: msgspec's encoding of the values
// the engines' structs hold; it shares nothing with EncodeEvents or evEnc),
// and what the decoder makes of them.
//
// SGLang main since PR #37482 (python/sglang/srt/utils/event_publisher.py at
// 1b5a3291927650f6f3a4ed8945ebfaa188335131, EventBatch array_like and
// omit_defaults; disaggregation/kv_events.py's events tag=True and
// omit_defaults without array_like; test/registered/unit/disaggregation/
// test_kv_events.py at 0d7e47bef1b1ec4360cbb0dc8407ae3af041d5b7,
// TestBlockStoredWireFormat; mem_cache/rust_tree_core/adapter.py at
// 0027895037f9a96c0e152a4813d739638b75c694, _kv_event_from_tagged): a batch
// is [ts, events, attn_dp_rank]; a BlockStored is the map {"type",
// "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"
// (always nil), "medium", then "cache_salt" and "session_id" when set}; a
// BlockRemoved {"type", "block_hashes", "medium"}; AllBlocksCleared
// {"type"}. mem_cache/events.py at 06f643f402f0d7e1c4fd480f6854b742fa642951
// (KVCacheEventRecorder.record_store) also passes lora_name, its hashes
// seeded with the adapter's name. Hashes are hash_str_to_int64's signed
// int64s; medium is StorageMedium's value ("GPU", "CPU_PINNED", "DISK",
// "EXTERNAL").
//
// vLLM (vllm/distributed/kv_events.py; EventBatch array_like, events tagged
// maps since PR #42892, e.g. at 0181ea3173e53eea8cf04a86891488e3dc89bb34):
// a BlockStored writes block_hashes, parent_block_hash, token_ids,
// block_size, lora_id, medium and lora_name always (no defaults), then
// extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
// and the fields merged since that commit, locality (PR #48281, "LOCAL or
// REMOTE relative to the publisher"), ownership (PR #52067, after locality
// in its diff) and session_id (PR #51381), when not None; a BlockRemoved
// block_hashes, medium, then group_idx, locality and ownership when set.
// Int hashes are unsigned 64-bit (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).

// wire is a msgpack writer: msgspec writes an int in its smallest form
// (fixint, then uint8..uint64 or int8..int64), a float as float64, a str as
// fixstr/str8/str16, a list or tuple as an array, a struct without
// array_like as a map in declaration order.
type wire struct{ b []byte }

// wmap is a map in key order.
type wmap []wkv

type wkv struct {
	k string
	v any
}

// hdr writes a header of length n: base|n up to smallMax, else the 8-bit
// (c8, when the type has one), 16-bit or 32-bit form.
func (w *wire) hdr(base byte, smallMax, n int, c8, c16, c32 byte) {
	switch {
	case n <= smallMax:
		w.b = append(w.b, base|byte(n))
	case c8 != 0 && n < 1<<8:
		w.b = append(w.b, c8, byte(n))
	case n < 1<<16:
		w.b = append(w.b, c16)
		w.b = binary.BigEndian.AppendUint16(w.b, uint16(n))
	default:
		w.b = append(w.b, c32)
		w.b = binary.BigEndian.AppendUint32(w.b, uint32(n))
	}
}

func (w *wire) val(v any) {
	switch v := v.(type) {
	case nil:
		w.b = append(w.b, 0xc0)
	case int:
		w.int(int64(v))
	case int64:
		w.int(v)
	case uint64:
		if v <= math.MaxInt64 {
			w.int(int64(v))
			return
		}
		w.b = append(w.b, 0xcf)
		w.b = binary.BigEndian.AppendUint64(w.b, v)
	case float64:
		w.b = append(w.b, 0xcb)
		w.b = binary.BigEndian.AppendUint64(w.b, math.Float64bits(v))
	case string:
		w.hdr(0xa0, 31, len(v), 0xd9, 0xda, 0xdb)
		w.b = append(w.b, v...)
	case []int64:
		w.hdr(0x90, 15, len(v), 0, 0xdc, 0xdd)
		for _, x := range v {
			w.int(x)
		}
	case []any:
		w.hdr(0x90, 15, len(v), 0, 0xdc, 0xdd)
		for _, x := range v {
			w.val(x)
		}
	case wmap:
		w.hdr(0x80, 15, len(v), 0, 0xde, 0xdf)
		for _, e := range v {
			w.val(e.k)
			w.val(e.v)
		}
	default:
		panic("wire: no encoding for " + reflect.TypeOf(v).String())
	}
}

func (w *wire) int(v int64) {
	switch {
	case v >= 0 && v < 128, v < 0 && v >= -32:
		w.b = append(w.b, byte(v))
	case v >= 0 && v < 1<<8:
		w.b = append(w.b, 0xcc, byte(v))
	case v >= 0 && v < 1<<16:
		w.b = append(w.b, 0xcd)
		w.b = binary.BigEndian.AppendUint16(w.b, uint16(v))
	case v >= 0 && v < 1<<32:
		w.b = append(w.b, 0xce)
		w.b = binary.BigEndian.AppendUint32(w.b, uint32(v))
	case v >= 0:
		w.b = append(w.b, 0xcf)
		w.b = binary.BigEndian.AppendUint64(w.b, uint64(v))
	case v >= -128:
		w.b = append(w.b, 0xd0, byte(v))
	case v >= -1<<15:
		w.b = append(w.b, 0xd1)
		w.b = binary.BigEndian.AppendUint16(w.b, uint16(v))
	case v >= -1<<31:
		w.b = append(w.b, 0xd2)
		w.b = binary.BigEndian.AppendUint32(w.b, uint32(v))
	default:
		w.b = append(w.b, 0xd3)
		w.b = binary.BigEndian.AppendUint64(w.b, uint64(v))
	}
}

// batch writes an array_like EventBatch: [ts, events, rank].
func (w *wire) batch(ts float64, rank int, events ...wmap) {
	evs := make([]any, len(events))
	for i, e := range events {
		evs[i] = e
	}
	w.val([]any{ts, evs, rank})
}

// sglStored is a BlockStored of SGLang main: the seven fields every store
// writes, then the optional ones set (in the order given).
func sglStored(hashes []int64, parent any, tokens []int64, medium string, opt ...wkv) wmap {
	m := wmap{
		{"type", "BlockStored"},
		{"block_hashes", hashes},
		{"parent_block_hash", parent},
		{"token_ids", tokens},
		{"block_size", 2},
		{"lora_id", nil},
		{"medium", medium},
	}
	return append(m, opt...)
}

func sglRemoved(medium string, hashes ...int64) wmap {
	return wmap{{"type", "BlockRemoved"}, {"block_hashes", hashes}, {"medium", medium}}
}

func allCleared() wmap { return wmap{{"type", "AllBlocksCleared"}} }

// SGLang main's hashes: signed int64s from SHA-256 (one negative, one that
// takes all 64 bits, one above 2^32).
const (
	sgA1 = int64(-6917529027641081856)
	sgA2 = int64(8070450532247928832)
	sgS1 = int64(-42)
	sgS2 = int64(5000000000)
	sgB  = int64(-1 << 63)
	sgL1 = int64(77)
	sgL2 = int64(-300)
	sgC  = int64(123456789)
)

// sglangMainStream: A stores a 2-page prompt; S the same prompt salted, with
// a session; B builds on A (with a session, no salt) and its page is also
// written to the host tier; B's page is evicted and a LoRA request stores the
// prompt; after a clear, C builds on A's chain.
func sglangMainStream() []byte {
	P := []int64{101, 102, 103, 104}
	var w wire
	w.batch(1.5, 0, sglStored([]int64{sgA1, sgA2}, nil, P, "GPU"))
	w.batch(2.5, 0, sglStored([]int64{sgS1, sgS2}, nil, P, "GPU", wkv{"cache_salt", "tenant-a"}, wkv{"session_id", "sess-1"}))
	w.batch(3.5, 0,
		sglStored([]int64{sgB}, sgA2, []int64{105, 106}, "GPU", wkv{"session_id", "sess-2"}),
		sglStored([]int64{sgB}, sgA2, []int64{105, 106}, "CPU_PINNED"))
	w.batch(4.5, 0, sglRemoved("GPU", sgB), sglStored([]int64{sgL1, sgL2}, nil, P, "GPU", wkv{"lora_name", "adapter-a"}))
	w.batch(5.5, 0, allCleared(), sglStored([]int64{sgC}, sgA2, []int64{107, 108}, "GPU"))
	return w.b
}

func hashStrings(hs []BlockHash) []string {
	out := make([]string, len(hs))
	for i, h := range hs {
		out[i] = string(h)
	}
	return out
}

// evWant is what one decoded event must hold.
type evWant struct {
	typ, parent, medium, session, lora, ns string
	hashes                                 []string
	tokens                                 []int32
	salt                                   *string
}

func checkEvent(t *testing.T, where string, ev Event, w evWant) {
	t.Helper()
	salt := func(s *string) string {
		if s == nil {
			return "<nil>"
		}
		return *s
	}
	if ev.Type != w.typ || string(ev.Parent) != w.parent || ev.Medium != w.medium || ev.SessionID != w.session ||
		ev.LoraName != w.lora || namespaceOf(&ev) != w.ns || ev.Component != "" || salt(ev.CacheSalt) != salt(w.salt) ||
		!reflect.DeepEqual(hashStrings(ev.BlockHashes), w.hashes) || (w.tokens != nil && !reflect.DeepEqual(ev.TokenIDs, w.tokens)) {
		t.Errorf("%s: decoded %s hashes %v parent %q tokens %v medium %q salt %s session %q lora %q namespace %q component %q\n    want %+v",
			where, ev.Type, hashStrings(ev.BlockHashes), ev.Parent, ev.TokenIDs, ev.Medium, salt(ev.CacheSalt), ev.SessionID, ev.LoraName, namespaceOf(&ev), ev.Component, w)
	}
}

// SGLang main's tagged-map events in its positional batch decode field by
// field: signed hashes, parents, tokens, medium, salt and session, the LoRA
// name, the removal and the clear; the check follows them.
func TestSGLangMainEvents(t *testing.T) {
	data := sglangMainStream()
	b, err := DecodeEvents(data, "sglang-main.msgpack")
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != 5 || b[0].TS != 1.5 || b[0].DPRank == nil || *b[0].DPRank != 0 {
		t.Fatalf("%d batches, first %+v", len(b), b[0])
	}
	P := []int32{101, 102, 103, 104}
	ta := "tenant-a"
	checkEvent(t, "b0.e0", b[0].Events[0], evWant{typ: "BlockStored", medium: "GPU", hashes: []string{"-6917529027641081856", "8070450532247928832"}, tokens: P})
	checkEvent(t, "b1.e0", b[1].Events[0], evWant{typ: "BlockStored", medium: "GPU", session: "sess-1", salt: &ta, ns: `salt:"tenant-a"`, hashes: []string{"-42", "5000000000"}, tokens: P})
	checkEvent(t, "b2.e0", b[2].Events[0], evWant{typ: "BlockStored", medium: "GPU", session: "sess-2", parent: "8070450532247928832", hashes: []string{"-9223372036854775808"}, tokens: []int32{105, 106}})
	checkEvent(t, "b2.e1", b[2].Events[1], evWant{typ: "BlockStored", medium: "CPU_PINNED", parent: "8070450532247928832", hashes: []string{"-9223372036854775808"}})
	checkEvent(t, "b3.e0", b[3].Events[0], evWant{typ: "BlockRemoved", medium: "GPU", hashes: []string{"-9223372036854775808"}})
	checkEvent(t, "b3.e1", b[3].Events[1], evWant{typ: "BlockStored", medium: "GPU", lora: "adapter-a", ns: "lora:adapter-a", hashes: []string{"77", "-300"}, tokens: P})
	checkEvent(t, "b4.e0", b[4].Events[0], evWant{typ: "AllBlocksCleared", hashes: []string{}})
	for _, ev := range []Event{b[0].Events[0], b[3].Events[1]} {
		if ev.LoraID != nil || ev.BlockSize != 2 || ev.GroupIdx != nil || ev.ExtraKeys != nil {
			t.Fatalf("%+v", ev)
		}
	}
	tr, err := EventsTrace(b, "sglang-main.msgpack", EventsOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := Run(tr, Config{PageSize: 2, Schedule: testCfg.Schedule})
	if err != nil {
		t.Fatal(err)
	}
	checkWants(t, rep, []want{
		{"b0.e0", StatusAgree, "", "", ""},
		{"b1.e0", StatusAgree, KindMissedHit, CauseNamespace, ""},
		{"b2.e0", StatusAgree, "", "", ""},
		{"b3.e1", StatusAgree, KindMissedHit, CauseNamespace, ""},
		{"b4.e1", StatusDiverged, KindEvicted, "", ""},
	})
	if !hasNote(tr, "1 event of other media than GPU skipped") {
		t.Errorf("notes %q", tr.Notes)
	}
}

// vLLM's hashes: unsigned 64-bit ints, two above 2^63.
const (
	vlX1 = uint64(15760518052499183552)
	vlX2 = uint64(12378907579655121043)
	vlY  = uint64(3183184509886770661)
	vlW1 = uint64(11)
	vlW2 = uint64(12)
	vlL1 = uint64(4284880390408332321)
	vlL2 = uint64(10213826896782787679)
	vlZ  = uint64(7)
)

// vllmStored is a vLLM BlockStored map: the seven fields without defaults,
// then the ones set, in declaration order.
func vllmStored(hashes []uint64, parent any, tokens []int64, loraID any, lora any, opt ...wkv) wmap {
	hs := make([]any, len(hashes))
	for i, h := range hashes {
		hs[i] = h
	}
	m := wmap{
		{"type", "BlockStored"},
		{"block_hashes", hs},
		{"parent_block_hash", parent},
		{"token_ids", tokens},
		{"block_size", 4},
		{"lora_id", loraID},
		{"medium", "GPU"},
		{"lora_name", lora},
	}
	for _, o := range opt {
		if o.k == "medium" {
			m[6].v = o.v
			continue
		}
		m = append(m, o)
	}
	return m
}

// vllmStream: X stores 2 blocks of the full-attention group (its session
// named) and the same tokens in a sliding-window group; Y builds on X, and a
// CPU offload of Y's block is published (local); Y's block is evicted, an
// offloaded copy in remote storage goes too, and a LoRA request stores X's
// tokens; Z builds on Y's evicted block; then a clear.
func vllmStream() []byte {
	X := []int64{128000, 128006, 9125, 128007, 271, 65536, 1, 127}
	Y := []int64{128, 255, 256, 65535}
	full := []wkv{{"group_idx", 0}, {"kv_cache_spec_kind", "full_attention"}}
	var w wire
	w.batch(1789095808.8378847, 0,
		vllmStored([]uint64{vlX1, vlX2}, nil, X, nil, nil, append([]wkv{{"extra_keys", []any{nil, nil}}}, append(full, wkv{"session_id", "sess-1"})...)...),
		vllmStored([]uint64{vlW1, vlW2}, nil, X, nil, nil, wkv{"extra_keys", []any{nil, nil}}, wkv{"group_idx", 1}, wkv{"kv_cache_spec_kind", "sliding_window"}, wkv{"kv_cache_spec_sliding_window", 128}))
	w.batch(1789095809.25, 0,
		vllmStored([]uint64{vlY}, vlX2, Y, nil, nil, append([]wkv{{"extra_keys", []any{nil}}}, full...)...),
		vllmStored([]uint64{vlY}, vlX2, Y, nil, nil, wkv{"medium", "CPU"}, wkv{"locality", "LOCAL"}))
	w.batch(1789095810.0, 0,
		wmap{{"type", "BlockRemoved"}, {"block_hashes", []any{vlY}}, {"medium", "GPU"}, {"group_idx", 0}},
		wmap{{"type", "BlockRemoved"}, {"block_hashes", []any{vlY}}, {"medium", "STORAGE"}, {"locality", "REMOTE"}, {"ownership", "tier-2"}},
		vllmStored([]uint64{vlL1, vlL2}, nil, X, 1, "sql", append([]wkv{{"extra_keys", []any{[]any{"sql"}, []any{"sql"}}}}, full...)...))
	w.batch(1789095811.0, 0, vllmStored([]uint64{vlZ}, vlY, []int64{3, 4, 5, 6}, nil, nil, append([]wkv{{"extra_keys", []any{nil}}}, full...)...))
	w.batch(1789095812.0, 0, allCleared())
	return w.b
}

// vLLM's current map events (with the locality, ownership and session_id
// fields added since the ones our fixture has) decode field by field:
// unsigned hashes above 2^63, the group and spec kind, extra keys per block,
// the LoRA name; other media and groups are skipped.
func TestVLLMCurrentEvents(t *testing.T) {
	b, err := DecodeEvents(vllmStream(), "vllm.msgpack")
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != 5 || b[0].TS != 1789095808.8378847 || b[0].DPRank == nil || *b[0].DPRank != 0 {
		t.Fatalf("%d batches, first %+v", len(b), b[0])
	}
	X := []int32{128000, 128006, 9125, 128007, 271, 65536, 1, 127}
	checkEvent(t, "b0.e0", b[0].Events[0], evWant{typ: "BlockStored", medium: "GPU", session: "sess-1", hashes: []string{"15760518052499183552", "12378907579655121043"}, tokens: X})
	checkEvent(t, "b1.e0", b[1].Events[0], evWant{typ: "BlockStored", medium: "GPU", parent: "12378907579655121043", hashes: []string{"3183184509886770661"}, tokens: []int32{128, 255, 256, 65535}})
	checkEvent(t, "b1.e1", b[1].Events[1], evWant{typ: "BlockStored", medium: "CPU", parent: "12378907579655121043", hashes: []string{"3183184509886770661"}})
	checkEvent(t, "b2.e0", b[2].Events[0], evWant{typ: "BlockRemoved", medium: "GPU", hashes: []string{"3183184509886770661"}})
	checkEvent(t, "b2.e1", b[2].Events[1], evWant{typ: "BlockRemoved", medium: "STORAGE", hashes: []string{"3183184509886770661"}})
	checkEvent(t, "b2.e2", b[2].Events[2], evWant{typ: "BlockStored", medium: "GPU", lora: "sql", ns: "lora:sql", hashes: []string{"4284880390408332321", "10213826896782787679"}, tokens: X})
	x, sw := b[0].Events[0], b[0].Events[1]
	if x.GroupIdx == nil || *x.GroupIdx != 0 || x.SpecKind != "full_attention" || len(x.ExtraKeys) != 2 || x.ExtraKeys[0] != "" || x.LoraID != nil || x.BlockSize != 4 {
		t.Errorf("b0.e0: %+v", x)
	}
	if sw.GroupIdx == nil || *sw.GroupIdx != 1 || sw.SpecKind != "sliding_window" {
		t.Errorf("b0.e1: %+v", sw)
	}
	if l := b[2].Events[2]; l.LoraID == nil || *l.LoraID != 1 || len(l.ExtraKeys) != 2 || l.ExtraKeys[0] != "\x91\xa3sql" {
		t.Errorf("b2.e2: %+v", l)
	}
	tr, err := EventsTrace(b, "vllm.msgpack", EventsOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := Run(tr, Config{PageSize: 4, Schedule: testCfg.Schedule})
	if err != nil {
		t.Fatal(err)
	}
	checkWants(t, rep, []want{
		{"b0.e0", StatusAgree, "", "", ""},
		{"b1.e0", StatusAgree, "", "", ""},
		// Its pages' extra keys (the adapter's name) differ from X's: they
		// share nothing, whatever the namespace.
		{"b2.e2", StatusAgree, "", "", ""},
		{"b3.e0", StatusDiverged, KindEvicted, "", ""},
	})
	notes := strings.Join(tr.Notes, "; ")
	if !strings.Contains(notes, "2 events of other media than GPU skipped") || !strings.Contains(notes, "1 event of other KV-cache groups than 0 skipped") {
		t.Errorf("notes %q", notes)
	}
}

// Under EAGLE, SGLang keys its radix tree by bigrams and its events keep
// them: each token of token_ids is the pair (token j, token j+1), a tuple
// msgspec writes as an array (mem_cache/events.py at
// 06f643f402f0d7e1c4fd480f6854b742fa642951, record_store: "bigram pages
// expose tuples"; block_size counts pairs). A page of pairs holds one token
// more than the page (the next one), so reading each pair's first token
// would match pages the engine cannot: the decoder refuses the stream and
// says why, in both encodings.
func TestSGLangBigramTokens(t *testing.T) {
	pairs := []any{[]any{10, 20}, []any{20, 30}}
	m := wmap{{"type", "BlockStored"}, {"block_hashes", []int64{5}}, {"parent_block_hash", nil},
		{"token_ids", pairs}, {"block_size", 2}, {"lora_id", nil}, {"medium", "GPU"}}
	var w wire
	w.batch(1, 0, m)
	var a wire
	a.val([]any{1.0, []any{[]any{"BlockStored", []int64{5}, nil, pairs, 2, nil, "GPU"}}, 0})
	for name, data := range map[string][]byte{"map": w.b, "array": a.b} {
		_, err := DecodeEvents(data, "eagle.msgpack")
		if err == nil || !strings.Contains(err.Error(), "BlockStored.token_ids[0]: a token pair") || !strings.Contains(err.Error(), "EAGLE") {
			t.Errorf("%s: error %v", name, err)
		}
	}
}
