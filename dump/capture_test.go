package dump

import (
	"math"
	"path/filepath"
	"slices"
	"testing"
)

const captureDir = "../testdata/dump/capture"

func mustF32(t *testing.T, d *Dump, k Key, kind Kind) ([]float32, []int) {
	t.Helper()
	r, err := d.Get(k, kind)
	if err != nil {
		t.Fatal(err)
	}
	v, err := r.Float32()
	if err != nil {
		t.Fatal(err)
	}
	return v, r.Shape
}

// TestCaptureGPU checks the dump written by capture/tests/gpu_smoke.py on an
// H200 against values fixed by that script.
func TestCaptureGPU(t *testing.T) {
	d, err := Open(filepath.Join(captureDir, "capture_smoke.smd"))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Header.Producer["engine"] != "capture-smoke" || !slices.Equal(d.Header.CompressRatios, []int{0, 4}) {
		t.Errorf("header %+v", d.Header)
	}
	// The npz holds cq as uint16 bf16 bits; a name map reinterprets them.
	m, err := ParseNameMap([]byte(`{"name": "smoke-npz", "files": [{"file": "\\.npz$", "rules": [
		{"match": "^s(?P<step>\\d+)/L(?P<layer>\\d+)\\.(?P<stage>.+)$", "dtype": "bf16"}]}]}`), "test")
	if err != nil {
		t.Fatal(err)
	}
	z, err := OpenMapped(filepath.Join(captureDir, "capture_smoke.npz"), m)
	if err != nil {
		t.Fatal(err)
	}
	defer z.Close()
	split, err := Open(filepath.Join(captureDir, "capture_split"))
	if err != nil {
		t.Fatal(err)
	}
	defer split.Close()

	for _, p := range []int{5, 6} {
		// x of layer 0 is bf16(arange(16)/8 - 1) + p: exact in bf16.
		x, _ := mustF32(t, d, Key{Step: p, Layer: 0, Stage: "x"}, KindStage)
		for i, v := range x {
			if want := float32(i)/8 - 1 + float32(p); v != want {
				t.Errorf("p%d L0.x[%d] = %v, want %v", p, i, v, want)
			}
		}
		for l := 0; l < 2; l++ {
			cq, shape := mustF32(t, d, Key{Step: p, Layer: l, Stage: "cq"}, KindStage)
			ref, _ := mustF32(t, z, Key{Step: p, Layer: l, Stage: "cq"}, KindStage)
			if !slices.Equal(shape, []int{8}) || !slices.Equal(cq, ref) {
				t.Errorf("p%d L%d.cq = %v, npz copy %v", p, l, cq, ref)
			}
			nz := 0
			for _, v := range cq {
				if v != 0 {
					nz++
				}
			}
			if nz == 0 {
				t.Errorf("p%d L%d.cq is all zero: the dumper did not clone before the in-place op", p, l)
			}
			// y (output rule on the module that also has the input rule x) = 2 cq.
			y, _ := mustF32(t, d, Key{Step: p, Layer: l, Stage: "y"}, KindStage)
			for i := range y {
				if y[i] != 2*cq[i] {
					t.Errorf("p%d L%d.y[%d] = %v, want 2*cq = %v", p, l, i, y[i], 2*cq[i])
				}
			}
			for _, st := range []string{"x", "q_a", "cq", "y"} {
				k := Key{Step: p, Layer: l, Stage: st}
				a, _ := mustF32(t, d, k, KindStage)
				b, _ := mustF32(t, split, k, KindStage)
				if !slices.Equal(a, b) {
					t.Errorf("%s differs between the single file and the split directory", k)
				}
			}
		}
		// Layer 1's input is cat(attn(x), attn(x)) = cat(2 cq, 2 cq) of layer 0.
		x1, _ := mustF32(t, d, Key{Step: p, Layer: 1, Stage: "x"}, KindStage)
		cq0, _ := mustF32(t, d, Key{Step: p, Layer: 0, Stage: "cq"}, KindStage)
		for i, v := range x1 {
			if want := 2 * cq0[i%8]; v != want {
				t.Errorf("p%d L1.x[%d] = %v, want 2*cq0 = %v", p, i, v, want)
			}
		}
		known := map[string][]float32{
			"known_bf16": {1, -2.5, 3.140625},
			"known_e4m3": {448, 1, -0.5, 0.001953125},
			"known_e8m0": {1, 8, 1.0 / 1024},
			"known_fp4":  {1, -0.5, 6, 0},
		}
		for st, want := range known {
			v, _ := mustF32(t, d, Key{Step: p, Layer: Global, Stage: st}, KindStage)
			if !slices.Equal(v, want) {
				t.Errorf("p%d %s = %v, want %v", p, st, v, want)
			}
		}
		pr, err := d.Get(Key{Step: p, Layer: Global, Stage: "pos"}, KindStage)
		if err != nil {
			t.Fatal(err)
		}
		if pos, err := pr.Int64(); err != nil || !slices.Equal(pos, []int64{int64(p)}) {
			t.Errorf("pos = %v, %v", pos, err)
		}
	}
	kv, shape := mustF32(t, d, Key{Step: 4, Layer: 0, Stage: "kv_cache"}, KindState)
	if !slices.Equal(shape, []int{8, 4}) {
		t.Fatalf("kv_cache shape %v", shape)
	}
	for i, v := range kv {
		if v != float32(i) {
			t.Fatalf("state kv_cache[%d] = %v", i, v)
		}
	}
	// freqs_cis_r0[t, i] = (cos, sin)(2t + i) in fp32 from the GPU.
	fc, shape := mustF32(t, d, Key{Step: NoStep, Layer: Global, Stage: "freqs_cis_r0"}, KindTable)
	if !slices.Equal(shape, []int{4, 2, 2}) {
		t.Fatalf("freqs_cis_r0 shape %v", shape)
	}
	for a := 0; a < 8; a++ {
		c, s := math.Cos(float64(a)), math.Sin(float64(a))
		if math.Abs(float64(fc[2*a])-c) > 1e-6 || math.Abs(float64(fc[2*a+1])-s) > 1e-6 {
			t.Errorf("freqs_cis_r0 angle %d = (%v, %v), want (%v, %v)", a, fc[2*a], fc[2*a+1], c, s)
		}
	}
	page, err := d.Get(Key{Step: 6, Layer: 0, Stage: "kv_page"}, KindPage)
	if err != nil {
		t.Fatal(err)
	}
	if page.Page == nil || page.Page.Layout != LayoutV4Model1 || page.Page.PageID != 3 || !slices.Equal(page.Page.BlockTable, []int{3}) || len(page.Data) != 2*584 {
		t.Errorf("page %+v, %d bytes", page.Page, len(page.Data))
	}
	for i, b := range page.Data {
		if b != byte(i) {
			t.Fatalf("page byte %d = %d", i, b)
		}
	}
	if len(d.Prefix) != 1 || d.Prefix[0].Request != "r1" || d.Prefix[0].Source != "" || d.Prefix[0].Tokens != 5 || d.Prefix[0].File == "" || d.Prefix[0].Record == 0 {
		t.Errorf("prefix hits %+v", d.Prefix)
	}
	if len(d.Incomplete) != 0 || len(split.Incomplete) != 0 {
		t.Errorf("capture files without an end frame: %v %v", d.Incomplete, split.Incomplete)
	}
}

// TestSafetensorsReference reads a file written by the reference
// safetensors.torch.save_file (0.8.0) on the GPU machine.
func TestSafetensorsReference(t *testing.T) {
	s, err := OpenSafetensors(filepath.Join(captureDir, "st_ref.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s.Metadata["producer"] != "safetensors.torch" {
		t.Errorf("metadata %v", s.Metadata)
	}
	want := map[string][]float32{
		"known_bf16": {1, -2.5, 3.140625},
		"known_e4m3": {448, 1, -0.5, 0.001953125},
		"known_e8m0": {1, 8, 1.0 / 1024},
		"known_f16":  {65504, -1},
	}
	for name, w := range want {
		v, _, err := s.Float32(name)
		if err != nil || !slices.Equal(v, w) {
			t.Errorf("%s = %v, %v; want %v", name, v, err, w)
		}
	}
	if v, _, err := s.Int64("known_i64"); err != nil || !slices.Equal(v, []int64{5, -6}) {
		t.Errorf("known_i64 = %v, %v", v, err)
	}
}
