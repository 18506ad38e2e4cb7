package kvcache

import "fmt"

// ByteDiff is the result of a byte-level page comparison: the first differing
// byte that a kernel reads, and how widespread the difference is.
type ByteDiff struct {
	Offset  int      // page offset of the first differing unmasked byte
	Loc     Location // what that byte is
	Got     byte     // byte in the page under test
	Want    byte     // byte in the expected page
	Bytes   int      // number of differing unmasked bytes
	Entries int      // number of entries with at least one differing unmasked byte
	Masked  int      // number of differing bytes ignored because no kernel reads them
}

func (d *ByteDiff) String() string {
	return fmt.Sprintf("first difference at page byte %d (%v): got %#02x, want %#02x; %d bytes in %d entries differ (%d masked pad bytes also differ)",
		d.Offset, d.Loc, d.Got, d.Want, d.Bytes, d.Entries, d.Masked)
}

// ComparePages compares two pages of format f byte by byte, ignoring the bytes
// no kernel reads (the v4-model1 pad byte of each entry and the page padding).
// It returns nil when every read byte is equal. Both pages must have
// f.PageBytes() bytes (it panics otherwise).
func (f Format) ComparePages(got, want []byte) *ByteDiff {
	checkPage(f, got)
	checkPage(f, want)
	var d *ByteDiff
	seen := make(map[int]bool)
	masked := 0
	for i := range got {
		if got[i] == want[i] {
			continue
		}
		loc := f.Locate(i)
		if loc.Field.Masked() {
			masked++
			continue
		}
		if d == nil {
			d = &ByteDiff{Offset: i, Loc: loc, Got: got[i], Want: want[i]}
		}
		d.Bytes++
		if !seen[loc.Entry] {
			seen[loc.Entry] = true
			d.Entries++
		}
	}
	if d != nil {
		d.Masked = masked
	}
	return d
}

// ValueDiff is the result of a decoded-value page comparison.
type ValueDiff struct {
	Entry, Dim int     // first differing value
	Got, Want  float32 //
	Values     int     // differing values in the page
	Entries    int     // entries with at least one differing value
}

func (d *ValueDiff) String() string {
	return fmt.Sprintf("first difference at entry %d dim %d: got %g, want %g; %d values in %d entries differ",
		d.Entry, d.Dim, d.Got, d.Want, d.Values, d.Entries)
}

// CompareValues decodes both pages and compares their values (NaN equals NaN,
// +0 equals -0). Use it when the two pages may come from different encoders:
// scale rules differ at powers of two (spec §9.4), and re-quantising an FQ8
// row can halve a block's scale (its |max| rounded down to 224·s), so equal
// values can have different bytes. In the official model's dumps 4 of 196
// window/compressed tiles get a different scale byte when quantised from the
// pre-FQ8 row than from the FQ8 row, with identical values.
func (f Format) CompareValues(got, want []byte) *ValueDiff {
	a := make([]float32, f.P*f.Dim)
	b := make([]float32, f.P*f.Dim)
	f.DecodePage(a, got)
	f.DecodePage(b, want)
	var d *ValueDiff
	lastEntry := -1
	for i := range a {
		if a[i] == b[i] || (a[i] != a[i] && b[i] != b[i]) {
			continue
		}
		e := i / f.Dim
		if d == nil {
			d = &ValueDiff{Entry: e, Dim: i % f.Dim, Got: a[i], Want: b[i]}
		}
		d.Values++
		if e != lastEntry {
			d.Entries++
			lastEntry = e
		}
	}
	return d
}
