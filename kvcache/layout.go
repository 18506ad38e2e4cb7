package kvcache

import (
	"fmt"

	"sparsemla/quant"
	"sparsemla/userfile"
)

// Layout names how one cache entry (a window token, a compressed row or an
// indexer key) is stored in bytes. It is a value read from dump metadata, never
// a compile-time choice: the same replay must read a vLLM "fp8_ds_mla" page, an
// SGLang indexer page and the reference's bf16 rows.
type Layout uint8

const (
	// LayoutBF16 is the reference storage: Dim bf16 values, little endian,
	// 2·Dim bytes per entry, entries contiguous within a page.
	LayoutBF16 Layout = iota
	// LayoutV4Model1 is FlashMLA's "MODEL1_FP8Sparse" layout (spec §8.2): per
	// entry 448 E4M3 nope codes, 64 bf16 rope values and 7 UE8M0 scales (one per
	// 64 nope dims) + 1 pad byte = 584 bytes. A page of P entries holds P data
	// rows of 576 bytes (nope ‖ rope), then P scale rows of 8 bytes, and is
	// padded to a multiple of 576 bytes: PageBytes = round_up(P·584, 576).
	LayoutV4Model1
	// LayoutV32 is the DeepSeek-V3.2 "FP8 with scale" layout: per entry 512
	// E4M3 nope codes, 4 fp32 power-of-two scales (one per 128 dims) and 64 bf16
	// rope values = 656 bytes, entries contiguous (Dim = 576).
	LayoutV32
	// LayoutIndexerFP8 is the engines' FP8 indexer key cache (spec §8.3): per
	// key 128 E4M3 codes and one fp32 power-of-two scale; a page holds P·128
	// code bytes, then P·4 scale bytes (132 bytes per key).
	LayoutIndexerFP8
	// LayoutIndexerMXFP4 is vLLM's MXFP4 indexer key cache: per key 64 bytes of
	// packed E2M1 codes (even index in the low nibble) and 4 UE8M0 scales (one
	// per 32 values); a page holds P·64 code bytes, then P·4 scale bytes.
	LayoutIndexerMXFP4
)

var layoutNames = [...]string{
	LayoutBF16:         "bf16",
	LayoutV4Model1:     "v4-model1",
	LayoutV32:          "v32",
	LayoutIndexerFP8:   "indexer-fp8",
	LayoutIndexerMXFP4: "indexer-mxfp4",
}

// String is the id dumps and the CLI use ("v4-model1", "v32", "indexer-fp8",
// "indexer-mxfp4", "bf16").
func (l Layout) String() string {
	if int(l) < len(layoutNames) {
		return layoutNames[l]
	}
	return fmt.Sprintf("Layout(%d)", uint8(l))
}

// ParseLayout is the inverse of Layout.String. An unknown id (read from a
// dump) is quoted in the error with userfile.Quote: at most 64 of its bytes.
func ParseLayout(id string) (Layout, error) {
	for l, n := range layoutNames {
		if n == id {
			return Layout(l), nil
		}
	}
	return 0, fmt.Errorf("kvcache: unknown layout id %s (want v4-model1, v32, indexer-fp8, indexer-mxfp4 or bf16)", userfile.Quote(id))
}

// Geometry constants of the quantised layouts.
const (
	Model1Nope       = 448 // E4M3 dims of a MODEL1 entry
	Model1Rope       = 64  // bf16 dims of a MODEL1 entry
	Model1Tile       = 64  // nope dims per UE8M0 scale
	Model1Tiles      = Model1Nope / Model1Tile
	Model1DataBytes  = Model1Nope + 2*Model1Rope // 576: one data row of a page
	Model1ScaleBytes = Model1Tiles + 1           // 8: 7 scales + 1 pad
	Model1EntryBytes = Model1DataBytes + Model1ScaleBytes

	V32Nope       = 512
	V32Rope       = 64
	V32Tile       = 128
	V32Tiles      = V32Nope / V32Tile
	V32EntryBytes = V32Nope + 4*V32Tiles + 2*V32Rope // 656

	IndexerDim        = 128
	IndexerFP8Bytes   = IndexerDim + 4   // 132
	MXFP4Block        = 32               // values per UE8M0 scale
	IndexerMXFP4Bytes = IndexerDim/2 + 4 // 68
)

// Format is a layout together with the entry width and the page size: what a
// decoder needs to find every byte of a page.
type Format struct {
	Layout Layout
	Dim    int // values per entry: 512 (v4-model1), 576 (v32), 128 (indexer-*), any even > 0 (bf16)
	P      int // entries per page
}

