package replay

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/kvcache"
	"sparsemla/userfile"
)

// V41NativeOptions configure WriteV41Native.
type V41NativeOptions struct {
	Request  string            // request id of every record ("": the only request)
	Producer map[string]string // header producer
	User     map[string]string // header user metadata
	// PageBlock > 0 adds the caches of every step as KV pages (window,
	// ckv, icache in the V4.1 row layouts, PageBlock entries a page,
	// identity block table) encoded from the dumped rows.
	PageBlock int
	// PagesOnly leaves the cache tensors (window, kv_cache, ckv, icache)
	// of every step out when PageBlock > 0: the pages are the caches, as a
	// serving engine holds them.
	PagesOnly bool
}

// WriteV41Native writes a V4.1 run as a native dump directory LoadV41Dump
// reads: config.json, weights.safetensors (v41WeightRecords) and dump.smd
// (header with the model args; the GPU RoPE tables; the start state pre of
// every layer and the index_k_at state record, valid after the first step
// − 1; every stage of every step, with the index_k_at record of each step;
// the KV pages when asked). dir must be new, empty or an earlier output; it
// is written through a temporary directory and renamed when complete.
func WriteV41Native(dir string, m *engine.V41Model, pre *engine.V41State, steps map[int64][]map[string]engine.Tensor, indexKAt map[int64]int, opt V41NativeOptions) error {
	cfg := m.Cfg
	od, err := (&userfile.Guard{}).CreateDir(dir)
	if err != nil {
		return err
	}
	defer od.Abort()
	ps, err := v41RunSteps("WriteV41Native", steps, pre)
	if err != nil {
		return err
	}
	cfgJSON, err := json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		return err
	}
	if err := od.WriteFile("config.json", 0o644, func(w io.Writer) error { _, err := w.Write(cfgJSON); return err }); err != nil {
		return err
	}
	if err := od.WriteFile(dump.WeightsFile, 0o644, func(w io.Writer) error {
		return dump.WriteSafetensors(w, v41WeightRecords(m), opt.Producer)
	}); err != nil {
		return err
	}
	h := dump.Header{ModelArgs: string(cfgJSON), CompressRatios: append([]int{}, cfg.CompressRatios...),
		DTypePolicy: map[string]string{"activations": "bf16", "linear": "fp8-e4m3 (32x32 blocks)", "kv_cache": "bf16 (FQ8 / FQ4 values)", "policy": engine.PolicyOfficial},
		Producer:    opt.Producer, User: opt.User}
	if opt.PageBlock > 0 {
		h.DTypePolicy["kv_cache"] = "v41-window-fp8, v41-kv-fp4, v41-index-fp4 pages"
	}
	err = od.WriteFile("dump.smd", 0o644, func(out io.Writer) error {
		w, err := dump.NewWriter(out, h)
		if err != nil {
			return err
		}
		put := func(t engine.Tensor, k dump.Key, kind dump.Kind) error {
			rec := engine.TensorRecord(t, k, kind)
			if err := w.Write(&rec); err != nil {
				w.Close()
				return err
			}
			return nil
		}
		tables := map[string]*engine.RopeTable{}
		for l, tb := range m.Rope {
			tables[v41RopeName(cfg, l)] = tb
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
			if err := put(engine.FromF(engine.KindF32, cis, tb.T, attention.RopePairs, 2), dump.Key{Step: dump.NoStep, Layer: dump.Global, Stage: name}, dump.KindTable); err != nil {
				return err
			}
		}
		after := int(ps[0] - 1)
		for l, ls := range pre.Layers {
			st := ls.StateTensors(cfg)
			for _, n := range sortedNames(st) {
				if err := put(st[n], dump.Key{Request: opt.Request, Step: after, Layer: l, Stage: n}, dump.KindState); err != nil {
					return err
				}
			}
		}
		if err := put(engine.FromI(engine.KindI32, []int64{int64(indexKAt[ps[0]])}, 1), dump.Key{Request: opt.Request, Step: after, Layer: dump.Global, Stage: "index_k_at"}, dump.KindState); err != nil {
			return err
		}
		for _, p := range ps {
			if err := put(engine.FromI(engine.KindI32, []int64{int64(indexKAt[p])}, 1), dump.Key{Request: opt.Request, Step: int(p), Layer: dump.Global, Stage: "index_k_at"}, dump.KindStage); err != nil {
				return err
			}
			for l, stages := range steps[p] {
				for _, n := range sortedNames(stages) {
					if opt.PageBlock > 0 && opt.PagesOnly && (n == "window" || n == "kv_cache" || n == "ckv" || n == "icache") {
						continue
					}
					k := dump.Key{Request: opt.Request, Step: int(p), Layer: l, Stage: n}
					if g, ok := strings.CutPrefix(n, engine.GlobalPrefix); ok {
						k.Layer, k.Stage = dump.Global, g // a stage of no layer (tok, logits, …)
					}
					if err := put(stages[n], k, dump.KindStage); err != nil {
						return err
					}
				}
				if opt.PageBlock <= 0 {
					continue
				}
				recs, err := v41PageRecords(cfg, p, l, stages, opt.Request, opt.PageBlock)
				if err != nil {
					w.Close()
					return err
				}
				for i := range recs {
					if err := w.Write(&recs[i]); err != nil {
						w.Close()
						return err
					}
				}
			}
		}
		return w.Close()
	})
	if err != nil {
		return err
	}
	return od.Commit()
}

