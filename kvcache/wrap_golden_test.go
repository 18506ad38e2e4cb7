package kvcache

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"testing"

	"sparsemla/quant"
)

// The long GPU golden (testdata/gpu-v4-tiny-long, made by capture/golden/v4_decode.py:
// official model.py on an H200, prompt of 126 tokens, decode steps 126..256)
// crosses the window wrap and r = 4 emissions. Read with a minimal safetensors
// reader (the dump package sits above this one).
const longDir = "../testdata/gpu-v4-tiny-long"

type stFile struct {
	hdr  map[string]json.RawMessage
	data []byte
}

func openST(t *testing.T, name string) stFile {
	t.Helper()
	raw, err := os.ReadFile(longDir + "/" + name)
	if err != nil {
		t.Fatalf("this test reads the long GPU golden of capture/golden/v4_decode.py: %v", err)
	}
	n := binary.LittleEndian.Uint64(raw)
	var h map[string]json.RawMessage
	if err := json.Unmarshal(raw[8:8+n], &h); err != nil {
		t.Fatal(err)
	}
	return stFile{h, raw[8+n:]}
}

// get returns a tensor as fp32 (BF16, F32) or int64 (I32, I64) values and its shape.
func (f stFile) get(t *testing.T, key string) ([]float32, []int64, []int) {
	t.Helper()
	var m struct {
		Dtype   string
		Shape   []int
		Offsets []int `json:"data_offsets"`
	}
	raw, ok := f.hdr[key]
	if !ok {
		t.Fatalf("tensor %s missing", key)
	}
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	b := f.data[m.Offsets[0]:m.Offsets[1]]
	switch m.Dtype {
	case "BF16":
		v := make([]float32, len(b)/2)
		for i := range v {
			v[i] = quant.BF16ToF32(binary.LittleEndian.Uint16(b[2*i:]))
		}
		return v, nil, m.Shape
	case "F32":
		v := make([]float32, len(b)/4)
		for i := range v {
			v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
		}
		return v, nil, m.Shape
	case "I32":
		v := make([]int64, len(b)/4)
		for i := range v {
			v[i] = int64(int32(binary.LittleEndian.Uint32(b[4*i:])))
		}
		return nil, v, m.Shape
	}
	t.Fatalf("%s: dtype %s", key, m.Dtype)
	return nil, nil, nil
}

// From the state after step 254 (window ring of tokens 127..254, compressed rows
// 0..62 of the ratio-4 layer L1), storing steps 255 (row 63 emitted) and 256
// (the ring wraps: slot 0 = token 256) in paged MODEL1 caches rebuilds the GPU's
// kv_cache tensors exactly, gathers the GPU's own index list, and the per-token
// compressor state reproduces the GPU's kv_state/score_state across the
// emission's shift.
func TestLayerCacheAcrossWindowWrapGolden(t *testing.T) {
	s254 := openST(t, "step_254.safetensors")
	steps := map[int]stFile{255: openST(t, "step_255.safetensors"), 256: openST(t, "step_256.safetensors")}
	ape, _ := goldenF32(t)("L1.ape")
	for _, ring := range []bool{true, false} {
		g := DefaultGeometry
		g.WindowRing = ring
		c, err := NewLayerCache(LayerSpec{Ratio: 4, KVLayout: LayoutV4Model1, IndexLayout: LayoutIndexerFP8}, g, 512)
		if err != nil {
			t.Fatal(err)
		}
		kv0, _, shape := s254.get(t, "L1.kv_cache") // [128 + 63, 512]
		for s := 0; s < 128; s++ {
			tok := 254 - ((254-s)%128+128)%128
			if err := c.WriteWindow(tok, kv0[s*512:(s+1)*512], RefFP8); err != nil {
				t.Fatal(err)
			}
		}
		for j := 0; j < shape[0]-128; j++ {
			if err := c.WriteCompressed(j, kv0[(128+j)*512:(129+j)*512], RefFP8); err != nil {
				t.Fatal(err)
			}
		}
		// Compressor state: per-token rows from the reference layout after step 254.
		kvs, _, _ := s254.get(t, "L1.cmp_kv_state")
		scs, _, _ := s254.get(t, "L1.cmp_score_state")
		w := c.State.Width()
		for i, tok := range c.State.ReferenceTokens(254) {
			if err := c.State.Store(tok, kvs[i*w:(i+1)*w], scs[i*w:(i+1)*w]); err != nil {
				t.Fatal(err)
			}
		}
		for p := 255; p <= 256; p++ {
			st := steps[p]
			kv, _, _ := st.get(t, "L1.kv")
			if err := c.WriteWindow(p, kv, RefFP8); err != nil {
				t.Fatal(err)
			}
			if (p+1)%4 == 0 {
				row, _, _ := st.get(t, "L1.cmp_row")
				if err := c.WriteCompressed(p/4, row, RefFP8); err != nil {
					t.Fatal(err)
				}
			}
			a, _, _ := st.get(t, "L1.cmp_a")
			b, _, _ := st.get(t, "L1.cmp_b")
			score := make([]float32, w)
			for i := range score {
				score[i] = b[i] + ape[(p%4)*w+i]
			}
			if err := c.State.Store(p, a, score); err != nil {
				t.Fatal(err)
			}

			want, _, wshape := st.get(t, "L1.kv_cache")
			got, rows, faults, err := c.ReferenceKV(p)
			if err != nil || len(faults) != 0 {
				t.Fatal(err, faults)
			}
			if rows != wshape[0] {
				t.Fatalf("ring=%v step %d: %d rows, GPU %d", ring, p, rows, wshape[0])
			}
			for i := range want {
				if !sameBits(got[i], want[i]) {
					t.Fatalf("ring=%v step %d kv_cache[%d][%d] = %g, GPU %g", ring, p, i/512, i%512, got[i], want[i])
				}
			}
			_, idx, _ := st.get(t, "L1.topk_idxs")
			rowsOut := make([]float32, len(idx)*512)
			if fs, err := c.GatherIndexList(rowsOut, idx, p); err != nil || len(fs) != 0 {
				t.Fatal(err, fs)
			}
			for i, x := range idx {
				for d := 0; d < 512; d++ {
					w := float32(0)
					if x >= 0 {
						w = want[int(x)*512+d]
					}
					if !sameBits(rowsOut[i*512+d], w) {
						t.Fatalf("step %d index list entry %d (%d) dim %d: %g, want %g", p, i, x, d, rowsOut[i*512+d], w)
					}
				}
			}
			gk, gs, err := c.State.Reference(p)
			if err != nil {
				t.Fatal(err)
			}
			wk, _, _ := st.get(t, "L1.cmp_kv_state")
			ws, _, _ := st.get(t, "L1.cmp_score_state")
			for i := range wk {
				if !sameBits(gk[i], wk[i]) || !sameBits(gs[i], ws[i]) {
					t.Fatalf("step %d state row %d col %d: %g/%g, GPU %g/%g", p, i/w, i%w, gk[i], gs[i], wk[i], ws[i])
				}
			}
		}
	}
}
