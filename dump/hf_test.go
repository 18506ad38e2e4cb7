package dump_test

import (
	"encoding/json"
	"fmt"
	"os"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
)

// The config.json transformers 5.17 wrote for the tiny DeepseekV4ForCausalLM
// (testdata/hf-v4-tiny) converts to ModelArgs the engine accepts, with the
// same architecture as official-v4-tiny's config.json (made with the same
// shapes; only the MoE width and the number formats differ).
func TestModelArgsFromHF(t *testing.T) {
	hf, err := os.ReadFile("../testdata/hf-v4-tiny/config.json")
	if err != nil {
		t.Fatal(err)
	}
	if !dump.IsHFConfig(hf) {
		t.Fatal("not recognised as an HF DeepSeek-V4 config")
	}
	// The engine converts it itself: a bf16 checkpoint (engine.Config.BF16Checkpoint).
	if c, err := engine.ParseConfig(hf); err != nil || !c.BF16Checkpoint() {
		t.Fatalf("engine.ParseConfig(HF config.json): %v", err)
	}
	ma, err := dump.ModelArgsFromHF(hf)
	if err != nil {
		t.Fatal(err)
	}
	var got, want map[string]interface{}
	json.Unmarshal(ma, &got)
	// The same config with the FP8 checkpoint's number formats: every other
	// field must be accepted as converted.
	fp8 := map[string]interface{}{}
	for k, v := range got {
		fp8[k] = v
	}
	fp8["dtype"], fp8["scale_fmt"], fp8["expert_dtype"], fp8["scale_dtype"] = "fp8", "ue8m0", "fp4", "fp8"
	fb, _ := json.Marshal(fp8)
	if _, err := engine.ParseConfig(fb); err != nil {
		t.Fatalf("converted ModelArgs refused: %v\n%s", err, fb)
	}
	ob, _ := os.ReadFile("../testdata/official-v4-tiny/config.json")
	json.Unmarshal(ob, &want)
	differ := map[string]bool{"moe_inter_dim": true, "dtype": true, "scale_fmt": true, "expert_dtype": true, "scale_dtype": true}
	for k, w := range want {
		if differ[k] {
			continue
		}
		g, ok := got[k]
		if !ok {
			t.Errorf("%s missing", k)
			continue
		}
		gb, _ := json.Marshal(g)
		wb, _ := json.Marshal(w)
		if string(gb) != string(wb) {
			t.Errorf("%s = %s, official-v4-tiny has %s", k, gb, wb)
		}
	}
	if got["dtype"] != "bf16" || got["moe_inter_dim"] != 64.0 {
		t.Errorf("dtype %v moe_inter_dim %v", got["dtype"], got["moe_inter_dim"])
	}
}

