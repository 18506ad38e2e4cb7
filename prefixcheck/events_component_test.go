package prefixcheck

import (
	"strings"
	"testing"
)

// SGLang's per-component KV events (--enable-kv-events-component-types), as
// its source writes them (python/sglang/srt/mem_cache/events.py,
// KVCacheEventRecorder; test/.../test_kv_events_component_types.py): on a
// hybrid model (DeepSeek V3.2/V4: full latent KV, SWA window, C128
// compressed cache; Qwen3-Next: mamba) each component's store is its own
// event, BlockStoredWithComponentType(block_hashes, parent_block_hash,
// token_ids, block_size, lora_id=None, component_type=str(ComponentType),
// medium) — "full", "swa", "mamba", "c128", "draft" — or, on a salted node,
// BlockStoredWithComponentTypeAndMetadata with metadata=BlockStoredMetadata;
// removals are BlockRemovedWithComponentType(block_hashes, component_type,
// medium); AllBlocksCleared has no component. Full and SWA pages carry the
// node's page hashes (the same hashes for every component); a mamba
// checkpoint is one leaf event, its node's last page hash with no parent and
// that page's tokens. The classes subclass BlockStored / BlockRemoved (the
// recorder tests them before the base classes) whose medium has a default,
// so the required component_type is keyword-only and msgspec places it after
// medium: ["BlockStored", hashes, parent, tokens, block_size, lora_id,
// medium, component_type(, metadata)] and ["BlockRemoved", hashes, medium,
// component_type] in SGLang's array_like form, a "component_type" key in the
// tagged-map form.

// sgComp is an SGLang component event.
type sgComp struct {
	removed bool
	stored
	comp string
	salt *string
}

// sglangComponentEvent writes ev as the array_like structs encode it.
func (x *evEnc) sglangComponentEvent(ev sgComp) {
	if ev.removed {
		x.must(x.e.EncodeArrayLen(4))
		x.must(x.e.EncodeString("BlockRemoved"))
		x.ints(ev.hashes)
		x.must(x.e.EncodeString(ev.medium))
		x.must(x.e.EncodeString(ev.comp))
		return
	}
	n := 8
	if ev.salt != nil {
		n = 9
	}
	x.must(x.e.EncodeArrayLen(n))
	x.must(x.e.EncodeString("BlockStored"))
	x.ints(ev.hashes)
	x.optInt(ev.parent)
	x.ints(ev.tokens)
	x.must(x.e.EncodeInt(int64(ev.bs)))
	x.must(x.e.EncodeNil()) // lora_id
	x.must(x.e.EncodeString(ev.medium))
	x.must(x.e.EncodeString(ev.comp))
	if ev.salt != nil {
		x.metadataMap(ev.salt, nil)
	}
}

// sglangComponentMapEvent writes ev as a tagged map (msgspec without
// array_like: declaration order, None defaults omitted).
func (x *evEnc) sglangComponentMapEvent(ev sgComp) {
	if ev.removed {
		x.must(x.e.EncodeMapLen(4))
		x.must(x.e.EncodeString("type"))
		x.must(x.e.EncodeString("BlockRemoved"))
		x.must(x.e.EncodeString("block_hashes"))
		x.ints(ev.hashes)
		x.must(x.e.EncodeString("medium"))
		x.must(x.e.EncodeString(ev.medium))
		x.must(x.e.EncodeString("component_type"))
		x.must(x.e.EncodeString(ev.comp))
		return
	}
	more := []kv{{"component_type", func() { x.must(x.e.EncodeString(ev.comp)) }}}
	if ev.salt != nil {
		more = append(more, kv{"cache_salt", func() { x.must(x.e.EncodeString(*ev.salt)) }})
	}
	x.sglangStoredMap(ev.stored, more...)
}

func (x *evEnc) sglangComponentBatch(shape string, ts float64, evs ...sgComp) {
	x.must(x.e.EncodeArrayLen(3))
	x.must(x.e.EncodeFloat64(ts))
	x.must(x.e.EncodeArrayLen(len(evs)))
	for _, ev := range evs {
		if shape == "array" {
			x.sglangComponentEvent(ev)
		} else {
			x.sglangComponentMapEvent(ev)
		}
	}
	x.must(x.e.EncodeInt(0))
}

