package prodkernel

import (
	"encoding/binary"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"sparsemla/attribute"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/kvcache"
	"sparsemla/quant"
)

func goldenRope(t *testing.T, name string, ratio int) RopeTable {
	t.Helper()
	st, err := dump.OpenSafetensors(filepath.Join("..", "testdata", name, "rope_tables.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	key := "freqs_cis_cmp"
	if ratio == 0 {
		key = "freqs_cis_r0"
	}
	v, shape, err := st.Float32(key)
	if err != nil {
		t.Fatal(err)
	}
	return RopeTable{Pairs: shape[1], CS: v}
}

// TestWindowKEntriesBytes: every MODEL1 entry vLLM's and SGLang's writers
// stored is, byte for byte, kvcache's encoding of the row they were given under
// the reference scaling and under the engine's own modelled rule.
func TestWindowKEntriesBytes(t *testing.T) { forDumps(t, testWindowKEntriesBytes) }

func testWindowKEntriesBytes(t *testing.T, name string) {
	m, src, r := openKernelRun(t, name)
	rules := map[string]kvcache.Scaling{"vllm_k": kvcache.VLLMFP8, "sglang_k": kvcache.SGLangFP8}
	for _, wk := range windowKWriters {
		w, err := LoadWindowK(r, wk.prefix, src.Steps(), src.Layers())
		if err != nil {
			t.Fatal(err)
		}
		for name, sc := range map[string]kvcache.Scaling{"reference ceil2": kvcache.RefFP8, "engine rule": rules[wk.prefix]} {
			c, err := CheckWindowKEntries(src, w, m.Cfg.WindowSize, sc, name)
			if err != nil {
				t.Fatal(err)
			}
			if !c.Agrees() {
				t.Errorf("%v", c)
			}
			t.Logf("%v", c)
		}
	}
}

// TestInvRopeFP8Rule: vLLM's fused inverse-RoPE + FP8 quantiser reproduces its
// rule over the reference's o bit for bit (codes and scales, every layer and
// step), and differs from the reference o_inv (kept bf16) by FP8 rounding only:
// a named engine approximation, spec §9.11.
func TestInvRopeFP8Rule(t *testing.T) { forDumps(t, testInvRopeFP8Rule) }

func testInvRopeFP8Rule(t *testing.T, name string) {
	m, src, r := openKernelRun(t, name)
	cfg := m.Cfg
	for _, l := range src.Layers() {
		c, err := CheckInvRopeFP8(src, r, l, goldenRope(t, name, cfg.CompressRatios[l]), cfg.NHeads, cfg.OGroups, cfg.NopeDim())
		if err != nil {
			t.Fatal(err)
		}
		if !c.Agrees() {
			t.Errorf("L%d: %v", l, c)
		}
		if c.Dist.Max == 0 || c.Dist.Max > 1.0/16 {
			t.Errorf("L%d: FP8 error against o_inv %v, want (0, 2^-4]", l, c.Dist)
		}
		t.Logf("L%d: %v", l, c)
	}
}

// TestIndexerQRule: vLLM's fused indexer-q RoPE + FP8 quantiser reproduces its
// rule over the reference's iq_roped and iw_raw bit for bit; the reference's
// iq (FQ4 after the Hadamard rotation) is a different quantity (spec §8.3).
func TestIndexerQRule(t *testing.T) { forDumps(t, testIndexerQRule) }

func testIndexerQRule(t *testing.T, name string) {
	m, src, r := openKernelRun(t, name)
	cfg := m.Cfg
	for _, l := range src.Layers() {
		if cfg.CompressRatios[l] != 4 {
			continue
		}
		c, err := CheckIndexerQ(src, r, l, cfg.IndexNHeads, cfg.IndexHeadDim, float32(0.08838834764831845), 0.5)
		if err != nil {
			t.Fatal(err)
		}
		if !c.Agrees() {
			t.Errorf("L%d: %v", l, c)
		}
		t.Logf("L%d: %v", l, c)
	}
}

// putF32 multiplies the fp32 at index i of little-endian data by f.
func scaleF32(data []byte, i int, f float32) {
	b := binary.LittleEndian.Uint32(data[4*i:])
	binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(math.Float32frombits(b)*f))
}

// TestInvRopeFP8ScaleFault: one scale of vLLM's FP8 attention output doubled
// (a scale written for the wrong block exponent) is found exactly: that block
// of that head at that step, and nothing else.
func TestInvRopeFP8ScaleFault(t *testing.T) {
	m, src, r := openKernelRun(t, "official-v4-tiny")
	cfg := m.Cfg
	const l, tok, g, hg, b = 1, 5, 1, 0, 3 // step 7, head 2
	nb := cfg.HeadDim / 128
	hpg := cfg.NHeads / cfg.OGroups
	if err := r.Patch(fmt.Sprintf("vllm_oinv.L%d.scale", l), func(d []byte) { scaleF32(d, (tok*cfg.OGroups+g)*hpg*nb+hg*nb+b, 2) }); err != nil {
		t.Fatal(err)
	}
	c, err := CheckInvRopeFP8(src, r, l, goldenRope(t, "official-v4-tiny", cfg.CompressRatios[l]), cfg.NHeads, cfg.OGroups, cfg.NopeDim())
	if err != nil {
		t.Fatal(err)
	}
	steps := src.Steps()
	want := fmt.Sprintf("p%d L%d head %d block %d: kernel scale", steps[tok], l, g*hpg+hg, b)
	if c.Scales-c.ScalesEqual != 1 || c.Codes != c.Equal || len(c.First) != 1 || !strings.HasPrefix(c.First[0], want) {
		t.Fatalf("%v\nwant exactly one mismatch %q", c, want)
	}
	t.Logf("%v", c)
}

// TestIndexerQWeightFault: one folded weight of vLLM's FP8 indexer query left
// without its q scale (the fold forgotten for one token and head) is found
// exactly, the codes still agreeing.
func TestIndexerQWeightFault(t *testing.T) {
	m, src, r := openKernelRun(t, "official-v4-tiny")
	cfg := m.Cfg
	const l, tok, h = 3, 2, 1
	steps := src.Steps()
	x, _, _ := src.Stage(steps[tok], l, "iq_roped")
	var amax float32
	for _, v := range x.F[h*cfg.IndexHeadDim : (h+1)*cfg.IndexHeadDim] {
		amax = max(amax, float32(math.Abs(float64(v))))
	}
	s := scaleLog2Ceil(max(amax, 1e-4) / 448)
	if err := r.Patch(fmt.Sprintf("vllm_iq8.L%d.weights", l), func(d []byte) { scaleF32(d, tok*cfg.IndexNHeads+h, 1/s) }); err != nil {
		t.Fatal(err)
	}
	c, err := CheckIndexerQ(src, r, l, cfg.IndexNHeads, cfg.IndexHeadDim, float32(0.08838834764831845), 0.5)
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("p%d L%d head %d: kernel weight", steps[tok], l, h)
	if c.Scales-c.ScalesEqual != 1 || c.Codes != c.Equal || len(c.First) != 1 || !strings.HasPrefix(c.First[0], want) {
		t.Fatalf("%v\nwant exactly one mismatch %q", c, want)
	}
	t.Logf("%v", c)
}

// TestInvRopeFP8Attribute: a vLLM user who dumps the dequantised FP8 o_inv
// (codes × scales of fused_inv_rope_fp8_quant) is told by package attribute
// that the difference is vLLM's FP8 quantisation: the hypothesis
// "vllm-fp8-o_inv" reproduces the dumped tensor bit for bit at every step and
// layer, where the reference (bf16 o_inv) does not.
func TestInvRopeFP8Attribute(t *testing.T) {
	m, src, r := openKernelRun(t, "official-v4-tiny")
	cfg := m.Cfg
	hpg, D := cfg.NHeads/cfg.OGroups, cfg.HeadDim
	nb := D / 128
	n := 0
	for _, l := range src.Layers() {
		codes, _, err := r.Bytes(fmt.Sprintf("vllm_oinv.L%d.fp8", l))
		if err != nil {
			t.Fatal(err)
		}
		scales, err := r.Floats(fmt.Sprintf("vllm_oinv.L%d.scale", l))
		if err != nil {
			t.Fatal(err)
		}
		steps, err := r.Ints(fmt.Sprintf("vllm_oinv.L%d.steps", l))
		if err != nil {
			t.Fatal(err)
		}
		for tok, p := range steps {
			var def engine.StageDef
			for _, d := range engine.Stages(cfg, l, p) {
				if d.Name == "o_inv" {
					def = d
				}
			}
			o, _, err := src.Stage(p, l, "o")
			if err != nil || def.Name == "" {
				t.Fatalf("p%d L%d: o %v, def %q", p, l, err, def.Name)
			}
			ctx := &engine.StepContext{Cfg: cfg, Layer: l, Pos: p, W: m.Weights[l], Rope: m.Rope[l]}
			in := map[string]engine.Tensor{"o": o}
			ref, err := def.Compute(ctx, in)
			if err != nil {
				t.Fatal(err)
			}
			deq := make([]float32, cfg.NHeads*D)
			for h := 0; h < cfg.NHeads; h++ {
				g, hg := h/hpg, h%hpg
				for i := 0; i < D; i++ {
					c := codes[(tok*cfg.OGroups+g)*hpg*D+hg*D+i]
					deq[h*D+i] = quant.DecodeE4M3(c) * scales.F[(tok*cfg.OGroups+g)*hpg*nb+hg*nb+i/128]
				}
			}
			gpu := engine.FromF(ref.Kind, deq, ref.Shape...)
			v := attribute.Attribute(&attribute.Call{Ctx: ctx, Def: def, In: in, Ref: ref}, gpu)
			if v.Best == nil || v.Best.Name != "vllm-fp8-o_inv" || !v.Best.Exact || v.Reference.Exact {
				t.Fatalf("p%d L%d: %+v", p, l, v)
			}
			n++
		}
	}
	t.Logf("%d units: the dumped FP8 o_inv is reproduced bit for bit by vllm-fp8-o_inv", n)
}
