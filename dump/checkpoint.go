package dump

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"sparsemla/userfile"
)

// Checkpoint is a Hugging Face style checkpoint directory:
// model.safetensors.index.json ({"weight_map": {tensor: shard}}) + shards, or
// plain *.safetensors files. Shards are opened on first use and only the
// tensors asked for are read, so one layer's attention weights of a
// many-hundred-GB checkpoint cost a few header reads and those tensors.
//
// Names: the official model.py names (layers.N.attn.wq_a.weight,
// layers.N.attn.wq_a.scale, ...) and the HF spellings
// (model.layers.N.self_attn.wq_a.weight, ...weight_scale_inv,
// q_a_proj / q_a_layernorm / input_layernorm, ...) both resolve, following
// the renames of the official convert.py.
type Checkpoint struct {
	Dir    string
	stored map[string]string // stored name -> shard file (relative)
	alias  map[string]string // official name -> stored name
	shards map[string]*Safetensors
}

// MaxIndexJSON bounds the size of model.safetensors.index.json.
const MaxIndexJSON = 256 << 20

// OpenCheckpoint indexes dir.
func OpenCheckpoint(dir string) (*Checkpoint, error) {
	c := &Checkpoint{Dir: dir, stored: map[string]string{}, alias: map[string]string{}, shards: map[string]*Safetensors{}}
	idx := filepath.Join(dir, "model.safetensors.index.json")
	if _, err := os.Lstat(idx); err == nil {
		b, err := userfile.ReadFile(idx, MaxIndexJSON)
		if err != nil {
			return nil, fmt.Errorf("dump: %w", err)
		}
		var v struct {
			WeightMap map[string]string `json:"weight_map"`
		}
		if err := json.Unmarshal(b, &v); err != nil {
			return nil, fmt.Errorf("dump: %s: %w", idx, userfile.JSONError(err))
		}
		if len(v.WeightMap) == 0 {
			return nil, fmt.Errorf("dump: %s: empty weight_map", idx)
		}
		for name, shard := range v.WeightMap {
			if shard == "" || filepath.Base(shard) != shard || shard == ".." || !strings.HasSuffix(shard, ".safetensors") {
				return nil, fmt.Errorf("dump: %s: tensor %s: shard %s is not a .safetensors file name in the checkpoint directory", idx, userfile.Quote(name), userfile.Quote(shard))
			}
			c.stored[name] = shard
		}
	} else {
		files, err := filepath.Glob(filepath.Join(dir, "*.safetensors"))
		if err != nil || len(files) == 0 {
			return nil, fmt.Errorf("dump: %s: no model.safetensors.index.json and no *.safetensors files", dir)
		}
		sort.Strings(files)
		for _, f := range files {
			s, err := c.shard(filepath.Base(f))
			if err != nil {
				return nil, err
			}
			for _, n := range s.Names() {
				if prev, dup := c.stored[n]; dup {
					return nil, fmt.Errorf("dump: %s: tensor %s is in %s and %s", dir, userfile.Quote(n), prev, filepath.Base(f))
				}
				c.stored[n] = filepath.Base(f)
			}
		}
	}
	for n := range c.stored {
		o := OfficialName(n)
		if o == n {
			continue
		}
		if _, clash := c.stored[o]; clash {
			continue // both spellings stored: each name finds itself
		}
		if prev, dup := c.alias[o]; dup {
			return nil, fmt.Errorf("dump: %s: tensors %s and %s both map to the official name %s", dir, userfile.Quote(prev), userfile.Quote(n), userfile.Quote(o))
		}
		c.alias[o] = n
	}
	return c, nil
}

func (c *Checkpoint) shard(file string) (*Safetensors, error) {
	if s, ok := c.shards[file]; ok {
		return s, nil
	}
	s, err := OpenSafetensors(filepath.Join(c.Dir, file))
	if err != nil {
		return nil, err
	}
	c.shards[file] = s
	return s, nil
}

// hfRenames are the component renames of the official convert.py (HF -> model.py).
var hfRenames = map[string]string{
	"embed_tokens":             "embed",
	"input_layernorm":          "attn_norm",
	"post_attention_layernorm": "ffn_norm",
	"q_proj":                   "wq",
	"q_a_proj":                 "wq_a",
	"q_a_layernorm":            "q_norm",
	"q_b_proj":                 "wq_b",
	"kv_a_layernorm":           "kv_norm",
	"o_proj":                   "wo",
	"gate_proj":                "w1",
	"down_proj":                "w2",
	"up_proj":                  "w3",
	"lm_head":                  "head",
	"self_attn":                "attn",
	"mlp":                      "ffn",
	"weight_scale_inv":         "scale",
	"e_score_correction_bias":  "bias",
}