// componentStream is a DeepSeek-like run with two components, full and swa,
// pages of 2 tokens, as the recorder publishes it: request A stores a 3-page
// prompt (a full event, then the swa event of the same pages); the SWA
// window slides off A's first two pages (an swa removal: the full KV stays);
// request B, the same prompt and one more page, hits A's 6 tokens (full
// attention) and stores its page for both components; then the full KV of
// A's pages 2 and 3 is evicted with B's page (both components go), and C
// asks A's prompt again: it hits A's first page only. salt, when set, salts
// every store.
func componentStream(shape string, salt *string) []byte {
	P := seqTok(100, 6)
	st := func(comp string, hashes []int64, parent *int64, tokens []int64) sgComp {
		return sgComp{stored: stored{hashes: hashes, parent: parent, tokens: tokens, bs: 2, medium: "GPU"}, comp: comp, salt: salt}
	}
	rm := func(comp string, hashes ...int64) sgComp {
		return sgComp{removed: true, stored: stored{hashes: hashes, medium: "GPU"}, comp: comp}
	}
	x := newEvEnc()
	x.sglangComponentBatch(shape, 1, st("full", []int64{11, 12, 13}, nil, P), st("swa", []int64{11, 12, 13}, nil, P))
	x.sglangComponentBatch(shape, 2, rm("swa", 11, 12))
	x.sglangComponentBatch(shape, 3, st("full", []int64{14}, p64(13), []int64{7, 8}), st("swa", []int64{14}, p64(13), []int64{7, 8}))
	x.sglangComponentBatch(shape, 4, rm("full", 14), rm("swa", 14), rm("full", 12, 13), rm("swa", 13))
	x.sglangComponentBatch(shape, 5, st("full", []int64{22, 23}, p64(11), P[2:]), st("swa", []int64{22, 23}, p64(11), P[2:]))
	return x.buf.Bytes()
}

func runComponentStream(t *testing.T, data []byte, opt EventsOptions) (*Trace, *Report, error) {
	t.Helper()
	b, err := DecodeEvents(data, "components.msgpack")
	if err != nil {
		return nil, nil, err
	}
	tr, err := EventsTrace(b, "components.msgpack", opt)
	if err != nil {
		return nil, nil, err
	}
	rep, err := Run(tr, Config{PageSize: 2, Schedule: testCfg.Schedule})
	return tr, rep, err
}

// mambaStream: full and swa pages stored for two requests, and between them
// the mamba checkpoint of A's node (its last page's hash, no parent, that
// page's tokens), as hybrid models publish it.
func mambaStream(shape string) []byte {
	P := seqTok(100, 6)
	st := func(comp string, hashes []int64, parent *int64, tokens []int64) sgComp {
		return sgComp{stored: stored{hashes: hashes, parent: parent, tokens: tokens, bs: 2, medium: "GPU"}, comp: comp}
	}
	x := newEvEnc()
	x.sglangComponentBatch(shape, 1, st("full", []int64{11, 12, 13}, nil, P), st("swa", []int64{11, 12, 13}, nil, P))
	x.sglangComponentBatch(shape, 2, st("mamba", []int64{13}, nil, P[4:]))
	x.sglangComponentBatch(shape, 3, st("full", []int64{14}, p64(13), []int64{7, 8}), st("swa", []int64{14}, p64(13), []int64{7, 8}))
	return x.buf.Bytes()
}

