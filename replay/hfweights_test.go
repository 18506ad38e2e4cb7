package replay_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/replay"
)

// hfAttn: official attention weight names -> transformers' DeepseekV4 module
// names (the state_dict spelling), as in testdata/hf-v4-tiny/state_dict_names.json.
var hfAttn = []struct{ off, hf string }{
	{"attn.indexer.compressor.wkv.", "self_attn.compressor.indexer.kv_proj."},
	{"attn.indexer.compressor.wgate.", "self_attn.compressor.indexer.gate_proj."},
	{"attn.indexer.compressor.norm.", "self_attn.compressor.indexer.kv_norm."},
	{"attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"},
	{"attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."},
	{"attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."},
	{"attn.compressor.wkv.", "self_attn.compressor.kv_proj."},
	{"attn.compressor.wgate.", "self_attn.compressor.gate_proj."},
	{"attn.compressor.norm.", "self_attn.compressor.kv_norm."},
	{"attn.compressor.ape", "self_attn.compressor.position_bias"},
	{"attn.wq_a.", "self_attn.q_a_proj."},
	{"attn.q_norm.", "self_attn.q_a_norm."},
	{"attn.wq_b.", "self_attn.q_b_proj."},
	{"attn.wkv.", "self_attn.kv_proj."},
	{"attn.kv_norm.", "self_attn.kv_norm."},
	{"attn.wo_a.", "self_attn.o_a_proj."},
	{"attn.wo_b.", "self_attn.o_b_proj."},
	{"attn.attn_sink", "self_attn.sinks"},
	{"attn_norm.", "input_layernorm."},
}

func hfName(off string) string {
	if !strings.HasPrefix(off, "layers.") {
		return off // embed, head, hc_head_*, norm: looked up by their official names
	}
	rest := strings.TrimPrefix(off, "layers.")
	i := strings.IndexByte(rest, '.')
	layer, tail := rest[:i], rest[i+1:]
	for _, m := range hfAttn {
		if strings.HasPrefix(tail, m.off) {
			tail = m.hf + strings.TrimPrefix(tail, m.off)
			break
		}
	}
	tail = strings.Replace(tail, ".scale", ".weight_scale_inv", 1)
	return "model.layers." + layer + "." + tail
}

// The official-v4-tiny weights rewritten as a Hugging Face checkpoint
// (index.json + 2 shards, module names, FP8 block scales as fp32
// weight_scale_inv) replay the official GPU dump exactly as the official
// weights.safetensors does.
func TestReplayWithHFCheckpoint(t *testing.T) {
	st, err := dump.OpenSafetensors("../testdata/official-v4-tiny/weights.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	dir := t.TempDir()
	names := st.Names()
	sort.Strings(names)
	shards := [2]map[string]dump.Record{{}, {}}
	index := map[string]string{}
	for i, n := range names {
		r, err := st.Read(n)
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasSuffix(n, ".scale") {
			// UE8M0 bytes -> fp32 scale_inv values
			b := make([]byte, 4*len(r.Data))
			for j, e := range r.Data { // UE8M0 byte e = 2^(e-127)
				binary.LittleEndian.PutUint32(b[4*j:], math.Float32bits(float32(math.Ldexp(1, int(e)-127))))
			}
			r = dump.Record{DType: dump.F32, Shape: r.Shape, Data: b}
		}
		hn := hfName(n)
		shards[i%2][hn] = r
		index[hn] = fmt.Sprintf("model-%05d-of-00002.safetensors", i%2+1)
	}
	for i, sh := range shards {
		writeST(t, filepath.Join(dir, fmt.Sprintf("model-%05d-of-00002.safetensors", i+1)), sh)
	}
	ib, _ := json.Marshal(map[string]interface{}{"metadata": map[string]int{}, "weight_map": index})
	os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), ib, 0o644)

	run := func(weights string) *replay.Report {
		d, err := dump.Open("../testdata/official-v4-tiny")
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		src, err := replay.NewDumpSource(d, "")
		if err != nil {
			t.Fatal(err)
		}
		m, err := replay.LoadModel(d, src, weights)
		if err != nil {
			t.Fatal(err)
		}
		rep, err := replay.Run(context.Background(), m, src, replay.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return rep
	}
	official, hf := run(""), run(dir)
	if hf.Verdict != "agree" || hf.Summary != official.Summary {
		t.Fatalf("HF checkpoint: %s %+v, official weights: %s %+v", hf.Verdict, hf.Summary, official.Verdict, official.Summary)
	}
	// a scale that is not a power of two is refused with its name
	bad := shards[0]
	for n, r := range bad {
		if strings.HasSuffix(n, "weight_scale_inv") {
			binary.LittleEndian.PutUint32(r.Data, math.Float32bits(0.3))
			break
		}
	}
	writeST(t, filepath.Join(dir, "model-00001-of-00002.safetensors"), bad)
	d, _ := dump.Open("../testdata/official-v4-tiny")
	defer d.Close()
	src, _ := replay.NewDumpSource(d, "")
	if _, err := replay.LoadModel(d, src, dir); err == nil || !strings.Contains(err.Error(), "not a power of two") {
		t.Errorf("non-power-of-two scale: %v", err)
	}
}

var stNames = map[dump.DType]string{dump.F32: "F32", dump.BF16: "BF16", dump.E4M3: "F8_E4M3", dump.U8: "U8", dump.I32: "I32", dump.I64: "I64", dump.E8M0: "F8_E8M0"}

func writeST(t *testing.T, path string, recs map[string]dump.Record) {
	t.Helper()
	hdr := map[string]interface{}{}
	var data []byte
	ns := make([]string, 0, len(recs))
	for n := range recs {
		ns = append(ns, n)
	}
	sort.Strings(ns)
	for _, n := range ns {
		r := recs[n]
		dt, ok := stNames[r.DType]
		if !ok {
			t.Fatalf("%s: dtype %s", n, r.DType)
		}
		hdr[n] = map[string]interface{}{"dtype": dt, "shape": r.Shape, "data_offsets": []int{len(data), len(data) + len(r.Data)}}
		data = append(data, r.Data...)
	}
	h, _ := json.Marshal(hdr)
	out := make([]byte, 8, 8+len(h)+len(data))
	binary.LittleEndian.PutUint64(out, uint64(len(h)))
	out = append(append(out, h...), data...)
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}
