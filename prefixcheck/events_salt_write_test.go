package prefixcheck

import "testing"

// EncodeEvents writes the salt and session in both encodings, and they read
// back.
func TestEncodeSaltRoundTrip(t *testing.T) {
	for _, shape := range []string{"array", "map"} {
		in, err := DecodeEvents(saltStream(shape, pstr("tenant-a"), pstr("")), "x")
		if err != nil {
			t.Fatal(err)
		}
		enc := EncodingArray
		if shape == "map" {
			enc = EncodingMap
		}
		out, err := EncodeEvents(in, enc)
		if err != nil {
			t.Fatal(err)
		}
		back, err := DecodeEvents(out, "x")
		if err != nil {
			t.Fatal(err)
		}
		for i := range in {
			a, b := in[i].Events[0], back[i].Events[0]
			if (a.CacheSalt == nil) != (b.CacheSalt == nil) || a.CacheSalt != nil && *a.CacheSalt != *b.CacheSalt || a.SessionID != b.SessionID || namespaceOf(&a) != namespaceOf(&b) {
				t.Fatalf("%s batch %d: %+v read back as %+v", shape, i, a, b)
			}
		}
	}
}
