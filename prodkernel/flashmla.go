package prodkernel

import (
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"math/rand/v2"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/quant"
)

// FlashMLA's sparse FP8 decode (deepseek-ai/FlashMLA, sm90 MODEL1 kernel) at
// V4-Flash dimensions, on synthetic inputs this package generates: a query of
// FlashHeads heads × FlashDim, one MODEL1 KV cache of FlashWindow window rows
// and FlashCmp compressed rows written by kvcache's encoder, and per query an
// index list of the window (oldest→newest, −1 where unwritten) then up to 512
// compressed rows, padded with −1 to a multiple of 64 (FlashMLA's top-k block).
const (
	FlashHeads  = 64
	FlashDim    = 512
	FlashWindow = 128
	FlashCmp    = 1024
	flashSeed   = 0x5eed18
)

// FlashCase is one FlashMLA call: B requests × SQ query tokens, each with its
// own q and index list. The batch shape sets FlashMLA's split counts: its
// scheduler spreads B·(blocks+5) over 132/SQ SM parts, so one request with
// 640 keys gets ~10 splits and a wide batch of short lists gets none.
type FlashCase struct {
	Name   string
	B, SQ  int
	Window int     // valid window entries (FlashWindow−Window are −1)
	Cmp    int     // compressed rows selected (≤ 512)
	Temp   float32 // q scale: 1 gives logits of unit spread, 3 a peaky softmax
	// Fault, when set, is the bug the harness injects into this call
	// ("wrong-page": the index list is mapped through a block table whose
	// logical block FaultBlock names page FaultPage; "dropped-split": the
	// combine is given num_splits with the last split of request 0 cut off).
	Fault      string
	FaultBlock int
	FaultPage  int
}

// FlashCases are the committed FlashMLA runs (testdata/kernels/README.md).
var FlashCases = []FlashCase{
	{Name: "c0", B: 1, SQ: 1, Window: 128, Cmp: 512, Temp: 1},
	{Name: "c1", B: 1, SQ: 1, Window: 128, Cmp: 512, Temp: 3},
	{Name: "c2", B: 1, SQ: 1, Window: 40, Cmp: 0, Temp: 2},
	{Name: "c3", B: 1, SQ: 1, Window: 128, Cmp: 200, Temp: 2},
	{Name: "c4", B: 2, SQ: 1, Window: 128, Cmp: 512, Temp: 2},
	{Name: "c5", B: 10, SQ: 2, Window: 128, Cmp: 0, Temp: 2},
	{Name: "c6", B: 6, SQ: 2, Window: 128, Cmp: 512, Temp: 2},
	// Early decode as in the goldens: 8 window rows and 2 compressed rows, so
	// the middle 64-entry block of the list is all −1.
	{Name: "c7", B: 1, SQ: 1, Window: 8, Cmp: 2, Temp: 2},
	{Name: "f_wrong_page", B: 1, SQ: 1, Window: 128, Cmp: 512, Temp: 2, Fault: "wrong-page", FaultBlock: 5, FaultPage: 9},
	{Name: "f_dropped_split", B: 1, SQ: 1, Window: 128, Cmp: 512, Temp: 2, Fault: "dropped-split"},
}

// TopK is the padded index-list length of the case.
func (c FlashCase) TopK() int { return (FlashWindow + c.Cmp + 63) / 64 * 64 }

// Queries is the number of query rows (B·SQ).
func (c FlashCase) Queries() int { return c.B * c.SQ }

// FlashInput is the generated input of every case: the cache (its pages and
// the rows they decode to, the reference's K = V), the sinks, and per case
// the queries [B·SQ][H·D] (bf16 values) and the logical index lists
// [B·SQ][TopK] (cache rows, −1 = none).
type FlashInput struct {
	Rows  []float32 // [FlashWindow+FlashCmp][FlashDim], decoded from Pages
	Pages []byte    // nphys · PageBytes
	Table []int     // logical block → physical page
	Sink  []float32 // [FlashHeads]
	Q     map[string][]float32
	Idx   map[string][]int32
}