// Each SGLang component is a cache of its own: by default the full one is
// checked, the others are skipped with a note; before, the array form's
// component_type was read as lora_name (namespace "lora:swa", "lora:mamba":
// false namespace-mix and overwritten-page divergences) and its removals
// and salted stores were errors, and the map form merged the components
// into one cache (a mamba checkpoint overwrote a full page: a false
// divergence; every swa store a request of its own).
func TestSGLangComponentEvents(t *testing.T) {
	for _, shape := range []string{"array", "map"} {
		for _, salted := range []bool{false, true} {
			var salt *string
			name := shape
			if salted {
				salt = pstr("tenant-a")
				name += "-salted"
			}
			t.Run(name, func(t *testing.T) {
				tr, rep, err := runComponentStream(t, componentStream(shape, salt), EventsOptions{})
				if err != nil {
					t.Fatal(err)
				}
				checkWants(t, rep, []want{
					{"b0.e0", StatusAgree, "", "", ""},
					{"b2.e0", StatusAgree, "", "", ""},
					{"b4.e0", StatusAgree, KindMissedHit, CauseEviction, `page 1 (tokens [2, 4)) was cached by request "b0.e0" and evicted by the engine`},
				})
				if rep.Diverged() {
					t.Fatalf("verdict %s", rep.Verdict)
				}
				notes := strings.Join(tr.Notes, "; ")
				if !strings.Contains(notes, `6 events of other KV-cache components than "full" skipped (6 "swa")`) {
					t.Fatalf("notes %q", notes)
				}
				for _, r := range tr.Requests {
					if want := ""; salted {
						if want = `salt:"tenant-a"`; r.Namespace != want {
							t.Fatalf("request %s: namespace %q", r.ID, r.Namespace)
						}
					} else if r.Namespace != want {
						t.Fatalf("request %s: namespace %q", r.ID, r.Namespace)
					}
				}
			})
		}
		t.Run(shape+"-mamba", func(t *testing.T) {
			tr, rep, err := runComponentStream(t, mambaStream(shape), EventsOptions{})
			if err != nil {
				t.Fatal(err)
			}
			checkWants(t, rep, []want{{"b0.e0", StatusAgree, "", "", ""}, {"b2.e0", StatusAgree, "", "", ""}})
			if rep.Diverged() || !strings.Contains(strings.Join(tr.Notes, "; "), `(1 "mamba", 2 "swa")`) {
				t.Fatalf("verdict %s, notes %q", rep.Verdict, tr.Notes)
			}
		})
		// Component picks another component's cache (an SWA window's
		// slides are its removals, so a prefix check of it reports them as
		// evictions: the full component is the one to check).
		t.Run(shape+"-swa", func(t *testing.T) {
			tr, rep, err := runComponentStream(t, mambaStream(shape), EventsOptions{Component: "swa"})
			if err != nil {
				t.Fatal(err)
			}
			if len(rep.Requests) != 2 || rep.Requests[1].Recorded == nil || rep.Requests[1].Recorded.Tokens != 6 || rep.Diverged() {
				t.Fatalf("requests %+v", rep.Requests)
			}
			if !strings.Contains(strings.Join(tr.Notes, "; "), `3 events of other KV-cache components than "swa" skipped (2 "full", 1 "mamba")`) {
				t.Fatalf("notes %q", tr.Notes)
			}
			if _, _, err := runComponentStream(t, componentStream(shape, nil), EventsOptions{Component: "c128"}); err == nil || !strings.Contains(err.Error(), `no BlockStored events (of medium GPU, component "c128")`) {
				t.Fatalf("component c128: %v", err)
			}
		})
	}
}

