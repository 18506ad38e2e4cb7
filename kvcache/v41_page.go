package kvcache

import (
	"fmt"

	"sparsemla/userfile"
)

// V4.1 KV pages: a page of P entries is P rows of RowBytes each, back to back
// (kvcache.V41Row); a dump's page record names its row layout by the row's
// id ("v41-window-fp8", "v41-kv-fp4", "v41-index-fp4").

// ParseV41Row is the inverse of V41Row.String. An unknown id (read from a
// dump) is quoted in the error with userfile.Quote: at most 64 of its bytes.
func ParseV41Row(id string) (V41Row, error) {
	for _, r := range []V41Row{V41WindowFP8, V41KVFP4, V41IndexFP4} {
		if r.String() == id {
			return r, nil
		}
	}
	return 0, fmt.Errorf("kvcache: unknown V4.1 row layout %s (want v41-window-fp8, v41-kv-fp4 or v41-index-fp4)", userfile.Quote(id))
}

// V41Field names the part of a row a byte belongs to: its codes or its
// block scales.
type V41Field uint8

const (
	V41Codes V41Field = iota // E4M3 codes (window) or packed E2M1 pairs (FP4 rows)
	V41Scale                 // a block scale (UE8M0, or E4M3 for v41-kv-fp4)
)

// V41Location names one byte of a row.
type V41Location struct {
	Field    V41Field
	Index    int // code byte, or scale block
	DimFirst int // first dim the byte holds (codes) or scales (scale)
	DimLast  int
}

func (l V41Location) String() string {
	if l.Field == V41Scale {
		return fmt.Sprintf("scale byte %d (dims %d…%d)", l.Index, l.DimFirst, l.DimLast)
	}
	if l.DimFirst == l.DimLast {
		return fmt.Sprintf("code byte %d (dim %d)", l.Index, l.DimFirst)
	}
	return fmt.Sprintf("code byte %d (dims %d, %d)", l.Index, l.DimFirst, l.DimLast)
}

// Locate maps a byte offset within a row (0 … RowBytes−1) to its field and
// the dims it holds. It panics when off is outside the row.
func (r V41Row) Locate(off int) V41Location {
	dims, cb, sb, B := r.geometry()
	if off < 0 || off >= cb+sb {
		panic("kvcache: V4.1 Locate offset outside the row")
	}
	if off >= cb {
		b := off - cb
		return V41Location{V41Scale, b, b * B, b*B + B - 1}
	}
	per := dims / cb // 1 (FP8) or 2 (packed FP4)
	return V41Location{V41Codes, off, off * per, off*per + per - 1}
}

// V41RowDiff is the first byte in which two rows differ.
type V41RowDiff struct {
	Offset    int // byte within the row
	Loc       V41Location
	Got, Want byte
	Bytes     int // differing bytes in the row
}

func (d *V41RowDiff) String() string {
	return fmt.Sprintf("%s (row byte %d): got %#02x, want %#02x; %d bytes of the row differ", d.Loc, d.Offset, d.Got, d.Want, d.Bytes)
}

// CompareRows compares two rows of layout r byte by byte; nil when equal.
// It panics when a row is not RowBytes long.
func (r V41Row) CompareRows(got, want []byte) *V41RowDiff {
	if len(got) != r.RowBytes() || len(want) != r.RowBytes() {
		panic("kvcache: V4.1 CompareRows length mismatch")
	}
	var d *V41RowDiff
	for i := range got {
		if got[i] == want[i] {
			continue
		}
		if d == nil {
			d = &V41RowDiff{Offset: i, Loc: r.Locate(i), Got: got[i], Want: want[i]}
		}
		d.Bytes++
	}
	return d
}
