package replay

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	"sparsemla/engine"
	"sparsemla/kvcache"
	"sparsemla/quant"
)

// TestComparePagesOtherExactScale: an FP8 block written with the other exact
// scale encodes its row. A writer given a pre-quantisation block of amax
// 1.7505 picks 2^ceil(log2(1.7505/448)) = 2^-7 and stores codes 224 (= 1.75)
// and 128 (= 1.0); the reference encoding of the decoded row (amax exactly
// 1.75 = 448·2^-8) picks 2^-8 and codes 448 and 256. Both decode to the same
// row (the gpu-v4-tiny-long window-K pages hold such a block). A scale changed
// without its codes does not encode the row.
func TestComparePagesOtherExactScale(t *testing.T) {
	const D, B = 512, 64
	cfg := &engine.Config{WindowSize: 128}
	row := make([]float32, D)
	for i := range row[:448] {
		row[i] = 1
		if i%64 == 0 {
			row[i] = 1.75
		}
	}
	ref := engine.Tensor{Kind: engine.KindBF16, Shape: []int{1, D}, F: row}
	page, err := RewritePage("v4-model1", D, B, nil, map[int][]float32{0: row})
	if err != nil {
		t.Fatal(err)
	}
	s0 := B * kvcache.Model1DataBytes
	if page[0] != quant.EncodeE4M3(448) || page[1] != quant.EncodeE4M3(256) || page[s0] != 127-8 {
		t.Fatalf("reference encoding: code 0x%02x, scale byte %d", page[0], page[s0])
	}
	pg := func(data []byte) []Page {
		return []Page{{Layout: "v4-model1", PageID: 1, BlockSize: B, BlockTable: []int{1}, Data: data}}
	}
	if d, err := comparePages(cfg, 0, ref, pg(page)); err != nil || d != "" {
		t.Fatalf("reference page: %q %v", d, err)
	}
	other := append([]byte(nil), page...)
	other[0] = quant.EncodeE4M3(224)
	for i := 1; i < 64; i++ {
		other[i] = quant.EncodeE4M3(128)
	}
	other[s0]++
	if d, err := comparePages(cfg, 0, ref, pg(other)); err != nil || d != "" {
		t.Errorf("the other exact scale: %q %v", d, err)
	}
	bad := append([]byte(nil), page...)
	bad[s0]++ // scale doubled, codes kept: the block decodes to 2.0
	if d, err := comparePages(cfg, 0, ref, pg(bad)); err != nil || d == "" {
		t.Errorf("a doubled scale passed: %q %v", d, err)
	}
}

// A page record's block size is a header's claim: a few page bytes (or none:
// a zero-byte record reads as nil) claiming 2^20 entries of bf16 rows fail on
// their length before a page of that size (1 GiB) is allocated to re-encode
// them.
func TestComparePagesClaimedBlockSize(t *testing.T) {
	const D = 512
	cfg := &engine.Config{WindowSize: 128}
	ref := engine.Tensor{Kind: engine.KindBF16, Shape: []int{1, D}, F: make([]float32, D)}
	for _, c := range []struct {
		layout string
		data   []byte
	}{{"bf16", make([]byte, 16)}, {"v4-model1", make([]byte, 16)}, {"bf16", nil}} {
		layout := c.layout
		pages := []Page{{Layout: layout, PageID: 1, BlockSize: 1 << 20, BlockTable: []int{1}, Data: c.data, Origin: "dump x: record 3"}}
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		d, err := comparePages(cfg, 0, ref, pages)
		runtime.ReadMemStats(&after)
		if err == nil || !strings.Contains(err.Error(), "dump x: record 3: page 1: "+layout+"[dim 512, 1048576 entries/page") || !strings.Contains(err.Error(), fmt.Sprintf("page has %d bytes, want", len(c.data))) {
			t.Errorf("%s: %q %v", layout, d, err)
		}
		if a := after.TotalAlloc - before.TotalAlloc; a > 16<<20 {
			t.Errorf("%s: %d page bytes claiming 2^20 entries allocated %d MiB", layout, len(c.data), a>>20)
		}
		if c.data == nil {
			continue
		}
		// RewritePage itself (fault re-encodes dumped pages with it).
		runtime.ReadMemStats(&before)
		_, err = RewritePage(layout, D, 1<<20, c.data[:0], map[int][]float32{0: ref.F})
		runtime.ReadMemStats(&after)
		if err == nil || !strings.Contains(err.Error(), "page has 0 bytes, want") {
			t.Errorf("%s: RewritePage of an empty page: %v", layout, err)
		}
		if a := after.TotalAlloc - before.TotalAlloc; a > 16<<20 {
			t.Errorf("%s: RewritePage of an empty page claiming 2^20 entries allocated %d MiB", layout, a>>20)
		}
	}
}