// Position 7 of an array BlockStored is vLLM's lora_name unless the event
// has SGLang's component shape (no lora_id; nothing after it but the
// metadata map), and a component names no namespace.
func TestComponentOrLoraName(t *testing.T) {
	ev := func(n int, loraID *int64, at7 string, at8 func(x *evEnc)) []byte {
		return mapBatchWith(func(x *evEnc) {
			x.must(x.e.EncodeArrayLen(n))
			x.must(x.e.EncodeString("BlockStored"))
			x.ints([]int64{1})
			x.must(x.e.EncodeNil())
			x.ints([]int64{5, 6})
			x.must(x.e.EncodeInt(2))
			x.optInt(loraID)
			x.must(x.e.EncodeString("GPU"))
			x.must(x.e.EncodeString(at7))
			if at8 != nil {
				at8(x)
			}
		})
	}
	extra := func(x *evEnc) { x.must(x.e.EncodeArrayLen(1)); x.must(x.e.EncodeNil()) }
	salt := func(x *evEnc) { x.metadataMap(pstr("s"), nil) }
	for _, c := range []struct {
		name           string
		data           []byte
		lora, comp, ns string
	}{
		{"vLLM lora_name with lora_id", ev(8, p64(3), "swa", nil), "swa", "", "lora:swa"},
		{"vLLM lora_name with extra_keys", ev(9, nil, "full", extra), "full", "", "lora:full"},
		{"SGLang component", ev(8, nil, "swa", nil), "", "swa", ""},
		{"SGLang salted component", ev(9, nil, "c128", salt), "", "c128", `salt:"s"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			b, err := DecodeEvents(c.data, "x")
			if err != nil {
				t.Fatal(err)
			}
			e := b[0].Events[0]
			if e.LoraName != c.lora || e.Component != c.comp || namespaceOf(&e) != c.ns {
				t.Fatalf("lora_name %q component %q namespace %q", e.LoraName, e.Component, namespaceOf(&e))
			}
		})
	}
}

// The component classes under their own tags (msgspec's default for
// tag=True), PR #32514's component_types list, and bad component fields.
func TestComponentEventShapes(t *testing.T) {
	tagged := mapBatchWith(func(x *evEnc) {
		x.must(x.e.EncodeArrayLen(9))
		x.must(x.e.EncodeString("BlockStoredWithComponentTypeAndMetadata"))
		x.ints([]int64{1})
		x.must(x.e.EncodeNil())
		x.ints([]int64{5, 6})
		x.must(x.e.EncodeInt(2))
		x.must(x.e.EncodeInt(4)) // a lora_id: the tag says component
		x.must(x.e.EncodeString("GPU"))
		x.must(x.e.EncodeString("swa"))
		x.metadataMap(pstr("s"), nil)
	})
	b, err := DecodeEvents(tagged, "x")
	if err != nil {
		t.Fatal(err)
	}
	if e := b[0].Events[0]; e.Type != "BlockStored" || e.Component != "swa" || e.CacheSalt == nil || e.LoraName != "" {
		t.Fatalf("decoded %+v", e)
	}
	removed := mapBatchWith(func(x *evEnc) {
		x.must(x.e.EncodeMapLen(3))
		x.must(x.e.EncodeString("type"))
		x.must(x.e.EncodeString("BlockRemovedWithComponentType"))
		x.must(x.e.EncodeString("block_hashes"))
		x.ints([]int64{1})
		x.must(x.e.EncodeString("component_type"))
		x.must(x.e.EncodeString("mamba"))
	})
	if b, err = DecodeEvents(removed, "x"); err != nil || b[0].Events[0].Type != "BlockRemoved" || b[0].Events[0].Component != "mamba" {
		t.Fatalf("decoded %+v, %v", b, err)
	}
	list := func(v func(x *evEnc)) []byte {
		return mapBatchWith(func(x *evEnc) {
			x.must(x.e.EncodeArrayLen(8))
			x.must(x.e.EncodeString("BlockStored"))
			x.ints([]int64{1})
			x.must(x.e.EncodeNil())
			x.ints([]int64{5, 6})
			x.must(x.e.EncodeInt(2))
			x.must(x.e.EncodeNil())
			x.must(x.e.EncodeString("GPU"))
			v(x)
		})
	}
	pr32514 := list(func(x *evEnc) {
		x.must(x.e.EncodeArrayLen(2))
		x.must(x.e.EncodeString("full"))
		x.must(x.e.EncodeString("swa"))
	})
	if b, err = DecodeEvents(pr32514, "x"); err != nil || b[0].Events[0].Component != "" || b[0].Events[0].LoraName != "" {
		t.Fatalf("component_types: %+v, %v", b, err)
	}
	long := strings.Repeat("x", maxStrBytes+1)
	for _, c := range []struct {
		name string
		data []byte
		want string
	}{
		{"component_types not strings", list(func(x *evEnc) { x.must(x.e.EncodeArrayLen(1)); x.must(x.e.EncodeInt(3)) }), "byte 37: BlockStored.component_types[0]: want a string, found msgpack code 0x03"},
		{"component too long", list(func(x *evEnc) { x.must(x.e.EncodeString(long)) }), "byte 36: BlockStored.lora_name or component_type: string of 65537 bytes"},
		{"map component not a string", mapBatchWith(func(x *evEnc) {
			x.must(x.e.EncodeMapLen(2))
			x.must(x.e.EncodeString("type"))
			x.must(x.e.EncodeString("BlockRemoved"))
			x.must(x.e.EncodeString("component_type"))
			x.must(x.e.EncodeInt(1))
		}), "BlockRemoved.component_type: want a string, found msgpack code 0x01"},
		{"unknown tag", mapBatchWith(func(x *evEnc) {
			x.must(x.e.EncodeMapLen(1))
			x.must(x.e.EncodeString("type"))
			x.must(x.e.EncodeString("BlockStoredWithComponents\n"))
		}), `unknown event type "BlockStoredWithComponents\n"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := DecodeEvents(c.data, "x")
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want %q", err, c.want)
			}
		})
	}
}

// EncodeEvents writes the component events back as SGLang does.
func TestEncodeComponentRoundTrip(t *testing.T) {
	for _, shape := range []string{"array", "map"} {
		data := componentStream(shape, pstr("tenant-a"))
		b, err := DecodeEvents(data, "x")
		if err != nil {
			t.Fatal(err)
		}
		enc := EncodingArray
		if shape == "map" {
			enc = EncodingMap
		}
		back, err := EncodeEvents(b, enc)
		if err != nil {
			t.Fatal(err)
		}
		b2, err := DecodeEvents(back, "y")
		if err != nil {
			t.Fatal(err)
		}
		for i := range b {
			for j := range b[i].Events {
				e1, e2 := b[i].Events[j], b2[i].Events[j]
				if e1.Component != e2.Component || e1.Type != e2.Type || namespaceOf(&e1) != namespaceOf(&e2) || len(e1.BlockHashes) != len(e2.BlockHashes) {
					t.Fatalf("%s: event %d.%d: %+v, back %+v", shape, i, j, e1, e2)
				}
			}
		}
	}
}
