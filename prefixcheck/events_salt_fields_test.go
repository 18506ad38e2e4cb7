package prefixcheck

import "testing"

// SGLang's salted events decode in all three shapes, and carry the salt.
func TestSGLangSaltedEventsDecode(t *testing.T) {
	for _, shape := range []string{"array", "map", "nested"} {
		t.Run(shape, func(t *testing.T) {
			b, err := DecodeEvents(saltStream(shape, pstr("tenant-a"), pstr("")), "salt.msgpack")
			if err != nil {
				t.Fatal(err)
			}
			if len(b) != 3 {
				t.Fatalf("%d batches", len(b))
			}
			a, bb, c := b[0].Events[0], b[1].Events[0], b[2].Events[0]
			if a.CacheSalt == nil || *a.CacheSalt != "tenant-a" || a.SessionID != "sess-1" || a.Medium != "GPU" || a.LoraName != "" || len(a.BlockHashes) != 2 {
				t.Fatalf("event A %+v", a)
			}
			if bb.CacheSalt == nil || *bb.CacheSalt != "" || bb.SessionID != "sess-2" {
				t.Fatalf("event B: an empty salt is a salt (SGLang tests cache_salt is not None): %+v", bb)
			}
			if c.CacheSalt == nil || *c.CacheSalt != "tenant-a" || c.SessionID != "" {
				t.Fatalf("event C %+v", c)
			}
			if got := namespaceOf(&a); got != `salt:"tenant-a"` {
				t.Fatalf("namespace %q", got)
			}
		})
	}
	// An unsalted event keeps the legacy 7 elements (medium at 6) and no salt.
	x := newEvEnc()
	x.sglangSaltBatch("array", 1, sgStored{stored: stored{hashes: []int64{1}, tokens: []int64{1, 2}, bs: 2, medium: "GPU"}})
	b, err := DecodeEvents(x.buf.Bytes(), "x")
	if err != nil || b[0].Events[0].CacheSalt != nil || b[0].Events[0].Medium != "GPU" {
		t.Fatalf("%+v %v", b, err)
	}
}

// The salt and the LoRA adapter make one namespace together; neither can be
// forged by the other's text.
func TestSaltNamespace(t *testing.T) {
	s := func(v string) *string { return &v }
	id := int64(3)
	cases := []struct {
		ev   Event
		want string
	}{
		{Event{}, ""},
		{Event{LoraName: "sql"}, "lora:sql"},
		{Event{LoraID: &id}, "lora-id:3"},
		{Event{CacheSalt: s("t")}, `salt:"t"`},
		{Event{CacheSalt: s("")}, `salt:""`},
		{Event{CacheSalt: s("t"), LoraName: "sql"}, `salt:"t" lora:sql`},
		{Event{CacheSalt: s("t\" lora:x"), SessionID: "ignored"}, `salt:"t\" lora:x"`},
		{Event{LoraName: `x salt:"t"`}, `lora:x salt:"t"`},
	}
	seen := map[string]bool{}
	for _, c := range cases {
		got := namespaceOf(&c.ev)
		if got != c.want {
			t.Errorf("%+v: namespace %q, want %q", c.ev, got, c.want)
		}
		if seen[got] {
			t.Errorf("namespace %q twice", got)
		}
		seen[got] = true
	}
}
