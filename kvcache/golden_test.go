package kvcache

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"testing"

	"sparsemla/quant"
)

// The GPU goldens of testdata/kvcache/gpu were written by capture/golden/kv_pages.py
// on an H200 (torch 2.11): pages quantised by torch with FlashMLA's / vLLM's
// semantics, and the same pages dequantised by torch.
const goldenDir = "../testdata/kvcache/gpu"

type goldenCase struct {
	Name      string  `json:"name"`
	Layout    string  `json:"layout"`
	PageSize  int     `json:"page_size"`
	Dim       int     `json:"dim"`
	Rule      string  `json:"rule"`
	Floor     float64 `json:"floor"`
	PadFill   int     `json:"pad_fill"`
	Entries   int     `json:"entries"`
	Pages     int     `json:"pages"`
	PageBytes int     `json:"page_bytes"`
}

func loadGolden(t *testing.T) []goldenCase {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(goldenDir, "manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	var m struct{ Cases []goldenCase }
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	if len(m.Cases) == 0 {
		t.Fatal("golden manifest has no cases")
	}
	return m.Cases
}

func readBF16File(t *testing.T, name string) []float32 {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(goldenDir, name))
	if err != nil {
		t.Fatal(err)
	}
	v := make([]float32, len(raw)/2)
	for i := range v {
		v[i] = quant.BF16ToF32(binary.LittleEndian.Uint16(raw[2*i:]))
	}
	return v
}

func (c goldenCase) scaling(t *testing.T) Scaling {
	rule, ok := quant.ParseScaleRule(c.Rule)
	if !ok {
		t.Fatalf("%s: unknown rule %q", c.Name, c.Rule)
	}
	return Scaling{rule, float32(c.Floor)}
}

// sameBits reports whether a and b hold the same fp32 bit patterns (NaN-aware).
func sameBits(a, b float32) bool { return math.Float32bits(a) == math.Float32bits(b) }

func TestGoldenPagesDecode(t *testing.T) {
	for _, c := range loadGolden(t) {
		t.Run(c.Name, func(t *testing.T) {
			l, err := ParseLayout(c.Layout)
			if err != nil {
				t.Fatal(err)
			}
			f := MustFormat(l, c.Dim, c.PageSize)
			if f.PageBytes() != c.PageBytes {
				t.Fatalf("PageBytes = %d, GPU wrote %d-byte pages", f.PageBytes(), c.PageBytes)
			}
			pages, err := os.ReadFile(filepath.Join(goldenDir, c.Name+".pages.bin"))
			if err != nil {
				t.Fatal(err)
			}
			want := readBF16File(t, c.Name+".decoded.bf16")
			got := make([]float32, c.Entries*c.Dim)
			warns := 0
			for p := 0; p < c.Pages; p++ {
				page := pages[p*c.PageBytes : (p+1)*c.PageBytes]
				faults := f.DecodePage(got[p*c.PageSize*c.Dim:], page)
				if e := faults.FirstError(); e != nil {
					t.Errorf("page %d: unexpected fault %v", p, e)
				}
				warns += len(faults) - faults.Errors()
			}
			for i := range want {
				if !sameBits(got[i], want[i]) {
					t.Fatalf("entry %d dim %d: Go decoded %g (%#x), GPU %g (%#x)", i/c.Dim, i%c.Dim,
						got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
				}
			}
			// Pad bytes written as 0x5A (torch.empty garbage) are reported, never errors.
			if c.PadFill != 0 && warns == 0 {
				t.Errorf("pad bytes %#x were not reported", c.PadFill)
			}
			if c.PadFill == 0 && warns != 0 {
				t.Errorf("%d warnings on a page with zero pads", warns)
			}
		})
	}
}

func TestGoldenPagesEncode(t *testing.T) {
	for _, c := range loadGolden(t) {
		t.Run(c.Name, func(t *testing.T) {
			l, _ := ParseLayout(c.Layout)
			f := MustFormat(l, c.Dim, c.PageSize)
			sc := c.scaling(t)
			rows := readBF16File(t, c.Name+".rows.bf16")
			pages, err := os.ReadFile(filepath.Join(goldenDir, c.Name+".pages.bin"))
			if err != nil {
				t.Fatal(err)
			}
			page := make([]byte, f.PageBytes())
			for p := 0; p < c.Pages; p++ {
				f.EncodePage(page, rows[p*c.PageSize*c.Dim:(p+1)*c.PageSize*c.Dim], sc)
				if d := f.ComparePages(page, pages[p*c.PageBytes:(p+1)*c.PageBytes]); d != nil {
					t.Fatalf("page %d under rule %v: %v", p, sc.Rule, d)
				}
			}
		})
	}
}

// TestGoldenFQ8Lossless: the official model's FQ8 rows stored in the MODEL1
// layout with the reference scale rule decode to themselves, bit for bit.
func TestGoldenFQ8Lossless(t *testing.T) {
	rows := readBF16File(t, "model1_fq8_ceil2.rows.bf16")
	f := MustFormat(LayoutV4Model1, 0, 64)
	page := make([]byte, f.PageBytes())
	f.EncodePage(page, rows, RefFP8)
	got := make([]float32, len(rows))
	if fs := f.DecodePage(got, page); len(fs) != 0 {
		t.Fatalf("faults on a reference page: %v", fs[0])
	}
	for i := range rows {
		if !sameBits(got[i], rows[i]) {
			t.Fatalf("row %d dim %d: %g round-tripped to %g", i/512, i%512, rows[i], got[i])
		}
	}
}

// TestGoldenRuleSensitivity shows the byte tests can fail: encoding the GPU's
// inputs under a different scale rule (spec §9.4) changes the pages. For the
// model's FQ8 rows the zero rows get scale 2^-22 (ceil2) vs 2^-13 (FlashMLA);
// for the corner-case rows the |max| = 448·2^k tiles differ by one exponent.
func TestGoldenRuleSensitivity(t *testing.T) {
	for _, c := range loadGolden(t) {
		if c.Rule != "flashmla" {
			continue
		}
		l, _ := ParseLayout(c.Layout)
		f := MustFormat(l, c.Dim, c.PageSize)
		rows := readBF16File(t, c.Name+".rows.bf16")
		pages, _ := os.ReadFile(filepath.Join(goldenDir, c.Name+".pages.bin"))
		page := make([]byte, f.PageBytes())
		diffBytes, scaleBytes := 0, 0
		for p := 0; p < c.Pages; p++ {
			f.EncodePage(page, rows[p*c.PageSize*c.Dim:(p+1)*c.PageSize*c.Dim], RefFP8)
			if d := f.ComparePages(page, pages[p*c.PageBytes:(p+1)*c.PageBytes]); d != nil {
				diffBytes += d.Bytes
			}
			for i := range page {
				if loc := f.Locate(i); loc.Field == FieldScale && page[i] != pages[p*c.PageBytes+i] {
					scaleBytes++
				}
			}
		}
		t.Logf("%s: ceil2 vs FlashMLA rule: %d differing bytes, %d of them scale bytes", c.Name, diffBytes, scaleBytes)
		if diffBytes == 0 {
			t.Errorf("%s: rules ceil2 and flashmla give identical pages; the corner cases are missing", c.Name)
		}
	}
}
