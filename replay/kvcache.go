package replay

import (
	"fmt"
	"math"

	"sparsemla/engine"
	"sparsemla/kvcache"
)

// The replay checks KV pages and prefix-cache hits through the kvcache
// package: the page codecs of the serving layouts and the prefix-hit
// verifier.

// kvFormat resolves a layout name and its page geometry.
func kvFormat(layout string, dim, blockSize int) (kvcache.Format, kvcache.Layout, error) {
	l, err := kvcache.ParseLayout(layout)
	if err != nil {
		return kvcache.Format{}, 0, err
	}
	f, err := kvcache.NewFormat(l, dim, blockSize)
	return f, l, err
}

// RewritePage returns a copy of page (a KV page of the serving layout layout,
// blockSize entries of dim values; nil: zero bytes) in which the entries named
// in rows are encoded from those rows with the reference scaling
// (kvcache.RefScaling); other entries keep their bytes. The replay compares
// the GPU's pages with it, and fault re-encodes the pages of a changed cache
// with it. The page's length is checked before the copy is allocated: the
// block size is a header's claim (up to 2^20 entries, a 1 GiB page of bf16
// rows), the page bytes are what the dump holds.
func RewritePage(layout string, dim, blockSize int, page []byte, rows map[int][]float32) ([]byte, error) {
	f, l, err := kvFormat(layout, dim, blockSize)
	if err != nil {
		return nil, err
	}
	if page != nil && len(page) != f.PageBytes() {
		return nil, fmt.Errorf("%v page has %d bytes, want %d", f, len(page), f.PageBytes())
	}
	out := make([]byte, f.PageBytes())
	copy(out, page)
	for e, row := range rows {
		if e < 0 || e >= blockSize || len(row) != f.Dim {
			return nil, fmt.Errorf("%v: entry %d with %d values", f, e, len(row))
		}
		f.EncodeEntry(out, e, row, kvcache.RefScaling(l))
	}
	return out, nil
}

// decodesTo says whether entry e of page (serving layout layout) decodes,
// with no fault, to exactly row (bit for bit). An FP8 block has more than
// one exact encoding when its values are all representable at two scales
// (a writer that picks the scale from the pre-quantisation row can choose
// 2^(k+1) where the reference encoding of the rounded row picks 2^k), so
// such an entry encodes the row although its bytes differ from RewritePage's.
func decodesTo(layout string, dim, blockSize int, page []byte, e int, row []float32) (bool, error) {
	f, _, err := kvFormat(layout, dim, blockSize)
	if err != nil {
		return false, err
	}
	if len(page) != f.PageBytes() || e < 0 || e >= blockSize || len(row) != f.Dim {
		return false, nil // not an encoding of the row; RewritePage reports the shape error
	}
	dst := make([]float32, f.Dim)
	if faults := f.DecodeEntry(dst, page, e, nil); len(faults) != 0 {
		return false, nil
	}
	for i, v := range dst {
		if math.Float32bits(v) != math.Float32bits(row[i]) {
			return false, nil
		}
	}
	return true, nil
}

// comparePage compares two pages byte by byte, ignoring bytes no kernel
// reads, and describes the first difference ("" when equal).
func comparePage(layout string, dim, blockSize int, got, want []byte) (string, error) {
	f, _, err := kvFormat(layout, dim, blockSize)
	if err != nil {
		return "", err
	}
	if len(got) != f.PageBytes() || len(want) != f.PageBytes() {
		return "", fmt.Errorf("%v pages of %d and %d bytes, want %d", f, len(got), len(want), f.PageBytes())
	}
	if d := f.ComparePages(got, want); d != nil {
		return d.String(), nil
	}
	return "", nil
}

// verifyPrefix checks, after a prefix-cache hit of hit.Tokens tokens, one
// layer's GPU cache rows (kv_cache [rows, D]) against this request's own rows,
// with other requests' caches to name where a stale row came from. It returns
// one line describing the first stale row, or "" when the hit is clean. It
// runs kvcache.VerifyPrefixHit over the window rows of tokens
// [max(0, N-W), N) of the layer, presented to the verifier as a one-layer
// window-only schedule (the compressed rows and compressor state of the hit
// are checked by the replay's own kv_cache comparison).
func verifyPrefix(cfg *engine.Config, layer int, hit PrefixHit, gpu, own engine.Tensor, others map[string]engine.Tensor) (string, error) {
	W, D, N := cfg.WindowSize, cfg.HeadDim, int(hit.Tokens)
	rows := func(t engine.Tensor) kvcache.RowMap {
		m := kvcache.RowMap{}
		for tok := max(0, N-W); tok < N; tok++ {
			slot := tok % W
			if (slot+1)*D <= len(t.F) {
				m[kvcache.RowKey{Layer: 0, Cache: kvcache.CacheWindow, Index: tok}] = t.F[slot*D : (slot+1)*D]
			}
		}
		return m
	}
	o := map[string]kvcache.RowSource{}
	for name, t := range others {
		o[name] = rows(t)
	}
	h := kvcache.PrefixHit{Request: "replayed", Donor: hit.From, Tokens: N, Schedule: kvcache.Schedule{Window: W, Ratios: []int{0}}}
	s, err := kvcache.VerifyPrefixHit(h, rows(gpu), rows(own), o)
	if err != nil || s == nil {
		return "", err
	}
	line := fmt.Sprintf("kvcache.VerifyPrefixHit: first stale row is the window row of token %d (layer %d)", s.Index, layer)
	if s.Missing {
		line += ", missing on the GPU"
	} else {
		line += fmt.Sprintf(": dim %d GPU %g, own %g (%d values differ)", s.Dim, s.GPU, s.Own, s.Values)
	}
	if s.MatchesOther != "" {
		line += fmt.Sprintf("; it equals request %q's row of token %d: a stale page from that request", s.MatchesOther, s.OtherIndex)
	}
	return line + fmt.Sprintf(" (%d stale rows in the hit)", s.StaleRows), nil
}
