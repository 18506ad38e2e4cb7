package prodkernel

import (
	"fmt"
	"slices"

	"sparsemla/kvcache"
)

// Faults injected into real kernel outputs, each a bug a serving engine can
// have; the tests replay them and expect exactly that fault to be named.

// WrongPage is a slot mapping that names the wrong physical page for one row
// written at step p: the writer stores the row's entry at the same in-page
// position of the page of logical block toBlock, and the row's own place
// keeps what it held before the step (zero bytes: the slot was never
// written). It changes the kept pages of (p, layer) in place.
func (w *WindowK) WrongPage(p int64, layer, row, toBlock int) error {
	k := [2]int64{p, int64(layer)}
	set, ok := w.Pages[k]
	if !ok {
		return fmt.Errorf("prodkernel: %s keeps no pages at step %d layer %d", w.Prefix, p, layer)
	}
	if _, ok := w.Entries[k][row]; !ok {
		return fmt.Errorf("prodkernel: %s wrote no row %d at step %d layer %d", w.Prefix, row, p, layer)
	}
	b := row / PageEntries
	if toBlock == b || toBlock < 0 || toBlock >= len(set.Table) {
		return fmt.Errorf("prodkernel: block %d is not another block of the table (%d blocks)", toBlock, len(set.Table))
	}
	pos := row % PageEntries
	src := slices.Clone(set.Data[set.Table[b]])
	dst := slices.Clone(set.Data[set.Table[toBlock]])
	d0, s0 := pos*kvcache.Model1DataBytes, PageEntries*kvcache.Model1DataBytes+pos*kvcache.Model1ScaleBytes
	copy(dst[d0:d0+kvcache.Model1DataBytes], src[d0:d0+kvcache.Model1DataBytes])
	copy(dst[s0:s0+kvcache.Model1ScaleBytes], src[s0:s0+kvcache.Model1ScaleBytes])
	clear(src[d0 : d0+kvcache.Model1DataBytes])
	clear(src[s0 : s0+kvcache.Model1ScaleBytes])
	data := slices.Clone(set.Data)
	data[set.Table[b]], data[set.Table[toBlock]] = src, dst
	w.Pages[k] = PageSet{Data: data, Table: set.Table}
	return nil
}
