package replay

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"sort"
	"strings"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/userfile"
)

// v41RunSteps is the decode steps of a run to write (steps' keys),
// ascending; they must start at the start state's position.
func v41RunSteps(what string, steps map[int64][]map[string]engine.Tensor, pre *engine.V41State) ([]int64, error) {
	ps := slices.Sorted(maps.Keys(steps))
	if len(ps) == 0 || pre.Next != ps[0] {
		return nil, fmt.Errorf("%s: steps %v do not start at the state's position %d", what, ps, pre.Next)
	}
	return ps, nil
}

// WriteV41Dir writes a V4.1 dump directory in the layout LoadV41Dir reads:
// config.json, weights.safetensors, rope.safetensors, prefill_state.safetensors
// (the state pre before the first step), step_P.safetensors (every stage of
// steps[P] under L<l>.<stage>; a key "global:<name>" in any layer's map is
// written as <name>: the token, the head's stages) and meta.json (prefill = the first step,
// index_k_at). dir must be new, empty or an earlier output; it is written
// through a temporary directory and renamed when complete.
func WriteV41Dir(dir string, m *engine.V41Model, pre *engine.V41State, steps map[int64][]map[string]engine.Tensor, indexKAt map[int64]int, producer map[string]string) error {
	cfg := m.Cfg
	od, err := (&userfile.Guard{}).CreateDir(dir)
	if err != nil {
		return err
	}
	defer od.Abort()
	ps, err := v41RunSteps("WriteV41Dir", steps, pre)
	if err != nil {
		return err
	}
	writeJSON := func(name string, v any) error {
		b, err := json.MarshalIndent(v, "", "  ")
		if err != nil {
			return err
		}
		return od.WriteFile(name, 0o644, func(w io.Writer) error { _, err := w.Write(b); return err })
	}
	writeST := func(name string, t map[string]engine.Tensor, raw []dump.Record) error {
		recs := append([]dump.Record(nil), raw...)
		for n, x := range t {
			r := engine.TensorRecord(x, dump.Key{Step: dump.NoStep, Layer: dump.Global, Stage: n}, dump.KindStage)
			r.Name = n
			recs = append(recs, r)
		}
		sort.Slice(recs, func(i, j int) bool { return recs[i].Name < recs[j].Name })
		return od.WriteFile(name, 0o644, func(w io.Writer) error { return dump.WriteSafetensors(w, recs, producer) })
	}
	if err := writeJSON("config.json", cfg); err != nil {
		return err
	}
	if err := writeST("weights.safetensors", nil, v41WeightRecords(m)); err != nil {
		return err
	}
	rope := map[string]engine.Tensor{}
	for l, tb := range m.Rope {
		name := "freqs_cis_r0"
		if cfg.Ratio(l) > 0 {
			name = "freqs_cis_cmp"
		}
		cis := make([]float32, 2*len(tb.Cos))
		for k := range tb.Cos {
			cis[2*k], cis[2*k+1] = tb.Cos[k], tb.Sin[k]
		}
		rope[name] = engine.FromF(engine.KindF32, cis, tb.T, len(tb.Cos)/tb.T, 2)
	}
	if err := writeST("rope.safetensors", rope, nil); err != nil {
		return err
	}
	st := map[string]engine.Tensor{}
	for l, ls := range pre.Layers {
		for n, t := range ls.StateTensors(cfg) {
			st[fmt.Sprintf("L%d.%s", l, n)] = t
		}
	}
	if err := writeST("prefill_state.safetensors", st, nil); err != nil {
		return err
	}
	for _, p := range ps {
		t := map[string]engine.Tensor{}
		for l, stages := range steps[p] {
			for n, x := range stages {
				if g, ok := strings.CutPrefix(n, engine.GlobalPrefix); ok {
					t[g] = x // a stage of no layer (tok, logits, …)
					continue
				}
				t[fmt.Sprintf("L%d.%s", l, n)] = x
			}
		}
		if err := writeST(fmt.Sprintf("step_%d.safetensors", p), t, nil); err != nil {
			return err
		}
	}
	meta := map[string]any{"prefill": ps[0], "index_k_at": map[string]int{}, "producer": producer}
	for p, l := range indexKAt {
		meta["index_k_at"].(map[string]int)[fmt.Sprint(p)] = l
	}
	if err := writeJSON("meta.json", meta); err != nil {
		return err
	}
	return od.Commit()
}