// NewFlashInput generates the inputs from a fixed PCG seed (math/rand/v2's
// PCG is specified, so every Go version gives the same values). K rows are
// N(0,1) in the 448 no-RoPE dims and N(0,0.5) in the 64 RoPE dims, encoded
// into MODEL1 pages with the reference scaling and decoded back; q is
// bf16(N(0,1)·Temp) per element, so the logits q·K·512^−½ have a spread of
// about Temp; sinks are uniform in [−1, 3].
func NewFlashInput() (*FlashInput, error) {
	rng := rand.New(rand.NewPCG(flashSeed, 18))
	rows := FlashWindow + FlashCmp
	raw := make([]float32, rows*FlashDim)
	for r := 0; r < rows; r++ {
		for i := 0; i < FlashDim; i++ {
			v := float32(rng.NormFloat64())
			if i >= 448 {
				v *= 0.5
			}
			raw[r*FlashDim+i] = v
		}
	}
	pages, table, err := EncodePagesRows(raw, rows)
	if err != nil {
		return nil, err
	}
	in := &FlashInput{Pages: pages, Table: table, Q: map[string][]float32{}, Idx: map[string][]int32{}}
	if in.Rows, err = DecodePagesRows(pages, table, rows); err != nil {
		return nil, err
	}
	in.Sink = make([]float32, FlashHeads)
	for h := range in.Sink {
		in.Sink[h] = float32(rng.Float64()*4 - 1)
	}
	for _, c := range FlashCases {
		n := c.Queries()
		q := make([]float32, n*FlashHeads*FlashDim)
		for i := range q {
			q[i] = quant.BF16Round(float32(rng.NormFloat64()) * c.Temp)
		}
		idx := make([]int32, n*c.TopK())
		for r := 0; r < n; r++ {
			l := idx[r*c.TopK() : (r+1)*c.TopK()]
			for i := range l {
				l[i] = -1
			}
			for i := 0; i < c.Window; i++ {
				l[i] = int32(i)
			}
			perm := rng.Perm(FlashCmp)
			for i := 0; i < c.Cmp; i++ {
				l[FlashWindow+i] = int32(FlashWindow + perm[i])
			}
		}
		in.Q[c.Name], in.Idx[c.Name] = q, idx
	}
	return in, nil
}

// EncodePagesRows is EncodePages on a flat [rows][512] slice.
func EncodePagesRows(kv []float32, rows int) ([]byte, []int, error) {
	if len(kv) != rows*model1.Dim {
		return nil, nil, fmt.Errorf("prodkernel: %d values for %d rows", len(kv), rows)
	}
	return EncodePages(engine.Tensor{Shape: []int{rows, model1.Dim}, F: kv})
}

// DecodePagesRows decodes rows cache rows from MODEL1 pages through the block
// table (the values a correct kernel reads); a faulty entry is an error.
func DecodePagesRows(pages []byte, table []int, rows int) ([]float32, error) {
	pb := model1.PageBytes()
	out := make([]float32, rows*model1.Dim)
	for r := 0; r < rows; r++ {
		id := table[r/PageEntries]
		if (id+1)*pb > len(pages) {
			return nil, fmt.Errorf("prodkernel: row %d: page %d outside %d pages", r, id, len(pages)/pb)
		}
		if f := model1.DecodeEntry(out[r*model1.Dim:(r+1)*model1.Dim], pages[id*pb:(id+1)*pb], r%PageEntries, nil); len(f) != 0 {
			return nil, fmt.Errorf("prodkernel: row %d: %v", r, f[0])
		}
	}
	return out, nil
}

// CaseTable is the block table the harness maps the case's index list with:
// the cache's own, or for a wrong-page fault the table with logical block
// FaultBlock naming page FaultPage.
func (in *FlashInput) CaseTable(c FlashCase) []int {
	t := append([]int(nil), in.Table...)
	if c.Fault == "wrong-page" {
		t[c.FaultBlock] = c.FaultPage
	}
	return t
}

// Write writes the input as one safetensors file for the harness:
// "kv.pages" U8 [nphys, PageBytes], "sink" F32 [H], and per case
// "<case>.q" BF16 [B, SQ, H, D], "<case>.idx" I32 [B, SQ, TopK] (logical rows)
// and "<case>.block_table" I64 (CaseTable).
func (in *FlashInput) Write(w io.Writer) error {
	pb := model1.PageBytes()
	recs := []dump.Record{
		{Name: "kv.pages", DType: dump.U8, Shape: []int{len(in.Pages) / pb, pb}, Data: in.Pages},
		{Name: "sink", DType: dump.F32, Shape: []int{FlashHeads}, Data: f32Bytes(in.Sink)},
	}
	meta := map[string]string{"producer": "sparsemla prodkernel.FlashInput", "layout": "v4-model1",
		"page_entries": fmt.Sprint(PageEntries), "heads": fmt.Sprint(FlashHeads)}
	for _, c := range FlashCases {
		qb := make([]byte, 2*len(in.Q[c.Name]))
		for i, v := range in.Q[c.Name] {
			binary.LittleEndian.PutUint16(qb[2*i:], quant.BF16Bits(v))
		}
		ib := make([]byte, 4*len(in.Idx[c.Name]))
		for i, v := range in.Idx[c.Name] {
			binary.LittleEndian.PutUint32(ib[4*i:], uint32(v))
		}
		t := in.CaseTable(c)
		tb := make([]byte, 8*len(t))
		for i, v := range t {
			putU64(tb[8*i:], uint64(v))
		}
		recs = append(recs,
			dump.Record{Name: c.Name + ".q", DType: dump.BF16, Shape: []int{c.B, c.SQ, FlashHeads, FlashDim}, Data: qb},
			dump.Record{Name: c.Name + ".idx", DType: dump.I32, Shape: []int{c.B, c.SQ, c.TopK()}, Data: ib},
			dump.Record{Name: c.Name + ".block_table", DType: dump.I64, Shape: []int{len(t)}, Data: tb})
		meta[c.Name+".fault"] = c.Fault
	}
	return dump.WriteSafetensors(w, recs, meta)
}

func f32Bytes(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}
