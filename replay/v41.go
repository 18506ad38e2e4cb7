package replay

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"

	"sparsemla/attention"
	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/indexer"
	"sparsemla/userfile"
)

// V4.1 dumps in the official layout (testdata/v41-tiny/README.md): a
// directory with config.json (V4.1 ModelArgs), weights.safetensors
// (layers.L.attn.* names, FP8 as U8 codes + U8 UE8M0 32×32 scales),
// rope.safetensors (the GPU's freqs_cis), prefill_state.safetensors and
// step_P.safetensors (L<l>.<stage>), meta.json (index_k_at: the layer whose
// keys model.py's shared index-key slot held before each step). V41Run
// (v41_report.go) compares every dumped stage of every step and layer with
// the V4.1 reference (engine.V41Step), teacher-forced or propagated within
// each step, into the common Report. Native .smd and mapped V4.1 dumps are
// read by LoadV41Dump (v41_source.go).

// V41Dump is a loaded V4.1 dump.
type V41Dump struct {
	Dir         string
	Cfg         *engine.Config
	Model       *engine.V41Model
	WeightsFile string // the weights file Model was loaded from (beside the dump, or the one given)
	Pre         *engine.V41State
	Steps       []int64
	IndexKAt    map[int64]int
	step        map[int64]map[string]engine.Tensor
	// pages are the KV pages of each step (key "L<l>.<cache>", cache
	// window, ckv or icache: v41_pages.go); none in the official layout.
	pages map[int64]map[string][]Page
}

// v41MaxFile bounds each file of a V4.1 dump read whole (the tiny golden's
// largest is 10 MB).
const v41MaxFile = 1 << 30

// IsV41Dir reports whether path is a directory whose config.json is a V4.1
// config (the replay then takes V41Run's path).
func IsV41Dir(path string) bool {
	fi, err := os.Stat(path)
	if err != nil || !fi.IsDir() {
		return false
	}
	b, err := userfile.ReadFile(filepath.Join(path, "config.json"), 1<<20)
	if err != nil {
		return false
	}
	cfg, err := engine.ParseConfig(b)
	return err == nil && cfg.IsV41()
}

// LoadV41Dir reads a V4.1 dump directory, checking every tensor's dtype and
// shape against the config before using it.
func LoadV41Dir(dir string) (*V41Dump, error) { return LoadV41DirWith(dir, "") }

// LoadV41DirWith is LoadV41Dir with the weights from weights (a safetensors
// file or a directory holding weights.safetensors; "": the directory's own).
func LoadV41DirWith(dir, weights string) (*V41Dump, error) {
	cfg, err := engine.LoadConfig(filepath.Join(dir, "config.json"))
	if err != nil {
		return nil, err
	}
	if !cfg.IsV41() {
		return nil, fmt.Errorf("%s: config.json is not a V4.1 config", dir)
	}
	d := &V41Dump{Dir: dir, Cfg: cfg, IndexKAt: map[int64]int{}, step: map[int64]map[string]engine.Tensor{}}
	var meta struct {
		Prefill  int64          `json:"prefill"`
		IndexKAt map[string]int `json:"index_k_at"`
	}
	mb, err := userfile.ReadFile(filepath.Join(dir, "meta.json"), 1<<20)
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(mb, &meta); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, "meta.json"), userfile.JSONError(err))
	}
	for k, v := range meta.IndexKAt {
		var p int64
		if _, err := fmt.Sscanf(k, "%d", &p); err != nil || v < -1 || v >= cfg.NLayers {
			return nil, fmt.Errorf("%s: index_k_at %q: %d", filepath.Join(dir, "meta.json"), k, v)
		}
		d.IndexKAt[p] = v
	}
	ropes, err := loadV41Ropes(filepath.Join(dir, "rope.safetensors"))
	if err != nil {
		return nil, err
	}
	wpath, err := FindWeights(dir, weights)
	if err != nil {
		return nil, err
	}
	if fi, err := os.Stat(wpath); err == nil && fi.IsDir() {
		return nil, fmt.Errorf("weights %s: a checkpoint directory: loading a DeepSeek-V4.1 checkpoint (sharded index, Engram tables) is not implemented; give a weights.safetensors in the official V4.1 names", wpath)
	}
	if d.Model, err = loadV41Weights(cfg, wpath, ropes); err != nil {
		return nil, err
	}
	d.WeightsFile = wpath
	pre, err := readV41Tensors(filepath.Join(dir, "prefill_state.safetensors"))
	if err != nil {
		return nil, err
	}
	if meta.Prefill <= 0 {
		return nil, fmt.Errorf("%s: prefill %d", filepath.Join(dir, "meta.json"), meta.Prefill)
	}
	if d.Pre, err = v41State(cfg, pre, meta.Prefill, d.IndexKAt[meta.Prefill], "prefill_state.safetensors", false); err != nil {
		return nil, err
	}
	files, _ := filepath.Glob(filepath.Join(dir, "step_*.safetensors"))
	for _, f := range files {
		var p int64
		if _, err := fmt.Sscanf(filepath.Base(f), "step_%d.safetensors", &p); err != nil || p < meta.Prefill || p >= int64(cfg.MaxSeqLen) {
			return nil, fmt.Errorf("%s: not a decode step of this dump (prefill %d, max_seq_len %d)", f, meta.Prefill, cfg.MaxSeqLen)
		}
		m, err := readV41Tensors(f)
		if err != nil {
			return nil, err
		}
		d.step[p] = m
		d.Steps = append(d.Steps, p)
	}
	slices.Sort(d.Steps)
	if len(d.Steps) == 0 {
		return nil, fmt.Errorf("%s: no step_P.safetensors", dir)
	}
	for i, p := range d.Steps {
		if p != meta.Prefill+int64(i) {
			return nil, fmt.Errorf("%s: steps %v are not consecutive from the prefill (%d)", dir, d.Steps, meta.Prefill)
		}
	}
	return d, nil
}