// Both HF spellings (in-memory state_dict names, save_pretrained names)
// resolve to the official names of model.py (official-v4-tiny's weights).
func TestHFNamesToOfficial(t *testing.T) {
	var sd map[string]interface{}
	b, _ := os.ReadFile("../testdata/hf-v4-tiny/state_dict_names.json")
	if err := json.Unmarshal(b, &sd); err != nil {
		t.Fatal(err)
	}
	var idx struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	b, _ = os.ReadFile("../testdata/hf-v4-tiny/model.safetensors.index.json")
	if err := json.Unmarshal(b, &idx); err != nil {
		t.Fatal(err)
	}
	st, err := dump.OpenSafetensors("../testdata/official-v4-tiny/weights.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	official := map[string]bool{}
	for _, n := range st.Names() {
		official[n] = true
	}
	saved := map[string]bool{}
	for n := range idx.WeightMap {
		saved[dump.OfficialName(n)] = true
	}
	// every official weight (the golden holds every parameter) must be
	// reachable from both HF spellings (the in-memory model packs each
	// layer's routed experts into two tensors)
	mem := map[string]bool{}
	for n := range sd {
		mem[dump.OfficialName(n)] = true
	}
	for n := range official {
		if len(n) > 6 && (n[len(n)-6:] == ".scale") {
			continue // FP8 scales: the bf16 HF checkpoint has none
		}
		if !saved[n] {
			t.Errorf("save_pretrained names: no tensor maps to %s", n)
		}
		if !mem[n] && !packedExpert(n, mem) {
			t.Errorf("state_dict names: no tensor maps to %s", n)
		}
	}
	for n := range mem {
		if !saved[n] && !isPacked(n) {
			t.Errorf("state_dict name maps to %s, which save_pretrained does not write", n)
		}
	}
}

// packedExpert reports whether n is a routed expert's weight
// (layers.L.ffn.experts.E.w1|w2|w3.weight) that the in-memory HF model holds
// in its layer's packed tensor (w1, w3 in hf_packed_gate_up_proj, w2 in
// hf_packed_down_proj).
func packedExpert(n string, mem map[string]bool) bool {
	var l, e, w int
	if _, err := fmt.Sscanf(n, "layers.%d.ffn.experts.%d.w%d.weight", &l, &e, &w); err != nil {
		return false
	}
	packed := "hf_packed_gate_up_proj"
	if w == 2 {
		packed = "hf_packed_down_proj"
	}
	return mem[fmt.Sprintf("layers.%d.ffn.experts.%s", l, packed)]
}

func isPacked(n string) bool {
	for _, s := range []string{"hf_packed_gate_up_proj", "hf_packed_down_proj"} {
		if len(n) >= len(s) && n[len(n)-len(s):] == s {
			return true
		}
	}
	return false
}

// A dump directory with an HF config.json beside its tensors gets the
// converted ModelArgs as its header's model args.
func TestDumpDirWithHFConfig(t *testing.T) {
	dir := t.TempDir()
	for src, dst := range map[string]string{"../testdata/hf-v4-tiny/config.json": "config.json", "../testdata/official-v4-tiny/step_3.safetensors": "step_3.safetensors"} {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(dir+"/"+dst, b, 0o644)
	}
	d, err := dump.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Map.Name != "official-v4-window" || d.Header.User["hf_config"] == "" || len(d.Header.CompressRatios) != 4 {
		t.Fatalf("map %s ratios %v", d.Map.Name, d.Header.CompressRatios)
	}
	var ma map[string]interface{}
	if err := json.Unmarshal([]byte(d.Header.ModelArgs), &ma); err != nil || ma["dim"] != 256.0 {
		t.Fatalf("model args %s (%v)", d.Header.ModelArgs, err)
	}
}

// The built-in map hf-deepseek-v4 names the module outputs a user's own forward
// hooks on transformers' DeepseekV4ForCausalLM write (module names as keys,
// one file per step, [batch=1, seq=1, ...] shapes).
func TestHFModuleNameMap(t *testing.T) {
	dir := t.TempDir()
	m, err := dump.LoadNameMap("hf-deepseek-v4")
	if err != nil {
		t.Fatal(err)
	}
	// safetensors written by hand: two module outputs with leading 1-dims
	writeSafetensors(t, dir+"/step_9.safetensors", map[string][]int{
		"model.layers.2.self_attn.compressor.indexer.q_b_proj": {1, 1, 512},
		"model.layers.2.self_attn.o_a_proj.input":              {1, 1, 2, 1024},
		"model.layers.0.self_attn.rotary_emb":                  {1, 1, 32},
	})
	d, err := dump.OpenMapped(dir, m)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	e, ok := d.Lookup(dump.Key{Step: 9, Layer: 2, Stage: "iq_b"}, dump.KindStage)
	if !ok || len(e.Shape) != 1 || e.Shape[0] != 512 {
		t.Fatalf("iq_b: %v %v", ok, e)
	}
	if e, ok := d.Lookup(dump.Key{Step: 9, Layer: 2, Stage: "o_inv"}, dump.KindStage); !ok || len(e.Shape) != 2 {
		t.Fatalf("o_inv: %v %v", ok, e)
	}
	if len(d.Unmapped) != 1 {
		t.Errorf("unmapped %v", d.Unmapped)
	}
}

func writeSafetensors(t *testing.T, path string, shapes map[string][]int) {
	t.Helper()
	hdr := map[string]interface{}{}
	off := 0
	for n, s := range shapes {
		k := 2
		for _, d := range s {
			k *= d
		}
		hdr[n] = map[string]interface{}{"dtype": "BF16", "shape": s, "data_offsets": []int{off, off + k}}
		off += k
	}
	h, _ := json.Marshal(hdr)
	b := make([]byte, 8, 8+len(h)+off)
	for i := 0; i < 8; i++ {
		b[i] = byte(uint64(len(h)) >> (8 * i))
	}
	b = append(b, h...)
	b = append(b, make([]byte, off)...)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}
