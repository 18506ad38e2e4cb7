package htmlreport

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"sparsemla/kvcache"
	"sparsemla/prefixcheck"
)

func TestWritePrefix(t *testing.T) {
	data, err := os.ReadFile("../testdata/prefixcheck/vllm-kv-events.msgpack")
	if err != nil {
		t.Fatal(err)
	}
	b, err := prefixcheck.DecodeEvents(data, "vllm-kv-events.msgpack")
	if err != nil {
		t.Fatal(err)
	}
	tr, err := prefixcheck.EventsTrace(b, "vllm-kv-events.msgpack", prefixcheck.EventsOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := prefixcheck.Run(tr, prefixcheck.Config{PageSize: 4, Schedule: kvcache.Schedule{Window: 4, Ratios: []int{0, 4, 128}}})
	if err != nil {
		t.Fatal(err)
	}
	var p1, p2 bytes.Buffer
	if err := WritePrefix(&p1, rep); err != nil {
		t.Fatal(err)
	}
	if err := WritePrefix(&p2, rep); err != nil {
		t.Fatal(err)
	}
	page := p1.String()
	if !bytes.Equal(p1.Bytes(), p2.Bytes()) {
		t.Fatal("two renderings differ")
	}
	if !IsPage(p1.Bytes()) || IsPage([]byte("<!DOCTYPE html>\n<html><head><title>my notes")) {
		t.Error("IsPage does not tell a prefix page from another HTML file")
	}
	for _, want := range []string{"first divergence: request b2.e1 (#3): evicted-page", `<tr class="diverged"><td>6</td>`, "overwritten-page", "missed-hit (namespace)", "1 event of other media than GPU skipped"} {
		if !strings.Contains(page, want) {
			t.Errorf("page lacks %q", want)
		}
	}
	if strings.Contains(page, "http://") || strings.Contains(page, "https://") {
		t.Error("page loads something from the network")
	}
}