func readV41Tensors(path string) (map[string]engine.Tensor, error) {
	st, err := dump.OpenSafetensors(path)
	if err != nil {
		return nil, err
	}
	defer st.Close()
	out := map[string]engine.Tensor{}
	for _, n := range st.Names() {
		r, err := st.Read(n)
		if err != nil {
			return nil, err
		}
		t, err := engine.TensorFromRecord(&r)
		if err != nil {
			return nil, fmt.Errorf("%s: %s: %w", path, n, err)
		}
		out[n] = t
	}
	return out, nil
}

// loadV41Ropes reads the GPU RoPE tables of the official layout
// (rope.safetensors: freqs_cis_r0, freqs_cis_cmp [T, 32, 2]).
func loadV41Ropes(path string) (map[string]*engine.RopeTable, error) {
	rs, err := dump.OpenSafetensors(path)
	if err != nil {
		return nil, err
	}
	defer rs.Close()
	ropes := map[string]*engine.RopeTable{}
	for _, n := range []string{"freqs_cis_r0", "freqs_cis_cmp"} {
		v, sh, err := rs.Float32(n)
		if err != nil {
			return nil, err
		}
		if len(sh) != 3 || sh[1] != attention.RopePairs || sh[2] != 2 || sh[0] < 1 {
			return nil, fmt.Errorf("%s: %s has shape %v, want [T, 32, 2]", rs.Path, n, sh)
		}
		ropes[n] = attention.RopeTableFromCis(v, sh[0], "GPU "+n)
	}
	return ropes, nil
}

// readF32 is the tensor name of ws as fp32, checked to have shape; on an
// error it appends the error (with the file and the name) to errs and
// returns zeros of that shape, so that a loader reads all it can and then
// reports its first error.
func readF32(ws *dump.Safetensors, errs *[]error, name string, shape ...int) []float32 {
	v, sh, err := ws.Float32(name)
	if err == nil && !slices.Equal(sh, shape) {
		err = fmt.Errorf("%s: %s has shape %v, want %v", ws.Path, name, sh, shape)
	}
	if err != nil {
		*errs = append(*errs, err)
		return make([]float32, prod(shape))
	}
	return v
}

