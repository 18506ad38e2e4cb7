package replay

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"sparsemla/engine"
)

// TestParseModelArgsReuse: parseModelArgs gives engine.ParseConfig's config
// for every text, a new one each call (a caller's edits do not reach the
// next), and never caches an error.
func TestParseModelArgsReuse(t *testing.T) {
	tiny, err := engine.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(tiny)
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	other := strings.Replace(text, `"window_size":128`, `"window_size":64`, 1)
	if other == text {
		t.Fatal("the tiny preset's JSON has no window_size 128")
	}
	for i, txt := range []string{text, text, other, "{", text, `{"dim": 0}`, other} {
		want, werr := engine.ParseConfig([]byte(txt))
		got, gerr := parseModelArgs(txt)
		if (werr == nil) != (gerr == nil) || werr != nil && werr.Error() != gerr.Error() {
			t.Fatalf("text %d: error %v, want %v", i, gerr, werr)
		}
		if werr != nil {
			continue
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("text %d: config %+v, want %+v", i, got, want)
		}
		// A caller's edits stay its own.
		got.CompressRatios[0], got.WindowSize = 99, 7
	}
}
