package kvcache

import "fmt"

// BlockTable maps a request's logical pages to physical pages of a pool:
// BlockTable[i] is the physical page holding logical entries i·B … i·B+B-1, or
// -1 when that page is not allocated (never written, or freed because it slid
// out of the window).
type BlockTable []int32

// Slot returns the physical slot of logical entry pos (vLLM / FlashMLA
// abs_indices2indices_in_kvcache):
//
//	slot = table[pos / B]·B + pos % B
//
// pos = -1 (an empty index-list entry) gives slot -1 and no error. A position
// past the table or on an unallocated page is an error: a kernel reading it
// would read garbage.
func (t BlockTable) Slot(pos, B int) (int, error) {
	if B <= 0 {
		panic("kvcache: BlockTable.Slot page size must be positive")
	}
	if pos == -1 {
		return -1, nil
	}
	if pos < 0 {
		return 0, fmt.Errorf("kvcache: logical position %d is negative (only -1 means empty)", pos)
	}
	i := pos / B
	if i >= len(t) {
		return 0, fmt.Errorf("kvcache: logical position %d is on page %d, past the block table (%d pages)", pos, i, len(t))
	}
	if t[i] < 0 {
		return 0, fmt.Errorf("kvcache: logical position %d is on page %d, which is not allocated (table entry %d)", pos, i, t[i])
	}
	return int(t[i])*B + pos%B, nil
}

// Slots converts a list of logical positions to slots (Slot for each), keeping
// -1 entries as -1. dst must have len(idx) entries.
func (t BlockTable) Slots(dst, idx []int64, B int) error {
	if len(dst) < len(idx) {
		panic("kvcache: BlockTable.Slots destination too short")
	}
	for i, p := range idx {
		s, err := t.Slot(int(p), B)
		if err != nil {
			return fmt.Errorf("index %d: %w", i, err)
		}
		dst[i] = int64(s)
	}
	return nil
}

// Pool is a paged cache pool as a GPU engine holds it: NumPages pages of one
// format, contiguous (page i at i·PageBytes), and the block table of one
// request. It reads and writes entries by logical position.
type Pool struct {
	Format Format
	Data   []byte     // NumPages · Format.PageBytes() bytes
	Table  BlockTable // logical page → physical page of this request
}

// NewPool returns a zeroed pool of numPages pages and an empty block table.
func NewPool(f Format, numPages int) *Pool {
	if numPages < 0 {
		panic("kvcache: NewPool negative page count")
	}
	return &Pool{Format: f, Data: make([]byte, numPages*f.PageBytes())}
}

// WrapPool wraps bytes read from a dump as a pool. It returns an error (and
// does not copy or allocate) when data is not a whole number of pages or a
// table entry names a page outside data.
func WrapPool(f Format, data []byte, table BlockTable) (*Pool, error) {
	pb := f.PageBytes()
	if len(data)%pb != 0 {
		return nil, fmt.Errorf("kvcache: %d pool bytes are not a whole number of %v pages (%d B each)", len(data), f.Layout, pb)
	}
	n := len(data) / pb
	for i, p := range table {
		if p >= int32(n) || p < -1 {
			return nil, fmt.Errorf("kvcache: block table entry %d names page %d, pool has %d pages", i, p, n)
		}
	}
	return &Pool{Format: f, Data: data, Table: table}, nil
}

// NumPages is the number of physical pages.
func (p *Pool) NumPages() int { return len(p.Data) / p.Format.PageBytes() }

// Page returns the bytes of physical page i.
func (p *Pool) Page(i int) []byte {
	pb := p.Format.PageBytes()
	return p.Data[i*pb : (i+1)*pb]
}

// locate maps a logical position to (physical page, entry).
func (p *Pool) locate(pos int) (page, entry int, err error) {
	s, err := p.Table.Slot(pos, p.Format.P)
	if err != nil {
		return 0, 0, err
	}
	if s < 0 {
		return 0, 0, fmt.Errorf("kvcache: position -1 has no entry")
	}
	page, entry = s/p.Format.P, s%p.Format.P
	if page >= p.NumPages() {
		return 0, 0, fmt.Errorf("kvcache: position %d maps to page %d, pool has %d pages", pos, page, p.NumPages())
	}
	return page, entry, nil
}

// Read decodes the entry at logical position pos into dst (Dim values) and
// returns its structural faults.
func (p *Pool) Read(dst []float32, pos int) (Faults, error) {
	page, e, err := p.locate(pos)
	if err != nil {
		return nil, err
	}
	return p.Format.DecodeEntry(dst, p.Page(page), e, nil), nil
}

// Write encodes row as the entry at logical position pos.
func (p *Pool) Write(pos int, row []float32, sc Scaling) error {
	page, e, err := p.locate(pos)
	if err != nil {
		return err
	}
	p.Format.EncodeEntry(p.Page(page), e, row, sc)
	return nil
}

// Gather decodes the entries named by idx (logical positions, -1 = empty) into
// dst (len(idx)·Dim values; an empty entry's row is zero, as the sparse kernel
// treats it). Faults carry the index-list position in Entry... see GatherFault.
func (p *Pool) Gather(dst []float32, idx []int64) ([]GatherFault, error) {
	d := p.Format.Dim
	if len(dst) < len(idx)*d {
		panic("kvcache: Pool.Gather destination too short")
	}
	var out []GatherFault
	for i, pos := range idx {
		row := dst[i*d : (i+1)*d]
		if pos == -1 {
			clear(row)
			continue
		}
		fs, err := p.Read(row, int(pos))
		if err != nil {
			return out, fmt.Errorf("index list entry %d: %w", i, err)
		}
		for _, f := range fs {
			out = append(out, GatherFault{Index: i, Pos: int(pos), Fault: f})
		}
	}
	return out, nil
}

// GatherFault is a page fault met while gathering an index list: which list
// entry, which logical position, and the fault in its page.
type GatherFault struct {
	Index int // position in the index list
	Pos   int // logical position (window token, compressed row or index key)
	Fault Fault
}
