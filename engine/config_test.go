package engine

import (
	"math"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// TestConfigGoldenIsTiny: the golden's ModelArgs JSON loads and equals the
// "tiny" preset.
func TestConfigGoldenIsTiny(t *testing.T) {
	c, err := LoadConfig(filepath.Join(goldenTiny, "config.json"))
	if err != nil {
		t.Skipf("golden config: %v", err)
	}
	p, _ := Preset("tiny")
	if !reflect.DeepEqual(c, p) {
		t.Errorf("golden config.json\n%+v\n!= preset tiny\n%+v", *c, *p)
	}
}

func TestConfigPresets(t *testing.T) {
	f, _ := Preset("flash")
	// V4-Flash schedule (spec §2.1): layers 0, 1 SWA; 2, 4, …, 42 CSA; 3, 5, …, 41 HCA.
	if f.LayerKind(0) != "SWA" || f.LayerKind(1) != "SWA" || f.LayerKind(2) != "CSA" || f.LayerKind(3) != "HCA" ||
		f.LayerKind(41) != "HCA" || f.LayerKind(42) != "CSA" || len(f.CompressRatios) != 44 || f.CompressRatios[43] != 0 {
		t.Errorf("flash schedule wrong: %v", f.CompressRatios)
	}
	csa, hca := 0, 0
	for l := 0; l < f.NLayers; l++ {
		switch f.Ratio(l) {
		case 4:
			csa++
		case 128:
			hca++
		}
	}
	if csa != 21 || hca != 20 {
		t.Errorf("flash has %d CSA and %d HCA layers, want 21 and 20", csa, hca)
	}
	// Derived constants of spec §1 (fp32 bits).
	if b := math.Float32bits(f.SoftmaxScale()); b != 0x3D3504F3 {
		t.Errorf("softmax scale bits %#x, want 0x3D3504F3", b)
	}
	if b := math.Float32bits(f.IndexWeightScale()); b != 0x3C3504F3 {
		t.Errorf("index weight scale bits %#x, want 0x3C3504F3", b)
	}
	pro, _ := Preset("pro")
	if pro.Dim != 7168 || pro.NHeads != 128 || pro.LayerKind(0) != "HCA" || pro.LayerKind(2) != "CSA" || pro.LayerKind(60) != "CSA" || pro.IndexTopK != 1024 {
		t.Errorf("pro preset wrong: %+v", pro)
	}
	if _, err := Preset("nano"); err == nil {
		t.Error("unknown preset accepted")
	}
}

func TestConfigErrors(t *testing.T) {
	for _, c := range []struct{ json, want string }{
		{`{"dim": 256, "n_layers": 2, "compress_ratios": [0, 3]}`, "compress_ratios[1] = 3"},
		{`{"dim": 100}`, "multiple of 128"},
		{`{"n_heads": 6, "o_groups": 4}`, "not a multiple of o_groups"},
		{`{"rope_head_dim": 32}`, "64 rotated dims"},
		{`{"dim": 4096, "no_such_key": 1}`, "no_such_key"},
		{`{"n_layers": 9}`, "compress_ratios has 8 entries"},
		{`{"dtype": "fp16"}`, "dtype"},
		{`{"dim": "wide"}`, "dim"},
	} {
		_, err := ParseConfig([]byte(c.json))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ParseConfig(%s) = %v, want an error mentioning %q", c.json, err, c.want)
		}
	}
	if _, err := LoadConfig("/nonexistent/config.json"); err == nil {
		t.Error("missing file accepted")
	}
}

func TestConfigRopeParams(t *testing.T) {
	c, _ := Preset("flash")
	if p := c.RopeParams(0); p.Base != 10000 || p.OriginalSeqLen != 0 {
		t.Errorf("SWA layer RoPE %+v, want base 10000 without YaRN", p)
	}
	if p := c.RopeParams(2); p.Base != 160000 || p.OriginalSeqLen != 65536 || p.Factor != 16 {
		t.Errorf("CSA layer RoPE %+v, want base 160000 with YaRN", p)
	}
}
