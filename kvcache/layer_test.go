package kvcache

import (
	"math/rand/v2"
	"strings"
	"testing"

	"sparsemla/quant"
)

func TestBlockTableSlot(t *testing.T) {
	bt := BlockTable{3, -1, 7}
	const B = 4
	for _, c := range []struct {
		pos, slot int
		err       string
	}{
		{0, 12, ""}, {3, 15, ""}, {9, 29, ""}, {11, 31, ""}, {-1, -1, ""},
		{5, 0, "not allocated"}, {12, 0, "past the block table"}, {-2, 0, "negative"},
	} {
		s, err := bt.Slot(c.pos, B)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("Slot(%d) = %d, %v; want error %q", c.pos, s, err, c.err)
			}
			continue
		}
		if err != nil || s != c.slot {
			t.Errorf("Slot(%d) = %d, %v; want %d", c.pos, s, err, c.slot)
		}
	}
	dst := make([]int64, 4)
	if err := bt.Slots(dst, []int64{0, -1, 8, 1}, B); err != nil || dst[0] != 12 || dst[1] != -1 || dst[2] != 28 || dst[3] != 13 {
		t.Errorf("Slots = %v, %v", dst, err)
	}
	if err := bt.Slots(dst, []int64{0, 4}, B); err == nil || !strings.Contains(err.Error(), "index 1") {
		t.Errorf("Slots error %v does not name the list entry", err)
	}
}

func TestWrapPoolValidates(t *testing.T) {
	f := MustFormat(LayoutIndexerFP8, 0, 4)
	if _, err := WrapPool(f, make([]byte, f.PageBytes()*2+1), nil); err == nil {
		t.Error("partial page accepted")
	}
	if _, err := WrapPool(f, make([]byte, f.PageBytes()*2), BlockTable{0, 2}); err == nil {
		t.Error("table entry past the pool accepted")
	}
	if _, err := WrapPool(f, make([]byte, f.PageBytes()*2), BlockTable{1, -1, 0}); err != nil {
		t.Error(err)
	}
}

// Rows written through a shuffled block table come back by logical position,
// and -1 index entries gather as zero rows.
func TestPoolGatherShuffledTable(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	f := MustFormat(LayoutV4Model1, 0, 4)
	p := NewPool(f, 5)
	p.Table = BlockTable{4, 0, 3, 1, 2}
	rows := randRows(rng, 20, 512)
	for pos := 0; pos < 20; pos++ {
		if err := p.Write(pos, rows[pos*512:(pos+1)*512], RefFP8); err != nil {
			t.Fatal(err)
		}
	}
	idx := []int64{17, -1, 0, 6, -1}
	dst := make([]float32, len(idx)*512)
	faults, err := p.Gather(dst, idx)
	if err != nil || len(faults) != 0 {
		t.Fatal(err, faults)
	}
	for i, pos := range idx {
		want := make([]float32, 512)
		if pos >= 0 {
			want = expectedRoundTrip(LayoutV4Model1, rows[pos*512:(pos+1)*512])
		}
		for d := range want {
			if !sameBits(dst[i*512+d], want[d]) {
				t.Fatalf("list entry %d (pos %d) dim %d: %g, want %g", i, pos, d, dst[i*512+d], want[d])
			}
		}
	}
	// A corrupt scale in physical page 3 (logical page 2: positions 8..11) is
	// reported against the list entry and logical position that read it.
	p.Page(3)[4*Model1DataBytes+1*Model1ScaleBytes+2] = 0xFF
	faults, err = p.Gather(dst, []int64{0, 9, 9})
	if err != nil || len(faults) != 2 || faults[0].Index != 1 || faults[0].Pos != 9 || faults[0].Fault.Kind != FaultScaleNaN {
		t.Fatalf("faults %+v, err %v", faults, err)
	}
	if _, err := p.Gather(dst, []int64{0, 20}); err == nil || !strings.Contains(err.Error(), "index list entry 1") {
		t.Fatalf("gather past the table: %v", err)
	}
}

// The official model's cache rows (testdata/kvcache/model_kv_rows.bf16: rows of
// L1.kv_cache at decode step 7, a ratio-4 layer: window tokens 0..7, compressed
// rows 0 and 1) stored in a paged MODEL1 layer cache rebuild the reference's
// kv_cache tensor [128 + 2, 512] exactly.
func TestLayerCacheReferenceKVGolden(t *testing.T) {
	all := readBF16File(t, "../model_kv_rows.bf16")
	l1 := all[8*512 : 18*512] // rows 8..17 of the file are L1's
	for _, ring := range []bool{true, false} {
		g := DefaultGeometry
		g.WindowRing = ring
		c, err := NewLayerCache(LayerSpec{Ratio: 4, KVLayout: LayoutV4Model1, IndexLayout: LayoutIndexerFP8}, g, 512)
		if err != nil {
			t.Fatal(err)
		}
		for tok := 0; tok < 8; tok++ {
			if err := c.WriteWindow(tok, l1[tok*512:(tok+1)*512], RefFP8); err != nil {
				t.Fatal(err)
			}
		}
		for j := 0; j < 2; j++ {
			if err := c.WriteCompressed(j, l1[(8+j)*512:(9+j)*512], RefFP8); err != nil {
				t.Fatal(err)
			}
		}
		// The index list of step 7 in the reference's index space (window slots
		// 0..7, -1 padding, compressed rows 128+j) gathers the same rows.
		idx := []int64{0, 5, 7, -1, 128, 129}
		got := make([]float32, len(idx)*512)
		if fs, err := c.GatherIndexList(got, idx, 7); err != nil || len(fs) != 0 {
			t.Fatal(err, fs)
		}
		for i, src := range []int{0, 5, 7, -1, 8, 9} {
			for d := 0; d < 512; d++ {
				want := float32(0)
				if src >= 0 {
					want = l1[src*512+d]
				}
				if !sameBits(got[i*512+d], want) {
					t.Fatalf("ring=%v list entry %d dim %d: %g, want %g", ring, i, d, got[i*512+d], want)
				}
			}
		}
		if _, err := c.GatherIndexList(got[:512], []int64{130}, 7); err == nil {
			t.Fatal("compressed row 2 is not visible at step 7")
		}
		kv, rows, faults, err := c.ReferenceKV(7)
		if err != nil || len(faults) != 0 {
			t.Fatal(err, faults)
		}
		if rows != 130 || len(kv) != 130*512 {
			t.Fatalf("%d rows, %d values", rows, len(kv))
		}
		for r := 0; r < 130; r++ {
			src := -1
			switch {
			case r < 8:
				src = r
			case r >= 128:
				src = 8 + r - 128
			}
			for d := 0; d < 512; d++ {
				want := float32(0)
				if src >= 0 {
					want = l1[src*512+d]
				}
				if !sameBits(kv[r*512+d], want) {
					t.Fatalf("ring=%v kv_cache[%d][%d] = %g, want %g", ring, r, d, kv[r*512+d], want)
				}
			}
		}
	}
}

