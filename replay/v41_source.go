package replay

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
)

// V4.1 dumps in any format dump.Open reads (a native .smd file or directory
// written by dump.Writer or the capture helper, or a foreign dump through a
// name map), besides the official directory layout LoadV41Dir reads. The
// records are V4's canonical keys (docs/v41.md "Native dumps"):
//
//	header.model_args             a V4.1 ModelArgs JSON (kv_source_layers, …)
//	state  (step p0−1, layer l)   window [W, D], ckv [Tc, D] (KV sources),
//	                              cmp_kv_state / cmp_score_state [2, D] (r = 2),
//	                              icache [Tc, 128] (index sources owning keys);
//	                              or kv_cache [W + Tc, D] for window ‖ ckv
//	state  (step p0−1, layer −1)  index_k_at i32 [1]: the layer whose keys
//	                              model.py's shared index-key slot holds
//	stage  (step p, layer l)      every V4.1 stage (L<l>.<stage> of the
//	                              official layout), x required
//	stage  (step p, layer −1)     index_k_at i32 [1] before step p (optional)
//	table                         freqs_cis_r0 / freqs_cis_cmp [T, 32, 2]
//	page   (step p, layer l)      window/<n>, ckv/<n>, icache/<n>: the caches
//	                              after step p as V4.1 KV pages (V41PageLayouts)
//
// Missing index_k_at records are derived (v41DeriveIndexKAt); the weights
// are weights.safetensors beside the dump or --weights, in the official
// layout's names (FP8 codes U8 or F8_E4M3, scales U8 or F8_E8M0).

// V41OpenOptions configure OpenV41.
type V41OpenOptions struct {
	Map     *dump.NameMap // name map of a foreign dump (nil: detected)
	Request string        // request to replay ("": the only or first one)
	Weights string        // weights file or directory ("": beside the dump)
	Policy  string        // numerics policy: "" or "official" (V4.1 has only model.py's)
}

// IsV41 reports whether path is a V4.1 dump: a directory whose config.json
// is a V4.1 config, or a native dump (an .smd file, or a directory of them
// without config.json) whose header's model args are.
func IsV41(path string) bool {
	if IsV41Dir(path) {
		return true
	}
	fi, err := os.Stat(path)
	if err != nil {
		return false
	}
	if fi.IsDir() {
		// a directory of native files without config.json: their header
		if _, err := os.Stat(filepath.Join(path, "config.json")); err == nil {
			return false
		}
		if m, _ := filepath.Glob(filepath.Join(path, "*.smd")); len(m) == 0 {
			return false
		}
	} else if !strings.HasSuffix(path, ".smd") {
		return false
	}
	d, err := dump.Open(path)
	if err != nil {
		return false
	}
	defer d.Close()
	cfg, err := engine.ParseConfig([]byte(d.Header.ModelArgs))
	return err == nil && cfg.IsV41()
}

// isV41OfficialDir reports whether dir is in the official V4.1 layout
// (LoadV41Dir): meta.json and step_P.safetensors beside config.json.
func isV41OfficialDir(dir string) bool {
	if _, err := os.Stat(filepath.Join(dir, "meta.json")); err != nil {
		return false
	}
	m, _ := filepath.Glob(filepath.Join(dir, "step_*.safetensors"))
	return len(m) > 0
}

// OpenV41 loads the V4.1 dump at path: a directory in the official layout
// (LoadV41DirWith) unless a name map is given, else any dump dump.OpenMapped
// reads (LoadV41Dump).
func OpenV41(path string, opt V41OpenOptions) (*V41Dump, error) {
	if err := checkV41Policy(path, opt.Policy, ""); err != nil {
		return nil, err
	}
	if opt.Map == nil && IsV41Dir(path) && isV41OfficialDir(path) {
		if opt.Request != "" {
			return nil, fmt.Errorf("%s: --request %q: a directory in the official V4.1 layout holds one request", path, opt.Request)
		}
		return LoadV41DirWith(path, opt.Weights)
	}
	d, err := dump.OpenMapped(path, opt.Map)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return LoadV41Dump(d, opt)
}