// v41PageRecords encodes the caches of layer l after step p (window, ckv,
// icache of stages; window and ckv from kv_cache when they are not there) into
// page records of B entries (identity block table; rows no page entry
// holds are zero bytes).
func v41PageRecords(cfg *engine.Config, p int64, l int, stages map[string]engine.Tensor, request string, B int) ([]dump.Record, error) {
	var out []dump.Record
	for _, cache := range v41PageCaches {
		n, ok := v41CacheRows(cfg, l, cache, p)
		if !ok {
			continue
		}
		t, has := stages[cache]
		if kv, ok := stages["kv_cache"]; ok && !has && cache != "icache" && kv.Kind.IsFloat() {
			// window ‖ compressed rows: kv_cache[:W] is the window, and at a
			// KV source kv_cache[W:] its compressed rows
			WD := cfg.WindowSize * cfg.HeadDim
			switch {
			case cache == "window" && len(kv.F) >= WD:
				t, has = engine.FromF(kv.Kind, kv.F[:WD], cfg.WindowSize, cfg.HeadDim), true
			case cache == "ckv" && len(kv.F) == WD+n*cfg.HeadDim:
				t, has = engine.FromF(kv.Kind, kv.F[WD:], n, cfg.HeadDim), true
			}
		}
		if !has || n == 0 {
			continue
		}
		row, _ := kvcache.ParseV41Row(V41PageLayouts[cache])
		dims, rb := row.Dims(), row.RowBytes()
		if len(t.F) != n*dims {
			return nil, fmt.Errorf("layer %d step %d: %s holds %d values, want %d rows of %d", l, p, cache, len(t.F), n, dims)
		}
		nb := (n + B - 1) / B
		table := make([]int, nb)
		for b := range table {
			table[b] = b
		}
		live := v41LiveRows(cache, n, p)
		isLive := make([]bool, n)
		for _, i := range live {
			isLive[i] = true
		}
		for b := 0; b < nb; b++ {
			data := make([]byte, B*rb)
			for e := 0; e < B && b*B+e < n; e++ {
				if i := b*B + e; isLive[i] {
					row.EncodeRow(data[e*rb:(e+1)*rb], t.F[i*dims:(i+1)*dims])
				}
			}
			out = append(out, dump.Record{
				Key:  dump.Key{Request: request, Step: int(p), Layer: l, Stage: fmt.Sprintf("%s/%d", cache, b)},
				Kind: dump.KindPage, DType: dump.U8, Shape: []int{len(data)}, Data: data,
				Page: &dump.PageInfo{Layout: row.String(), PageID: b, BlockSize: B, BlockTable: table},
			})
		}
	}
	return out, nil
}