// The window ring holds the newest token of each slot; a read of an older
// token is an error, not a silent stale row. In paged-SWA mode, pages that slid
// out of the window are freed (-1) and reading them fails.
func TestWindowRingAndSlidingPages(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	row := randRows(rng, 1, 512)
	g := DefaultGeometry
	g.WindowRing = true
	c, _ := NewLayerCache(LayerSpec{Ratio: 0, KVLayout: LayoutBF16}, g, 1024)
	for tok := 0; tok <= 300; tok++ {
		row[0] = float32(tok)
		if err := c.WriteWindow(tok, row, RefFP8); err != nil {
			t.Fatal(err)
		}
	}
	dst := make([]float32, 512)
	if _, err := c.ReadWindow(dst, 299); err != nil || dst[0] != quant.BF16Round(299) {
		t.Fatalf("token 299: %v %g", err, dst[0])
	}
	if _, err := c.ReadWindow(dst, 299-128); err == nil || !strings.Contains(err.Error(), "holds token 299") {
		t.Fatalf("stale ring read: %v", err)
	}

	g.WindowRing = false
	c, _ = NewLayerCache(LayerSpec{Ratio: 0, KVLayout: LayoutV4Model1}, g, 1024)
	for tok := 0; tok <= 300; tok++ {
		if err := c.WriteWindow(tok, row, RefFP8); err != nil {
			t.Fatal(err)
		}
	}
	// Free the pages wholly before the window of p = 300 (tokens < 173): pages 0, 1.
	c.Window.Table[0], c.Window.Table[1] = -1, -1
	if _, err := c.ReadWindow(dst, 200); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ReadWindow(dst, 100); err == nil || !strings.Contains(err.Error(), "not allocated") {
		t.Fatalf("read of a freed page: %v", err)
	}
}

// StatePool.ReferenceTokens follows the reference's state machine (spec §5),
// simulated here with token ids as the state values.
func TestStateReferenceTokensMatchStateMachine(t *testing.T) {
	for _, r := range []int{4, 128} {
		s := NewStatePool(r, 8, 4, 600)
		rows := coffOf(r) * r
		sim := make([]int, rows)
		for i := range sim {
			sim[i] = -1
		}
		for p := 0; p < 600; p++ {
			if r == 4 {
				sim[4+p%4] = p
				if (p+1)%4 == 0 {
					copy(sim[0:4], sim[4:8])
				}
			} else {
				sim[p%r] = p
			}
			got := s.ReferenceTokens(p)
			for i := range sim {
				if got[i] != sim[i] {
					t.Fatalf("r=%d p=%d: ReferenceTokens %v, state machine %v", r, p, got, sim)
				}
			}
		}
	}
}

// StatePool.Reference assembles kv_state/score_state from per-token rows:
// never-written rows are kv 0, score −inf.
func TestStateReference(t *testing.T) {
	s := NewStatePool(4, 2, 4, 64)
	for tok := 0; tok < 6; tok++ {
		kv := []float32{float32(tok), 0, 0, float32(-tok)}
		sc := []float32{float32(10 + tok), 1, 2, 3}
		if err := s.Store(tok, kv, sc); err != nil {
			t.Fatal(err)
		}
	}
	kv, score, err := s.Reference(1) // rows 0..3: none yet; rows 4, 5: tokens 0, 1
	if err != nil {
		t.Fatal(err)
	}
	if s.Rows() != 8 || s.Width() != 4 || len(kv) != 32 {
		t.Fatalf("shape %d x %d, %d values", s.Rows(), s.Width(), len(kv))
	}
	if kv[5*4] != 1 || score[5*4] != 11 || score[6*4] > -1e38 || kv[6*4] != 0 {
		t.Fatalf("rows: kv %v score %v", kv, score)
	}
	kv, _, _ = s.Reference(5) // rows 0..3 = tokens 0..3, row 4 = 4, row 5 = 5, rows 6,7 = 2,3
	for i, want := range []float32{0, 1, 2, 3, 4, 5, 2, 3} {
		if kv[i*4] != want {
			t.Fatalf("row %d holds %g, want token %g", i, kv[i*4], want)
		}
	}
}