// checkV41Policy refuses a numerics policy other than model.py's: V4.1 has
// no second reference (no transformers eager port was read).
func checkV41Policy(path, flag, header string) error {
	switch {
	case flag != "" && flag != engine.PolicyOfficial:
		return fmt.Errorf("%s: --policy %s: DeepSeek-V4.1 has one numerics policy, official (model.py); no %s reference exists for V4.1", path, flag, flag)
	case flag == "" && header != "" && header != engine.PolicyOfficial && slices.Contains(engine.PolicyNames(), header):
		return fmt.Errorf("%s: the dump header's dtype_policy names policy %s: DeepSeek-V4.1 has one numerics policy, official (model.py); pass --policy official to replay it against model.py", path, header)
	}
	return nil
}

// V41PageLayouts maps each V4.1 cache of a layer to the row layout of its
// pages (kvcache.V41Row ids).
var V41PageLayouts = map[string]string{"window": "v41-window-fp8", "ckv": "v41-kv-fp4", "icache": "v41-index-fp4"}

// LoadV41Dump builds a V41Dump from an opened dump (native or mapped) of one
// request: the config from its header, the start state from its state
// records, every step's stage records, its KV pages, the GPU RoPE tables
// (computed when absent) and the weights (V41OpenOptions.Weights). Every
// tensor is checked against the config before use; the dump may be closed
// afterwards.
func LoadV41Dump(d *dump.Dump, opt V41OpenOptions) (*V41Dump, error) {
	if d.Header.ModelArgs == "" {
		return nil, fmt.Errorf("dump %s: no model config (ModelArgs) in the dump; write config.json beside it", d.Path)
	}
	cfg, err := engine.ParseConfig([]byte(d.Header.ModelArgs))
	if err != nil {
		return nil, fmt.Errorf("dump %s: %w", d.Path, err)
	}
	if !cfg.IsV41() {
		return nil, fmt.Errorf("dump %s: the config is not a DeepSeek-V4.1 config", d.Path)
	}
	if err := checkV41Policy(d.Path, opt.Policy, d.Header.DTypePolicy["policy"]); err != nil {
		return nil, err
	}
	src, err := NewDumpSource(d, opt.Request)
	if err != nil {
		return nil, err
	}
	if _, ok := src.PrefixHit(); ok {
		return nil, fmt.Errorf("dump %s: request %q carries a prefix-cache hit record: prefix hits of DeepSeek-V4.1 dumps are not checked (docs/v41.md)", d.Path, src.Request)
	}
	name := d.Path
	if src.Request != "" {
		name = fmt.Sprintf("%s (request %q)", d.Path, src.Request)
	}
	for _, l := range src.Layers() {
		if l >= cfg.NLayers {
			return nil, fmt.Errorf("dump %s: layer %d outside the model (%d layers)", name, l, cfg.NLayers)
		}
	}
	steps := src.Steps()
	first, last := steps[0], steps[len(steps)-1]
	if err := checkReplayConfig(cfg, int(min(last, maxReplayPos))+1); err != nil {
		return nil, fmt.Errorf("dump %s: %w", name, err)
	}
	if last >= int64(cfg.MaxSeqLen) {
		return nil, fmt.Errorf("dump %s: step %d is not a decode step of this model (max_seq_len %d)", name, last, cfg.MaxSeqLen)
	}
	for i, p := range steps {
		if p != first+int64(i) {
			return nil, fmt.Errorf("dump %s: steps %s are not consecutive (V4.1 replays each step from the previous step's dumped caches)", name, StepList(steps))
		}
	}
	v := &V41Dump{Dir: name, Cfg: cfg, IndexKAt: map[int64]int{}, step: map[int64]map[string]engine.Tensor{},
		pages: map[int64]map[string][]Page{}}
	// start state, valid after first−1
	pre := map[string]engine.Tensor{}
	for l := 0; l < cfg.NLayers; l++ {
		st, after, ok, err := src.State(l)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, fmt.Errorf("dump %s: layer %d has no start-state records (kind state: window, ckv, … valid after step %d)", name, l, first-1)
		}
		if after != first-1 {
			return nil, fmt.Errorf("dump %s: layer %d's start state is valid after step %d, the first dumped step is %d", name, l, after, first)
		}
		for n, t := range st {
			pre[fmt.Sprintf("L%d.%s", l, n)] = t
		}
		splitV41KVCache(cfg, pre, l, first)
	}
	at0, ok, err := v41IndexKAtRecord(cfg, src, first-1, true, name)
	if err != nil {
		return nil, err
	}
	if !ok {
		if at0, ok = v41DeriveIndexKAt(cfg, first, -2); !ok {
			return nil, fmt.Errorf("dump %s: no index_k_at state record (layer −1, valid after step %d) and none can be derived: no index source owning keys emits at position %d; dump which layer's keys model.py's shared slot held", name, first-1, first-1)
		}
	}
	v.IndexKAt[first] = at0
	for _, p := range steps {
		m := map[string]engine.Tensor{}
		for l := 0; l < cfg.NLayers; l++ {
			for _, n := range src.StageNames(p, l) {
				t, _, err := src.Stage(p, l, n)
				if err != nil {
					return nil, err
				}
				m[fmt.Sprintf("L%d.%s", l, n)] = t
			}
		}
		// The stages of no layer (tok, logits, … of a whole-model dump)
		// under their own names, as the official layout holds them;
		// index_k_at is read above.
		for _, n := range src.StageNames(p, dump.Global) {
			if n == "index_k_at" {
				continue
			}
			t, _, err := src.Stage(p, dump.Global, n)
			if err != nil {
				return nil, err
			}
			m[n] = t
		}
		v.step[p] = m
		v.Steps = append(v.Steps, p)
		if p == first {
			continue
		}
		at, ok, err := v41IndexKAtRecord(cfg, src, p, false, name)
		if err != nil {
			return nil, err
		}
		if !ok {
			at, _ = v41DeriveIndexKAt(cfg, p, v.IndexKAt[p-1])
		}
		v.IndexKAt[p] = at
	}
	if err := v.loadV41Pages(d, src.Request); err != nil {
		return nil, err
	}
	ropes, err := v41DumpRopes(cfg, d, int(last)+1)
	if err != nil {
		return nil, err
	}
	wpath, err := FindWeights(d.Path, opt.Weights)
	if err != nil {
		return nil, err
	}
	if fi, err := os.Stat(wpath); err == nil && fi.IsDir() {
		return nil, fmt.Errorf("weights %s: a checkpoint directory: loading a DeepSeek-V4.1 checkpoint (sharded index, Engram tables) is not implemented; give a weights.safetensors in the official V4.1 names", wpath)
	}
	if v.Model, err = loadV41Weights(cfg, wpath, ropes); err != nil {
		return nil, err
	}
	v.WeightsFile = wpath
	if v.Pre, err = v41State(cfg, pre, first, at0, name+": start state", false); err != nil {
		return nil, err
	}
	return v, nil
}

