package replay

import (
	"encoding/json"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
)

// TestV41DumpRefused: a dump whose ModelArgs are V4.1 is refused with the
// reason, not replayed through V4's stage graph.
func TestV41DumpRefused(t *testing.T) {
	cfg, err := engine.Preset("v41-tiny")
	if err != nil {
		t.Fatal(err)
	}
	js, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	d := &dump.Dump{Path: "x.smd", Format: "native", Header: dump.Header{ModelArgs: string(js)}}
	_, err = LoadModelWith(d, nil, LoadOptions{})
	if err == nil || !strings.Contains(err.Error(), "DeepSeek-V4.1") {
		t.Fatalf("V4.1 dump: err = %v", err)
	}
}
