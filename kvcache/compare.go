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