// v41WeightRecords are the attention weights of m under the official names
// (layers.L.attn.*), sorted by name: FP8 as U8 codes and U8 UE8M0 scales,
// bf16 norms / wo_a / weights_proj / r = 1 compressor, fp32 sinks and r = 2
// compressor.
func v41WeightRecords(m *engine.V41Model) []dump.Record {
	cfg := m.Cfg
	wt := map[string]engine.Tensor{}
	var raw []dump.Record
	u8 := func(name string, data []uint8, shape ...int) {
		raw = append(raw, dump.Record{Key: dump.Key{Step: dump.NoStep, Layer: dump.Global, Stage: name}, Kind: dump.KindStage,
			Name: name, DType: dump.U8, Shape: shape, Data: append([]uint8(nil), data...)})
	}
	fp8 := func(name string, fw *attention.V41FP8Weight) {
		u8(name+".weight", fw.Codes, fw.Rows, fw.Cols)
		u8(name+".scale", fw.Scale, (fw.Rows+31)/32, (fw.Cols+31)/32)
	}
	bf := func(name string, v []float32, shape ...int) { wt[name] = engine.FromF(engine.KindBF16, v, shape...) }
	f32 := func(name string, v []float32, shape ...int) { wt[name] = engine.FromF(engine.KindF32, v, shape...) }
	for l, w := range m.Layers {
		p := fmt.Sprintf("layers.%d.attn.", l)
		for name, fw := range map[string]*attention.V41FP8Weight{"wq_a": w.WqA, "wq_b": w.WqB, "wkv": w.Wkv, "wo_b": w.WoB} {
			fp8(p+name, fw)
		}
		H, D, G, R := cfg.NHeads, cfg.HeadDim, cfg.OGroups, cfg.OLoraRank
		bf(p+"q_norm.weight", w.QNorm, cfg.QLoraRank)
		bf(p+"kv_norm.weight", w.KVNorm, D)
		bf(p+"wo_a.weight", w.WoA, G*R, H*D/G)
		f32(p+"attn_sink", w.AttnSink, H)
		if c := w.Compressor; c != nil {
			bf(p+"compressor.norm.weight", c.Norm, D)
			if c.Ratio == 1 {
				bf(p+"compressor.wkv.weight", c.Wkv, D, cfg.Dim)
			} else {
				f32(p+"compressor.wkv.weight", c.Wkv, D, cfg.Dim)
				f32(p+"compressor.wgate.weight", c.Wgate, D, cfg.Dim)
			}
		}
		if ix := w.Indexer; ix != nil {
			fp8(p+"indexer.wq_b", ix.WqB)
			bf(p+"indexer.weights_proj.weight", ix.WeightsProj, ix.NHeads, cfg.Dim)
			if ix.OwnsK {
				bf(p+"indexer.wk.weight", ix.Wk, ix.HeadDim, D)
				bf(p+"indexer.k_norm.weight", ix.KNorm, ix.HeadDim)
			}
		}
	}
	if m.Whole() {
		v41BlockRecords(m, bf, f32, u8)
	}
	for n, x := range wt {
		r := engine.TensorRecord(x, dump.Key{Step: dump.NoStep, Layer: dump.Global, Stage: n}, dump.KindStage)
		r.Name = n
		raw = append(raw, r)
	}
	sort.Slice(raw, func(i, j int) bool { return raw[i].Name < raw[j].Name })
	return raw
}