// splitV41KVCache splits a state kv_cache [W + Tc, D] (window ‖ compressed
// rows, V4's state name) of layer l into window and ckv when the dump holds
// no window record.
func splitV41KVCache(cfg *engine.Config, t map[string]engine.Tensor, l int, next int64) {
	kv, ok := t[fmt.Sprintf("L%d.kv_cache", l)]
	if _, has := t[fmt.Sprintf("L%d.window", l)]; has || !ok || !kv.Kind.IsFloat() {
		return
	}
	W, D := cfg.WindowSize, cfg.HeadDim
	tc := 0
	if cfg.IsKVSource(l) {
		tc = int(next / int64(cfg.Ratio(l)))
	}
	if len(kv.F) != (W+tc)*D {
		return // v41State names the missing window
	}
	t[fmt.Sprintf("L%d.window", l)] = engine.FromF(kv.Kind, kv.F[:W*D], W, D)
	if tc > 0 {
		t[fmt.Sprintf("L%d.ckv", l)] = engine.FromF(kv.Kind, kv.F[W*D:], tc, D)
	}
}

// v41IndexKAtRecord reads the index_k_at record (layer −1) of step p (a
// state record valid after p when state, else a stage record of step p).
func v41IndexKAtRecord(cfg *engine.Config, src *DumpSource, p int64, state bool, name string) (int, bool, error) {
	var t engine.Tensor
	var ok bool
	var err error
	what := fmt.Sprintf("the index_k_at record of step %d", p)
	if state {
		var st map[string]engine.Tensor
		var after int64
		st, after, ok, err = src.State(dump.Global)
		if err == nil && ok {
			t, ok = st["index_k_at"]
			if ok && after != p {
				return 0, false, fmt.Errorf("dump %s: the index_k_at state record is valid after step %d, the start state after %d", name, after, p)
			}
		}
		what = fmt.Sprintf("the index_k_at state record (valid after step %d)", p)
	} else {
		t, ok, err = src.Stage(p, dump.Global, "index_k_at")
	}
	if err != nil || !ok {
		return 0, false, err
	}
	if t.Kind.IsFloat() || len(t.I) != 1 {
		return 0, false, fmt.Errorf("dump %s: %s is %s %v, want one integer", name, what, t.Kind, t.Shape)
	}
	v := t.I[0]
	if v != -1 && (v < 0 || v >= int64(cfg.NLayers) || !cfg.IsKVSource(int(v)) || !cfg.IsIndexSource(int(v))) {
		return 0, false, fmt.Errorf("dump %s: %s is %d: not −1 nor a layer owning index keys (KV and index sources %v)", name, what, v, v41KeyOwners(cfg))
	}
	return int(v), true, nil
}