// loadV41Weights reads the attention weights of every layer from the
// safetensors file path (official names; FP8 codes U8 or F8_E4M3, block
// scales U8 or F8_E8M0) with the layers' RoPE tables from ropes.
func loadV41Weights(cfg *engine.Config, path string, ropes map[string]*engine.RopeTable) (*engine.V41Model, error) {
	ws, err := dump.OpenSafetensors(path)
	if err != nil {
		return nil, err
	}
	defer ws.Close()
	var errs []error
	f32 := func(name string, shape ...int) []float32 { return readF32(ws, &errs, name, shape...) }
	fp8 := func(name string, rows, cols int) *attention.V41FP8Weight {
		c, err1 := ws.Read(name + ".weight")
		s, err2 := ws.Read(name + ".scale")
		br, bc := (rows+31)/32, (cols+31)/32
		switch {
		case err1 != nil || err2 != nil:
			errs = append(errs, fmt.Errorf("%s: %s: %v %v", path, name, err1, err2))
		case (c.DType != dump.U8 && c.DType != dump.E4M3) || (s.DType != dump.U8 && s.DType != dump.E8M0) || !slices.Equal(c.Shape, []int{rows, cols}) || !slices.Equal(s.Shape, []int{br, bc}):
			errs = append(errs, fmt.Errorf("%s: %s: codes %s %v, scales %s %v; want U8 [%d %d] and U8 [%d %d]", path, name, c.DType, c.Shape, s.DType, s.Shape, rows, cols, br, bc))
		default:
			return attention.NewV41FP8Weight(c.Data, s.Data, rows, cols)
		}
		return attention.NewV41FP8Weight(make([]uint8, rows*cols), make([]uint8, br*bc), rows, cols)
	}
	H, D, dim, G, R := cfg.NHeads, cfg.HeadDim, cfg.Dim, cfg.OGroups, cfg.OLoraRank
	HI, DI := cfg.IndexNHeads, cfg.IndexHeadDim
	m := &engine.V41Model{Cfg: cfg}
	eps := float32(cfg.NormEps)
	for l := 0; l < cfg.NLayers; l++ {
		p := fmt.Sprintf("layers.%d.attn.", l)
		r := cfg.Ratio(l)
		w := &engine.V41LayerWeights{Layer: l, Ratio: r, WqA: fp8(p+"wq_a", cfg.QLoraRank, dim), QNorm: f32(p+"q_norm.weight", cfg.QLoraRank),
			WqB: fp8(p+"wq_b", H*D, cfg.QLoraRank), Wkv: fp8(p+"wkv", D, dim), KVNorm: f32(p+"kv_norm.weight", D),
			WoA: f32(p+"wo_a.weight", G*R, H*D/G), WoB: fp8(p+"wo_b", dim, G*R), AttnSink: f32(p+"attn_sink", H)}
		if cfg.IsKVSource(l) {
			c := &attention.V41Compressor{Ratio: r, HeadDim: D, Dim: dim, Wkv: f32(p+"compressor.wkv.weight", D, dim),
				Norm: f32(p+"compressor.norm.weight", D), Eps: eps}
			if r == 2 {
				c.Wgate = f32(p+"compressor.wgate.weight", D, dim)
			}
			w.Compressor = c
		}
		if cfg.IsIndexSource(l) {
			ix := &indexer.V41Indexer{NHeads: HI, HeadDim: DI, TopK: cfg.IndexTopK, WqB: fp8(p+"indexer.wq_b", HI*DI, cfg.QLoraRank),
				WeightsProj: f32(p+"indexer.weights_proj.weight", HI, dim), Eps: eps}
			if cfg.IsKVSource(l) {
				ix.OwnsK, ix.Wk, ix.KNorm = true, f32(p+"indexer.wk.weight", DI, D), f32(p+"indexer.k_norm.weight", DI)
			}
			w.Indexer = ix
		}
		m.Layers = append(m.Layers, w)
		m.Rope = append(m.Rope, ropes[v41RopeName(cfg, l)])
	}
	if len(errs) > 0 {
		return nil, errs[0]
	}
	if v41HasBlock(ws) {
		if err := loadV41Block(cfg, ws, m); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func prod(s []int) int {
	n := 1
	for _, v := range s {
		n *= v
	}
	return n
}

// v41State builds the state before position next from dumped tensors: from
// a state file (window, ckv) or, fromStep, from a step's outputs (the
// window and compressed rows from kv_cache).
func v41State(cfg *engine.Config, t map[string]engine.Tensor, next int64, indexKAt int, file string, fromStep bool) (*engine.V41State, error) {
	st := engine.NewV41State(cfg)
	st.Next, st.IndexKAt = next, indexKAt
	W, D, DI := cfg.WindowSize, cfg.HeadDim, cfg.IndexHeadDim
	get := func(name string, n int) ([]float32, error) {
		x, ok := t[name]
		if !ok {
			return nil, fmt.Errorf("%s: missing %s", file, name)
		}
		if !x.Kind.IsFloat() || len(x.F) != n {
			return nil, fmt.Errorf("%s: %s is %s %v, want %d values", file, name, x.Kind, x.Shape, n)
		}
		return append([]float32(nil), x.F...), nil
	}
	var err error
	for l, ls := range st.Layers {
		r := cfg.Ratio(l)
		tc := 0
		if cfg.IsKVSource(l) {
			tc = int(next / int64(r))
		}
		_, hasKV := t[fmt.Sprintf("L%d.kv_cache", l)]
		if fromStep && hasKV {
			kv, e := get(fmt.Sprintf("L%d.kv_cache", l), (W+attention.VisibleRows(next-1, r))*D)
			if e != nil {
				return nil, e
			}
			ls.Win = kv[:W*D]
			if cfg.IsKVSource(l) {
				ls.CKV = kv[W*D:]
			}
		} else {
			// the start state, or a step without kv_cache: window and ckv
			// (tensors, or decoded from the pages: stepCaches)
			if ls.Win, err = get(fmt.Sprintf("L%d.window", l), W*D); err != nil {
				return nil, err
			}
			if cfg.IsKVSource(l) {
				if ls.CKV, err = get(fmt.Sprintf("L%d.ckv", l), tc*D); err != nil {
					return nil, err
				}
			}
		}
		if !cfg.IsKVSource(l) {
			continue
		}
		if ls.Cmp != nil {
			if ls.Cmp.KV, err = get(fmt.Sprintf("L%d.cmp_kv_state", l), 2*D); err != nil {
				return nil, err
			}
			if ls.Cmp.Score, err = get(fmt.Sprintf("L%d.cmp_score_state", l), 2*D); err != nil {
				return nil, err
			}
		}
		if cfg.IsIndexSource(l) {
			if ls.ICache, err = get(fmt.Sprintf("L%d.icache", l), tc*DI); err != nil {
				return nil, err
			}
		}
	}
	return st, nil
}

// StateBefore is the state before decode step p: the prefill state for the
// first step, else the state the previous step's dumped outputs leave.
func (d *V41Dump) StateBefore(p int64) (*engine.V41State, error) {
	if p == d.Steps[0] {
		return d.Pre, nil
	}
	t, err := d.stepCaches(p - 1)
	if err != nil {
		return nil, err
	}
	return v41State(d.Cfg, t, p, d.IndexKAt[p], d.stepFile(p-1), true)
}

// Inputs are the dumped attention inputs x of every layer at step p.
func (d *V41Dump) Inputs(p int64) ([]engine.Tensor, error) {
	xs := make([]engine.Tensor, d.Cfg.NLayers)
	for l := range xs {
		x, ok := d.step[p][fmt.Sprintf("L%d.x", l)]
		if !ok || len(x.F) != d.Cfg.Dim {
			return nil, fmt.Errorf("%s: L%d.x missing or not [%d]", d.stepFile(p), l, d.Cfg.Dim)
		}
		xs[l] = x
	}
	return xs, nil
}

// stepFile names step p of the dump in errors: its step file in the
// official layout, else the dump and the step.
func (d *V41Dump) stepFile(p int64) string {
	if d.pages == nil {
		return fmt.Sprintf("step_%d.safetensors", p)
	}
	return fmt.Sprintf("%s: step %d", d.Dir, p)
}

// v41Same is bit equality of two tensors' values (NaN equal to NaN).
func v41Same(a, b engine.Tensor) bool {
	if len(a.F) != len(b.F) || !slices.Equal(a.I, b.I) {
		return false
	}
	for i, x := range a.F {
		y := b.F[i]
		if math.Float32bits(x) != math.Float32bits(y) && !(x == 0 && y == 0) && !(x != x && y != y) {
			return false
		}
	}
	return true
}
