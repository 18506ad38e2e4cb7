package kvcache

import (
	"fmt"

	"sparsemla/quant"
)

// V4.1 ("CSA2") cache rows (spec §11 item 11; V41-D = ztxz16/fastllm
// docs/deepseek_v41.md, "KV 缓存存储精度"). The model's values already lie on
// the FP8 / FP4 grids (V41-M fake-quantises before caching), so these rows
// store them losslessly:
//
//	V41WindowFP8  528 B  512 × E4M3 (value / scale), then 16 UE8M0 scales, one per 32 dims
//	                     (window K, act_quant(kv, 32, ue8m0); also fastllm's fp8_e4m3
//	                     compressed-KV row, which is lossy for FP4-grid rows)
//	V41KVFP4      288 B  256 B packed E2M1 (low nibble = even index), then 32 E4M3
//	                     scales, one per 16 dims (compressed KV, fp4_act_quant(·, 16, e4m3))
//	V41IndexFP4    68 B  64 B packed E2M1, then 4 UE8M0 scales, one per 32 dims
//	                     (index keys, fp4_act_quant(·, 32, ue8m0))
//
// A page of P entries is P rows of RowBytes each, back to back (fastllm keeps
// them as an int8 tensor [b, rows, rowBytes]). [I] The order of the fields
// inside a row (codes, then scales) is the order V41-D lists them; the byte
// order of fastllm's C++ row was not read.
type V41Row uint8

const (
	V41WindowFP8 V41Row = iota // 528 B: window K (512 dims)
	V41KVFP4                   // 288 B: compressed KV (512 dims)
	V41IndexFP4                // 68 B: index key (128 dims)
)

// String is the row's layout id.
func (r V41Row) String() string {
	switch r {
	case V41WindowFP8:
		return "v41-window-fp8"
	case V41KVFP4:
		return "v41-kv-fp4"
	case V41IndexFP4:
		return "v41-index-fp4"
	}
	return fmt.Sprintf("V41Row(%d)", uint8(r))
}

// geometry returns dims, code bytes, scale bytes and block size.
func (r V41Row) geometry() (dims, codeBytes, scaleBytes, block int) {
	switch r {
	case V41WindowFP8:
		return 512, 512, 16, 32
	case V41KVFP4:
		return 512, 256, 32, 16
	case V41IndexFP4:
		return 128, 64, 4, 32
	}
	panic("kvcache: unknown V4.1 row layout")
}

// Dims is the number of values a row holds (512 or 128).
func (r V41Row) Dims() int { d, _, _, _ := r.geometry(); return d }

// RowBytes is the size of one row: 528, 288 or 68.
func (r V41Row) RowBytes() int { _, c, s, _ := r.geometry(); return c + s }

// EncodeRow stores row (Dims values) into dst (RowBytes): codes, then scales.
// For a row the model produced (window K after FQ8(·, 32), a compressed row
// after FQ4E4M3(·, 16), an index key after FQ4(·, 32)) DecodeRow gives it back
// bit for bit. The scale rules are the model's: ceil2 of max(amax, 1e-4)/448
// (window), E4M3_satfinite(max(amax, 6·2^-9)/6) (compressed KV), ceil2 of
// max(amax, 6·2^-126)·(1/6) (index keys).
func (r V41Row) EncodeRow(dst []byte, row []float32) {
	dims, cb, sb, B := r.geometry()
	if len(row) != dims || len(dst) != cb+sb {
		panic("kvcache: V4.1 EncodeRow length mismatch")
	}
	switch r {
	case V41WindowFP8:
		quant.QuantizeFP8(dst[:cb], dst[cb:], row, B, quant.ScaleCeil2, quant.FP8AmaxFloor)
	case V41KVFP4:
		quant.QuantizeFP4E4M3(dst[:cb], dst[cb:], row, B)
	case V41IndexFP4:
		quant.QuantizeFP4(dst[:cb], dst[cb:], row, B, quant.ScaleCeil2, quant.FP4AmaxFloor)
	}
}

// DecodeRow reads one row (RowBytes) into dst (Dims values). A NaN scale byte
// (UE8M0 0xFF; E4M3 0x7F/0xFF) or a NaN E4M3 code is an error naming the
// field and its byte offset inside the row; dst is still filled (NaN there).
func (r V41Row) DecodeRow(dst []float32, src []byte) error {
	dims, cb, sb, B := r.geometry()
	if len(dst) != dims || len(src) != cb+sb {
		panic("kvcache: V4.1 DecodeRow length mismatch")
	}
	var err error
	switch r {
	case V41WindowFP8:
		quant.DequantizeFP8(dst, src[:cb], src[cb:], B)
		for i, c := range src[:cb] {
			if c&0x7f == 0x7f {
				err = fmt.Errorf("kvcache: %s: byte %d (dim %d) is a NaN E4M3 code %#x", r, i, i, c)
				break
			}
		}
	case V41KVFP4:
		quant.DequantizeFP4E4M3(dst, src[:cb], src[cb:], B)
	case V41IndexFP4:
		quant.DequantizeFP4(dst, src[:cb], src[cb:], B)
	}
	for b, s := range src[cb:] {
		nan := s == quant.UE8M0NaN
		if r == V41KVFP4 {
			nan = s&0x7f == 0x7f
		}
		if nan {
			return fmt.Errorf("kvcache: %s: byte %d (scale of dims %d…%d) is NaN (%#x)", r, cb+b, b*B, b*B+B-1, s)
		}
	}
	return err
}

// DecodeRows decodes a page of back-to-back rows: len(page) must be a multiple
// of RowBytes; the error names the first bad row and byte offset in the page.
func (r V41Row) DecodeRows(page []byte) ([]float32, error) {
	n := r.RowBytes()
	if len(page)%n != 0 {
		return nil, fmt.Errorf("kvcache: %s page of %d bytes is not a multiple of the %d-byte row", r, len(page), n)
	}
	d := r.Dims()
	out := make([]float32, len(page)/n*d)
	for e := 0; e < len(page)/n; e++ {
		if err := r.DecodeRow(out[e*d:(e+1)*d], page[e*n:(e+1)*n]); err != nil {
			return out, fmt.Errorf("row %d (page offset %d): %w", e, e*n, err)
		}
	}
	return out, nil
}

// V41BytesPerToken is the long-term cache budget per raw token of context with
// FP4 storage (V41-D's 890 B for V4.1-Flash): every KV source of ratio r adds
// (288 + 68) / r bytes — one compressed row and one index key per r tokens.
// The fixed-size windows (one 528-byte row per slot per layer) are not counted.
func V41BytesPerToken(sourceRatios []int) float64 {
	var b float64
	for _, r := range sourceRatios {
		b += float64(V41KVFP4.RowBytes()+V41IndexFP4.RowBytes()) / float64(r)
	}
	return b
}