// v41KeyOwners are the layers whose indexer owns keys (KV and index source).
func v41KeyOwners(cfg *engine.Config) []int {
	var out []int
	for _, l := range cfg.IndexSources() {
		if cfg.IsKVSource(l) {
			out = append(out, l)
		}
	}
	return out
}

// v41DeriveIndexKAt is the shared index-key slot before step next as
// model.py leaves it (Indexer.forward republishes index_k only when its
// layer's compressor emitted): the last key-owning layer whose compressor
// completed a row at position next−1, else prev (the slot before; −2:
// unknown, then ok is false).
func v41DeriveIndexKAt(cfg *engine.Config, next int64, prev int) (int, bool) {
	at := prev
	for _, l := range v41KeyOwners(cfg) {
		if r := cfg.Ratio(l); r > 0 && next%int64(r) == 0 {
			at = l
		}
	}
	return at, at != -2
}

// v41DumpRopes are the dump's GPU RoPE tables (kind table), or the computed
// ones (engine.LayerRope) when it holds none, for positions 0 … T−1.
func v41DumpRopes(cfg *engine.Config, d *dump.Dump, T int) (map[string]*engine.RopeTable, error) {
	out := map[string]*engine.RopeTable{}
	for _, name := range []string{"freqs_cis_r0", "freqs_cis_cmp"} {
		e, ok := d.Lookup(dump.Key{Step: dump.NoStep, Layer: dump.Global, Stage: name}, dump.KindTable)
		if !ok {
			continue
		}
		rec, err := d.Read(e)
		if err != nil {
			return nil, err
		}
		if len(rec.Shape) != 3 || rec.Shape[1] != attention.RopePairs || rec.Shape[2] != 2 {
			return nil, fmt.Errorf("dump %s: record %d: table %s has shape %v, want [T, 32, 2]", e.File, e.Record, name, rec.Shape)
		}
		if rec.Shape[0] < T {
			return nil, fmt.Errorf("dump %s: record %d: table %s covers positions 0..%d, the dump decodes position %d", e.File, e.Record, name, rec.Shape[0]-1, T-1)
		}
		f, err := rec.Float32()
		if err != nil {
			return nil, fmt.Errorf("dump %s: record %d: table %s: %w", e.File, e.Record, name, err)
		}
		out[name] = attention.RopeTableFromCis(f, rec.Shape[0], d.Path+":"+name)
	}
	for l := 0; l < cfg.NLayers; l++ {
		name := v41RopeName(cfg, l)
		if out[name] == nil {
			out[name] = engine.LayerRope(cfg, l, T)
		}
	}
	return out, nil
}

// v41RopeName is the RoPE table layer l uses.
func v41RopeName(cfg *engine.Config, l int) string {
	if cfg.Ratio(l) == 0 {
		return "freqs_cis_r0"
	}
	return "freqs_cis_cmp"
}

// StageTensor is the dumped tensor key ("L<l>.<stage>") of step p.
func (d *V41Dump) StageTensor(p int64, key string) (engine.Tensor, bool) {
	t, ok := d.step[p][key]
	return t, ok
}

// Official reports whether the dump was read from a directory in the
// official V4.1 layout (LoadV41Dir), not from a native or mapped dump.
func (d *V41Dump) Official() bool { return d.pages == nil }