// NewFormat checks and returns the format of layout with P entries per page.
// dim is the entry width; 0 picks the layout's fixed width (bf16 needs dim > 0).
func NewFormat(layout Layout, dim, P int) (Format, error) {
	if P <= 0 || P > 1<<20 {
		return Format{}, fmt.Errorf("kvcache: %v page size %d out of range [1, 2^20]", layout, P)
	}
	fixed := 0
	switch layout {
	case LayoutV4Model1:
		fixed = Model1Nope + Model1Rope
	case LayoutV32:
		fixed = V32Nope + V32Rope
	case LayoutIndexerFP8, LayoutIndexerMXFP4:
		fixed = IndexerDim
	case LayoutBF16:
		if dim <= 0 || dim > 1<<16 {
			return Format{}, fmt.Errorf("kvcache: bf16 entry width %d out of range [1, 65536]", dim)
		}
		return Format{layout, dim, P}, nil
	default:
		return Format{}, fmt.Errorf("kvcache: unknown layout %v", layout)
	}
	if dim != 0 && dim != fixed {
		return Format{}, fmt.Errorf("kvcache: %v entries have %d values, not %d", layout, fixed, dim)
	}
	return Format{layout, fixed, P}, nil
}

// MustFormat is NewFormat for constant arguments; it panics on error.
func MustFormat(layout Layout, dim, P int) Format {
	f, err := NewFormat(layout, dim, P)
	if err != nil {
		panic(err.Error())
	}
	return f
}

// EntryBytes is the number of bytes one entry occupies (page padding excluded).
func (f Format) EntryBytes() int {
	switch f.Layout {
	case LayoutV4Model1:
		return Model1EntryBytes
	case LayoutV32:
		return V32EntryBytes
	case LayoutIndexerFP8:
		return IndexerFP8Bytes
	case LayoutIndexerMXFP4:
		return IndexerMXFP4Bytes
	}
	return 2 * f.Dim
}

// PageBytes is the size of one page: P·EntryBytes, rounded up to a multiple of
// 576 for v4-model1 (FlashMLA's quantize_k_cache).
func (f Format) PageBytes() int {
	n := f.P * f.EntryBytes()
	if f.Layout == LayoutV4Model1 {
		n = (n + Model1DataBytes - 1) / Model1DataBytes * Model1DataBytes
	}
	return n
}

func (f Format) String() string {
	return fmt.Sprintf("%v[dim %d, %d entries/page, %d B/page]", f.Layout, f.Dim, f.P, f.PageBytes())
}

// Field names the part of an entry a byte belongs to.
type Field uint8

const (
	FieldNope    Field = iota // E4M3 codes (v4-model1, v32, indexer-fp8) or packed E2M1 (indexer-mxfp4)
	FieldRope                 // bf16 rope values (v4-model1, v32)
	FieldScale                // a block scale (UE8M0 byte or fp32)
	FieldPad                  // the 8th scale byte of a v4-model1 entry: never read
	FieldPagePad              // bytes after the last entry of a v4-model1 page: never read
	FieldValue                // a bf16 value (bf16 layout)
)

var fieldNames = [...]string{"nope", "rope", "scale", "pad", "page-pad", "value"}

func (f Field) String() string {
	if int(f) < len(fieldNames) {
		return fieldNames[f]
	}
	return fmt.Sprintf("Field(%d)", uint8(f))
}

// Masked reports whether bytes of this field are never read by any kernel, so a
// byte comparison ignores them.
func (f Field) Masked() bool { return f == FieldPad || f == FieldPagePad }

// Location names one byte of a page.
type Location struct {
	Entry int   // entry within the page (-1 for page padding)
	Field Field //
	Index int   // value dim (nope/rope/value, counted within the entry's full width), or scale tile
	Byte  int   // byte within that element (0 for single-byte elements)
}

func (l Location) String() string {
	switch l.Field {
	case FieldPagePad:
		return "page padding"
	case FieldPad:
		return fmt.Sprintf("entry %d pad byte", l.Entry)
	case FieldScale:
		return fmt.Sprintf("entry %d scale %d byte %d", l.Entry, l.Index, l.Byte)
	}
	return fmt.Sprintf("entry %d %v dim %d byte %d", l.Entry, l.Field, l.Index, l.Byte)
}

