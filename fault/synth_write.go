package fault

import (
	"encoding/json"
	"fmt"
	"io"
	"path/filepath"
	"sort"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/replay"
	"sparsemla/userfile"
)

// Files a synthetic dump directory holds.
const (
	SynthConfigFile  = "config.json"         // ModelArgs JSON
	SynthWeightsFile = "weights.safetensors" // official state_dict names
	SynthDumpFile    = "dump.smd"            // native dump
)

// Write writes the synthetic model and its dump into dir (created if needed):
// config.json, weights.safetensors (attention-path parameters under the
// official state_dict names: FP8 codes as F8_E4M3 with U8 UE8M0 block scales,
// bf16 wo_a / weights_proj, fp32 norms, sinks and compressor parameters), and
// (a whole model, SynthOptions.Whole: also every block parameter and the
// embedding and head, engine.BlockWeightRecords / HeadWeightRecords), and
// dump.smd, a native dump holding the header (ModelArgs), the GPU RoPE tables,
// the start state of every layer, every stage of every dumped step of request
// B, and for a stale-prefix fault the prefix-hit record and request A's cache.
// For every dumped step and layer the dump also holds the kv_cache as KV
// pages (kind "page", stage "kv_cache/<page>", layout SynthPageLayout)
// encoded from the GPU's rows with the kvcache codecs (replay.RewritePage),
// as a serving engine's cache would hold them.

// SynthPageLayout and SynthPageBlock are the layout and page size of the KV
// pages Write adds: FlashMLA's MODEL1 FP8 layout, 64-entry pages (the SWA
// page size of the engines), identity block table.
const (
	SynthPageLayout = "v4-model1"
	SynthPageBlock  = 64
)

func (s *Synth) Write(dir string) error {
	// Into a temporary directory beside dir, renamed into place when every
	// file is complete (userfile): an existing dir must be empty or an
	// earlier output, and an error leaves nothing behind.
	od, err := (&userfile.Guard{}).CreateDir(dir)
	if err != nil {
		return fmt.Errorf("synth: %w", err)
	}
	defer od.Abort()
	cfgJSON, err := json.MarshalIndent(s.Cfg, "", "  ")
	if err != nil {
		return fmt.Errorf("synth: %w", err)
	}
	if err := od.WriteFile(SynthConfigFile, 0o644, func(w io.Writer) error { _, err := w.Write(cfgJSON); return err }); err != nil {
		return fmt.Errorf("synth: %w", err)
	}
	if err := od.WriteFile(SynthWeightsFile, 0o644, func(w io.Writer) error {
		return s.writeWeights(w, filepath.Join(dir, SynthWeightsFile))
	}); err != nil {
		return err
	}
	if err := od.WriteFile(SynthDumpFile, 0o644, func(w io.Writer) error {
		return s.writeDump(w, filepath.Join(dir, SynthDumpFile), string(cfgJSON))
	}); err != nil {
		return err
	}
	if err := od.Commit(); err != nil {
		return fmt.Errorf("synth: %w", err)
	}
	return nil
}

func (s *Synth) writeWeights(f io.Writer, path string) error {
	var recs []dump.Record
	for l := 0; l < s.Cfg.NLayers; l++ {
		recs = append(recs, engine.LayerWeightRecords(s.Cfg, s.Weights[l])...)
		if b := s.Weights[l].Block; b != nil {
			br, err := engine.BlockWeightRecords(s.Cfg, l, b)
			if err != nil {
				return fmt.Errorf("synth: %s: %w", path, err)
			}
			recs = append(recs, br...)
		}
	}
	if s.Head != nil {
		hr, err := engine.HeadWeightRecords(s.Cfg, s.Head)
		if err != nil {
			return fmt.Errorf("synth: %s: %w", path, err)
		}
		recs = append(recs, hr...)
	}
	meta := map[string]string{"producer": "sparsemla synth", "seed": fmt.Sprint(s.Seed)}
	if err := dump.WriteSafetensors(f, recs, meta); err != nil {
		return fmt.Errorf("synth: %s: %w", path, err)
	}
	return nil
}

