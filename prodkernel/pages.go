package prodkernel

import (
	"fmt"
	"io"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/kvcache"
	"sparsemla/replay"
)

// PageEntries is the page size (cache entries per page) of every MODEL1 page
// the harness and WritePages use: vLLM's sliding-window block size.
const PageEntries = 64

// BlockTable is the block table of a cache of rows entries: logical block b
// lives in physical page nb-b (nb blocks), so page 0 is never used and a
// kernel that ignores the table reads the wrong page. It returns the table
// and the number of physical pages (nb+1).
func BlockTable(rows int) ([]int, int) {
	nb := (rows + PageEntries - 1) / PageEntries
	t := make([]int, nb)
	for b := range t {
		t[b] = nb - b
	}
	return t, nb + 1
}

// model1 is the MODEL1 format of the pages here.
var model1 = kvcache.MustFormat(kvcache.LayoutV4Model1, 0, PageEntries)

// EncodePages encodes the rows of kv ([rows, 512]) into MODEL1 pages with the
// reference scaling (physical page BlockTable(rows)[b] holds logical block b;
// page 0 stays zero). The result is nphys·PageBytes bytes.
func EncodePages(kv engine.Tensor) ([]byte, []int, error) {
	if len(kv.Shape) != 2 || kv.Shape[1] != model1.Dim {
		return nil, nil, fmt.Errorf("prodkernel: kv_cache shape %v, want [rows, %d]", kv.Shape, model1.Dim)
	}
	rows := kv.Shape[0]
	table, nphys := BlockTable(rows)
	pb := model1.PageBytes()
	out := make([]byte, nphys*pb)
	for b, id := range table {
		lo, hi := b*PageEntries, min((b+1)*PageEntries, rows)
		model1.EncodePage(out[id*pb:(id+1)*pb], kv.F[lo*model1.Dim:hi*model1.Dim], kvcache.RefScaling(kvcache.LayoutV4Model1))
	}
	return out, table, nil
}

// WritePages writes, for every step and layer of src, the MODEL1 pages of the
// dumped kv_cache after that step ("p{P}.L{L}.pages" U8 [nphys, PageBytes]
// and "p{P}.L{L}.block_table" I64) as a safetensors file: the KV cache the
// FlashMLA run of the harness reads.
func WritePages(w io.Writer, src replay.Source) error {
	var recs []dump.Record
	for _, p := range src.Steps() {
		for _, l := range src.Layers() {
			kv, ok, err := src.Stage(p, l, "kv_cache")
			if err != nil {
				return err
			}
			if !ok {
				continue
			}
			pages, table, err := EncodePages(kv)
			if err != nil {
				return fmt.Errorf("step %d layer %d: %w", p, l, err)
			}
			bt := make([]byte, 8*len(table))
			for i, v := range table {
				putU64(bt[8*i:], uint64(v))
			}
			name := fmt.Sprintf("p%d.L%d.", p, l)
			recs = append(recs,
				dump.Record{Name: name + "pages", DType: dump.U8, Shape: []int{len(pages) / model1.PageBytes(), model1.PageBytes()}, Data: pages},
				dump.Record{Name: name + "block_table", DType: dump.I64, Shape: []int{len(table)}, Data: bt})
		}
	}
	return dump.WriteSafetensors(w, recs, map[string]string{"producer": "sparsemla prodkernel.WritePages", "layout": "v4-model1", "page_entries": fmt.Sprint(PageEntries)})
}

func putU64(b []byte, v uint64) {
	for i := 0; i < 8; i++ {
		b[i] = byte(v >> (8 * i))
	}
}
