package quant

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// officialPath holds stage inputs and outputs of FQ8, FQ4 and Had cut out of the
// GPU decode dumps of the official DeepSeek-V4 model.py (tiny config, H200; see
// testdata/quant/README.md). Regenerate it with
//
//	go test ./quant -run TestOfficialTiny -args -quant.official=<dir of official-v4-tiny>
const officialPath = "../testdata/quant/official_tiny.bin.gz"

var officialDir = flag.String("quant.official", "", "directory of the official-v4-tiny GPU dumps: rewrite "+officialPath+" from it")

// officialStages lists, per stage, the dump keys of its input and output (per
// layer, at every decode step where they exist) and the element range used.
var officialStages = []struct {
	stage   string
	in, out []string
	dims    int // leading dims of each row that the stage touches
}{
	// window K and compressed rows: FQ8 on dims 0..447, RoPE dims untouched
	{"fq8", []string{"kv_roped", "cmp_roped"}, []string{"kv", "cmp_row"}, 448},
	// indexer q and compressed index keys: Hadamard, then FQ4
	{"had", []string{"iq_roped", "icmp_roped"}, []string{"iq_had", "icmp_had"}, 128},
	{"fq4", []string{"iq_had", "icmp_had"}, []string{"iq", "icmp_row"}, 128},
}

// TestOfficialTiny replays FQ8, Had and FQ4 on the stage inputs the official
// model produced on the GPU and requires its outputs bit for bit. With
// -quant.official it first rewrites the fixture from the dumps.
func TestOfficialTiny(t *testing.T) {
	if *officialDir != "" {
		if err := writeOfficialFixture(*officialDir, officialPath); err != nil {
			t.Fatal(err)
		}
	}
	recs, err := readGolden(officialPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range officialStages {
		in, ok1 := recs[st.stage+"/in"]
		want, ok2 := recs[st.stage+"/out"]
		if !ok1 || !ok2 || in.size != 2 || want.size != 2 || in.len() != want.len() || in.len()%st.dims != 0 {
			t.Fatalf("%s: fixture records missing or malformed", st.stage)
		}
		v := bf16Slice(in)
		ref := make([]float32, len(v))
		for r := 0; r < len(v); r += st.dims {
			row := v[r : r+st.dims]
			switch st.stage {
			case "fq8":
				copy(ref[r:], row)
				fq8Ref(ref[r:r+st.dims], 64)
				FQ8(row, 64)
			case "had":
				HadamardRef(ref[r:r+st.dims], row)
				Hadamard(row)
			case "fq4":
				copy(ref[r:], row)
				fq4Ref(ref[r:r+st.dims], 32)
				FQ4(row, 32)
			}
		}
		compareBF16(t, st.stage+" (official model, fast)", v, want)
		compareBF16(t, st.stage+" (official model, reference)", ref, want)
		t.Logf("%s: %d values from the official model's GPU run reproduced", st.stage, len(v))
	}
}

// writeOfficialFixture cuts the stage rows out of step_*.safetensors in dir and
// writes them in the golden format (records <stage>/in, <stage>/out, meta).
func writeOfficialFixture(dir, path string) error {
	steps, err := filepath.Glob(filepath.Join(dir, "step_*.safetensors"))
	if err != nil || len(steps) == 0 {
		return fmt.Errorf("no step_*.safetensors in %s", dir)
	}
	sort.Strings(steps)
	var names []string
	var data [][]byte
	var meta strings.Builder
	fmt.Fprintf(&meta, "rows cut from %s (official DeepSeek-V4 model.py, tiny config, H200):", filepath.Base(dir))
	for _, st := range officialStages {
		var in, out []byte
		for _, f := range steps {
			tensors, err := readSafetensorsBF16(f)
			if err != nil {
				return err
			}
			for l := 0; l < 16; l++ {
				for k := range st.in {
					a, ok := tensors[fmt.Sprintf("L%d.%s", l, st.in[k])]
					b, ok2 := tensors[fmt.Sprintf("L%d.%s", l, st.out[k])]
					if !ok || !ok2 {
						continue
					}
					width := 512
					if st.dims == 128 {
						width = 128
					}
					if len(a) != len(b) || len(a)%(2*width) != 0 {
						return fmt.Errorf("%s: L%d.%s/%s: sizes %d, %d", f, l, st.in[k], st.out[k], len(a), len(b))
					}
					for r := 0; r < len(a); r += 2 * width {
						in = append(in, a[r:r+2*st.dims]...)
						out = append(out, b[r:r+2*st.dims]...)
					}
					fmt.Fprintf(&meta, " %s:L%d.%s", strings.TrimSuffix(filepath.Base(f), ".safetensors"), l, st.in[k])
				}
			}
		}
		names = append(names, st.stage+"/in", st.stage+"/out")
		data = append(data, in, out)
	}
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	zw.Write([]byte(goldenMagic))
	binary.Write(zw, binary.LittleEndian, uint32(len(names)+1))
	write := func(name string, size uint8, b []byte) {
		binary.Write(zw, binary.LittleEndian, uint16(len(name)))
		zw.Write([]byte(name))
		zw.Write([]byte{size})
		binary.Write(zw, binary.LittleEndian, uint32(len(b)/int(size)))
		zw.Write(b)
	}
	write("meta", 1, []byte(meta.String()))
	for i, n := range names {
		write(n, 2, data[i])
	}
	if err := zw.Close(); err != nil {
		return err
	}
	return os.WriteFile(path, buf.Bytes(), 0o644)
}

// readSafetensorsBF16 returns the raw little-endian bytes of every BF16 tensor of
// a safetensors file.
func readSafetensorsBF16(path string) (map[string][]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	if len(b) < 8 {
		return nil, fmt.Errorf("%s: too short for a safetensors header", path)
	}
	n := binary.LittleEndian.Uint64(b)
	if n > uint64(len(b)-8) {
		return nil, fmt.Errorf("%s: header length %d exceeds the file", path, n)
	}
	var hdr map[string]json.RawMessage
	if err := json.Unmarshal(b[8:8+n], &hdr); err != nil {
		return nil, fmt.Errorf("%s: header: %w", path, err)
	}
	body := b[8+n:]
	out := make(map[string][]byte)
	for name, raw := range hdr {
		if name == "__metadata__" {
			continue
		}
		var e struct {
			Dtype   string    `json:"dtype"`
			Offsets [2]uint64 `json:"data_offsets"`
		}
		if err := json.Unmarshal(raw, &e); err != nil {
			return nil, fmt.Errorf("%s: tensor %q: %w", path, name, err)
		}
		if e.Dtype != "BF16" {
			continue
		}
		if e.Offsets[0] > e.Offsets[1] || e.Offsets[1] > uint64(len(body)) {
			return nil, fmt.Errorf("%s: tensor %q: offsets %v outside the %d data bytes", path, name, e.Offsets, len(body))
		}
		out[name] = body[e.Offsets[0]:e.Offsets[1]]
	}
	return out, nil
}