func (s *Synth) writeDump(out io.Writer, path, modelArgs string) error {
	h := dump.Header{
		ModelArgs:      modelArgs,
		CompressRatios: append([]int{}, s.Cfg.CompressRatios...),
		DTypePolicy:    map[string]string{"activations": "bf16", "linear": "fp8-e4m3", "kv_cache": "bf16 (FQ8 values)"},
		Producer:       map[string]string{"engine": "sparsemla synth", "seed": fmt.Sprint(s.Seed)},
	}
	if s.Fault != nil {
		h.User = map[string]string{"injected_fault": s.Fault.String()}
	}
	w, err := dump.NewWriter(out, h)
	if err != nil {
		return fmt.Errorf("synth: %s: %w", path, err)
	}
	fail := func(err error) error {
		w.Close()
		return fmt.Errorf("synth: %s: %w", path, err)
	}
	// GPU RoPE tables, [T, 32, 2] = (cos, sin).
	tables := map[string]*engine.RopeTable{}
	for l := 0; l < s.Cfg.NLayers; l++ {
		name := "freqs_cis_r0"
		if s.Cfg.Ratio(l) > 0 {
			name = "freqs_cis_cmp"
		}
		tables[name] = s.Rope[l]
	}
	for _, name := range []string{"freqs_cis_r0", "freqs_cis_cmp"} {
		tb, ok := tables[name]
		if !ok {
			continue
		}
		cis := make([]float32, 2*len(tb.Cos))
		for k := range tb.Cos {
			cis[2*k], cis[2*k+1] = tb.Cos[k], tb.Sin[k]
		}
		rec := engine.TensorRecord(engine.FromF(engine.KindF32, cis, tb.T, attention.RopePairs, 2),
			dump.Key{Step: dump.NoStep, Layer: dump.Global, Stage: name}, dump.KindTable)
		if err := w.Write(&rec); err != nil {
			return fail(err)
		}
	}
	layers := s.Src.Layers()
	for _, l := range layers {
		st := s.Src.Start[l]
		for _, name := range sortedKeys(st) {
			rec := engine.TensorRecord(st[name], dump.Key{Request: SynthRequest, Step: int(s.Src.StartAfter), Layer: l, Stage: name}, dump.KindState)
			if err := w.Write(&rec); err != nil {
				return fail(err)
			}
		}
	}
	keys := make([]replay.StageKey, 0, len(s.Src.Values))
	for k := range s.Src.Values {
		keys = append(keys, k)
	}
	sortStageKeys(keys)
	for _, k := range keys {
		rec := engine.TensorRecord(s.Src.Values[k], dump.Key{Request: SynthRequest, Step: int(k.Step), Layer: k.Layer, Stage: k.Stage}, dump.KindStage)
		if err := w.Write(&rec); err != nil {
			return fail(err)
		}
	}
	{
		for _, k := range keys {
			if k.Stage != "kv_cache" {
				continue
			}
			recs, err := s.pageRecords(k, s.Src.Values[k])
			if err != nil {
				return fail(err)
			}
			for i := range recs {
				if err := w.Write(&recs[i]); err != nil {
					return fail(err)
				}
			}
		}
	}
	for req, vals := range s.Src.Others {
		keys := keys[:0]
		for k := range vals {
			keys = append(keys, k)
		}
		sortStageKeys(keys)
		for _, k := range keys {
			rec := engine.TensorRecord(vals[k], dump.Key{Request: req, Step: int(k.Step), Layer: k.Layer, Stage: k.Stage}, dump.KindStage)
			if err := w.Write(&rec); err != nil {
				return fail(err)
			}
		}
	}
	if s.Src.Hit != nil {
		if err := w.WritePrefix(dump.PrefixHit{Request: SynthRequest, Source: s.Src.Hit.From, Tokens: int(s.Src.Hit.Tokens)}); err != nil {
			return fail(err)
		}
	}
	if err := w.Close(); err != nil {
		return fmt.Errorf("synth: %s: %w", path, err)
	}
	return nil
}

func sortedKeys(m map[string]engine.Tensor) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func sortStageKeys(k []replay.StageKey) {
	sort.Slice(k, func(i, j int) bool {
		if k[i].Step != k[j].Step {
			return k[i].Step < k[j].Step
		}
		if k[i].Layer != k[j].Layer {
			return k[i].Layer < k[j].Layer
		}
		return k[i].Stage < k[j].Stage
	})
}

// pageRecords encodes one kv_cache [rows, D] into PageBlock-entry pages
// (SynthPageBlock when 0).
func (s *Synth) pageRecords(k replay.StageKey, kc engine.Tensor) ([]dump.Record, error) {
	D, B := kc.Shape[1], SynthPageBlock
	if s.PageBlock > 0 {
		B = s.PageBlock
	}
	nb := (kc.Shape[0] + B - 1) / B
	table := make([]int, nb)
	for b := range table {
		table[b] = b
	}
	live := map[int]bool{}
	for _, i := range replay.LivePageRows(s.Cfg, k.Step, kc.Shape[0]) {
		live[i] = true
	}
	var out []dump.Record
	for b := 0; b < nb; b++ {
		rows := map[int][]float32{}
		for e := 0; e < B && b*B+e < kc.Shape[0]; e++ {
			if i := b*B + e; live[i] {
				rows[e] = kc.F[i*D : (i+1)*D]
			}
		}
		data, err := replay.RewritePage(SynthPageLayout, D, B, nil, rows)
		if err != nil {
			return nil, err
		}
		out = append(out, dump.Record{
			Key:  dump.Key{Request: SynthRequest, Step: int(k.Step), Layer: k.Layer, Stage: fmt.Sprintf("kv_cache/%d", b)},
			Kind: dump.KindPage, DType: dump.U8, Shape: []int{len(data)}, Data: data,
			Page: &dump.PageInfo{Layout: SynthPageLayout, PageID: b, BlockSize: B, BlockTable: table},
		})
	}
	return out, nil
}