// Locate maps a byte offset within a page to the entry, field and element it
// belongs to. It panics when off is outside the page.
//
//	v4-model1: [0, P·576) data rows: nope dims 0..447 (1 B), rope dims 448..511 (2 B);
//	           [P·576, P·584) scale rows: tiles 0..6, pad; then page padding.
//	v32:       entry e at e·656: nope 0..511, 4 fp32 scales, rope dims 512..575.
//	indexer-fp8:   [0, P·128) codes, [P·128, P·132) fp32 scales.
//	indexer-mxfp4: [0, P·64) packed codes (byte b holds dims 2b, 2b+1), [P·64, P·68) scales.
//	bf16:      entry e at e·2·Dim, value i at 2i.
func (f Format) Locate(off int) Location {
	if off < 0 || off >= f.PageBytes() {
		panic("kvcache: Locate offset outside the page")
	}
	P := f.P
	switch f.Layout {
	case LayoutV4Model1:
		switch {
		case off < P*Model1DataBytes:
			e, b := off/Model1DataBytes, off%Model1DataBytes
			if b < Model1Nope {
				return Location{e, FieldNope, b, 0}
			}
			r := b - Model1Nope
			return Location{e, FieldRope, Model1Nope + r/2, r % 2}
		case off < P*Model1EntryBytes:
			r := off - P*Model1DataBytes
			e, b := r/Model1ScaleBytes, r%Model1ScaleBytes
			if b == Model1Tiles {
				return Location{e, FieldPad, 0, 0}
			}
			return Location{e, FieldScale, b, 0}
		}
		return Location{-1, FieldPagePad, 0, 0}
	case LayoutV32:
		e, b := off/V32EntryBytes, off%V32EntryBytes
		switch {
		case b < V32Nope:
			return Location{e, FieldNope, b, 0}
		case b < V32Nope+4*V32Tiles:
			r := b - V32Nope
			return Location{e, FieldScale, r / 4, r % 4}
		}
		r := b - V32Nope - 4*V32Tiles
		return Location{e, FieldRope, V32Nope + r/2, r % 2}
	case LayoutIndexerFP8:
		if off < P*IndexerDim {
			return Location{off / IndexerDim, FieldNope, off % IndexerDim, 0}
		}
		r := off - P*IndexerDim
		return Location{r / 4, FieldScale, 0, r % 4}
	case LayoutIndexerMXFP4:
		if off < P*IndexerDim/2 {
			e, b := off/(IndexerDim/2), off%(IndexerDim/2)
			return Location{e, FieldNope, 2 * b, 0}
		}
		r := off - P*IndexerDim/2
		return Location{r / 4, FieldScale, r % 4, 0}
	}
	e, b := off/(2*f.Dim), off%(2*f.Dim)
	return Location{e, FieldValue, b / 2, b % 2}
}

// Scaling selects how an encoder derives a block's power-of-two scale: the rule
// (spec §9.4) and the floor it applies to the block's |max|.
type Scaling struct {
	Rule  quant.ScaleRule
	Floor float32
}

// Scalings of the reference and the engines (spec §8.2, §8.3, §9.4).
var (
	// RefFP8 is the reference act_quant: s = ceil2(f32(max(amax, 1e-4)·f32(1/448))).
	// Encoding FQ8 rows with it is lossless and reproduces FQ8's own scales.
	RefFP8 = Scaling{quant.ScaleCeil2, quant.FP8AmaxFloor}
	// RefFP4 is the reference fp4_quant: s = ceil2(f32(max(amax, 6·2^-126)·f32(1/6))).
	RefFP4 = Scaling{quant.ScaleCeil2, quant.FP4AmaxFloor}
	// FlashMLAFP8 is FlashMLA tests/quant.py: s = 2^ceil(log2(max(amax/448, 1e-4))).
	FlashMLAFP8 = Scaling{quant.ScaleFlashMLA, 1e-4}
	// VLLMFP8 is vLLM's Triton writers: s = 2^ceil(log2(max(amax, 1e-4)/448)).
	VLLMFP8 = Scaling{quant.ScaleLog2Ceil, 1e-4}
	// SGLangFP8 is SGLang's MODEL1 writer: as vLLM with an amax floor of 1e-8.
	SGLangFP8 = Scaling{quant.ScaleLog2Ceil, 1e-8}
)

// RefScaling is the reference scaling for the layout's quantised values
// (RefFP4 for indexer-mxfp4, RefFP8 otherwise).
func RefScaling(l Layout) Scaling {
	if l == LayoutIndexerMXFP4 {
		return RefFP4
	}
	return RefFP8
}

// Scale-exponent bounds a real block can produce. A block's scale is
// 2^ceil(log2(max(amax, floor)/qmax)) under every known rule (give or take one
// at powers of two), so the exponent is at least that of the smallest floor any
// engine uses and at most that of the largest bf16 |max|:
//
//	FP8 (qmax 448): floor 1e-8 (SGLang) → 2^-35;  bf16 max 3.39e38 → 2^120
//	FP4 (qmax 6):   floor 6·2^-126      → 2^-126; bf16 max         → 2^126
//
// A stored scale outside these bounds cannot come from any encoder: it is a
// corrupt or never-written byte.
const (
	FP8ScaleExpMin = -35
	FP8ScaleExpMax = 120
	FP4ScaleExpMin = -126
	FP4ScaleExpMax = 126
	// FP8FlooredExpMax is the largest exponent a floored (near-zero) block can
	// get under any rule: FlashMLA's floor 1e-4 on amax/448 gives 2^-13. Above
	// it a scale must be tight (see FaultScaleLoose).
	FP8FlooredExpMax = -13
	FP4FlooredExpMax = -126
)