// OfficialName turns an HF tensor name into the official model.py name
// (model.layers.3.self_attn.q_a_proj.weight_scale_inv ->
// layers.3.attn.wq_a.scale). Official names come back unchanged.
func OfficialName(name string) string {
	name = strings.TrimPrefix(name, "model.")
	if o, ok := hfV4Name(name); ok {
		return strings.Replace(o, ".weight_scale_inv", ".scale", 1)
	}
	parts := strings.Split(name, ".")
	for i, p := range parts {
		if r, ok := hfRenames[p]; ok {
			parts[i] = r
		}
	}
	return strings.Join(parts, ".")
}

// Names returns the stored tensor names, sorted.
func (c *Checkpoint) Names() []string {
	out := make([]string, 0, len(c.stored))
	for n := range c.stored {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// resolve returns the stored name of an official or stored name.
func (c *Checkpoint) resolve(name string) (string, bool) {
	if _, ok := c.stored[name]; ok {
		return name, true
	}
	if s, ok := c.alias[name]; ok {
		return s, true
	}
	if s, ok := c.alias[OfficialName(name)]; ok {
		return s, true
	}
	if _, ok := c.stored[OfficialName(name)]; ok {
		return OfficialName(name), true
	}
	return "", false
}

// Has reports whether name (official or HF spelling) is in the checkpoint.
func (c *Checkpoint) Has(name string) bool { _, ok := c.resolve(name); return ok }

// Entry returns the header entry of name, opening its shard.
func (c *Checkpoint) Entry(name string) (SafetensorsEntry, error) {
	st, ok := c.resolve(name)
	if !ok {
		return SafetensorsEntry{}, fmt.Errorf("dump: checkpoint %s: no tensor %s", c.Dir, userfile.Quote(name))
	}
	s, err := c.shard(c.stored[st])
	if err != nil {
		return SafetensorsEntry{}, err
	}
	e, ok := s.Entry(st)
	if !ok {
		return SafetensorsEntry{}, fmt.Errorf("dump: checkpoint %s: index puts %s in %s, which does not hold it", c.Dir, userfile.Quote(st), userfile.Clip(c.stored[st]))
	}
	return e, nil
}

var layerNameRe = regexp.MustCompile(`^layers\.(\d+)\.`)

// Read reads one tensor by official or HF name. The record is a KindWeight
// keyed by the official name (Key.Stage) and its layer; Name is the stored name.
func (c *Checkpoint) Read(name string) (Record, error) {
	st, ok := c.resolve(name)
	if !ok {
		return Record{}, fmt.Errorf("dump: checkpoint %s: no tensor %s", c.Dir, userfile.Quote(name))
	}
	s, err := c.shard(c.stored[st])
	if err != nil {
		return Record{}, err
	}
	if !s.Has(st) {
		return Record{}, fmt.Errorf("dump: checkpoint %s: index puts %s in %s, which does not hold it", c.Dir, userfile.Quote(st), userfile.Clip(c.stored[st]))
	}
	r, err := s.Read(st)
	if err != nil {
		return Record{}, err
	}
	off := OfficialName(st)
	r.Kind, r.Stage, r.Layer, r.Name = KindWeight, off, Global, st
	if m := layerNameRe.FindStringSubmatch(off); m != nil {
		r.Layer, _ = strconv.Atoi(m[1])
	}
	return r, nil
}

// ReadRange is Safetensors.ReadRange on the shard that holds name
// (official or HF spelling). Like Read, it opens the shard on first use.
func (c *Checkpoint) ReadRange(name string, off int64, dst []byte) error {
	st, ok := c.resolve(name)
	if !ok {
		return fmt.Errorf("dump: checkpoint %s: no tensor %s", c.Dir, userfile.Quote(name))
	}
	s, err := c.shard(c.stored[st])
	if err != nil {
		return err
	}
	return s.ReadRange(st, off, dst)
}

// LayerAttention lists the official names of layer n's attention weights
// (layers.n.attn.* and layers.n.attn_norm.*) present in the checkpoint.
func (c *Checkpoint) LayerAttention(n int) []string {
	pre := "layers." + strconv.Itoa(n) + ".attn"
	var out []string
	for s := range c.stored {
		o := OfficialName(s)
		if strings.HasPrefix(o, pre+".") || strings.HasPrefix(o, pre+"_norm.") {
			out = append(out, o)
		}
	}
	sort.Strings(out)
	return out
}

// Close closes the opened shards.
func (c *Checkpoint) Close() error {
	var first error
	for _, s := range c.shards {
		if err := s.Close(); err != nil && first == nil {
			first = err
		}
	}
	c.shards = map[string]*Safetensors{}
	return first
}
