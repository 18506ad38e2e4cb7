package dump

import (
	"bytes"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"regexp"
	"regexp/syntax"
	"sort"
	"strconv"
	"strings"

	"sparsemla/userfile"
)

// A NameMap turns the tensor names a user's tool wrote into canonical keys.
// It is a JSON file:
//
//	{
//	  "name": "my-engine",
//	  "detect": ["config.json", "step_*.safetensors"],      // globs that must all match (built-in maps)
//	  "config": "config.json",                              // optional ModelArgs file in the directory
//	  "files": [                                            // first matching file rule wins
//	    {"file": "^step_(?P<step>\\d+)\\.safetensors$", "kind": "stage",
//	     "rules": [                                         // first matching name rule wins
//	       {"match": "^model\\.layers\\.(?P<layer>\\d+)\\.self_attn\\.(?P<stage>.+)$"},
//	       {"match": "^kv_bits$", "stage": "kv", "dtype": "bf16"},   // uint16 bits read as bf16
//	       {"match": "^debug\\.", "skip": true}
//	     ]}
//	  ]
//	}
//
// Named captures (?P<request>..), (?P<step>..), (?P<layer>..) and (?P<stage>..)
// in the file or name regexp set the key (the name rule's win). A rule may
// instead give fixed "stage", "layer" (default -1 = global), "step" and
// "request". "kind" is stage, state, table or weight; "state_after_prev":
// true makes a state file valid after the step before the first dumped
// step (e.g. a prefill state). "dtype" overrides the stored dtype (same
// bytes, reinterpreted; u8 -> fp4 doubles the last dimension). File regexps
// match the path relative to the dump directory (for a single file, its
// base name); for .npz/.npy the name is the member / file name without ".npy".
type NameMap struct {
	Name   string     `json:"name"`
	Detect []string   `json:"detect,omitempty"`
	Config string     `json:"config,omitempty"`
	Files  []FileRule `json:"files"`
	// SqueezeLeading drops leading size-1 dimensions of every tensor
	// (SGLang dumps keep the token dimension: [1, dim] for one token).
	SqueezeLeading bool `json:"squeeze_leading,omitempty"`
	// StepStage names a stage whose record holds the absolute position of
	// its step: the steps the file rules capture are a counter (SGLang's
	// dumper step, a forward-pass number) and every record of counter c is
	// re-keyed to the position recorded by the StepStage record of c.
	StepStage string `json:"step_stage,omitempty"`
	// FirstStepState lists stages whose records of the first dumped step are
	// also the replay start state (kind state, valid after that step): a
	// window of steps dumped without a prefill state starts from the state
	// after its first step.
	FirstStepState []string `json:"first_step_state,omitempty"`
}

// FileRule maps the files whose relative path matches File.
type FileRule struct {
	File           string     `json:"file"`
	Kind           string     `json:"kind,omitempty"`
	StateAfterPrev bool       `json:"state_after_prev,omitempty"`
	Rules          []NameRule `json:"rules"`
	Skip           bool       `json:"skip,omitempty"`

	re   *regexp.Regexp
	kind Kind
}

// NameRule maps the tensor names of a file that match Match.
type NameRule struct {
	Match   string `json:"match"`
	Stage   string `json:"stage,omitempty"`
	Layer   *int   `json:"layer,omitempty"`
	Step    *int   `json:"step,omitempty"`
	Request string `json:"request,omitempty"`
	Kind    string `json:"kind,omitempty"`
	DType   string `json:"dtype,omitempty"`
	Skip    bool   `json:"skip,omitempty"`
	// Shape views the tensor with this shape (same element count; one -1
	// is inferred), e.g. [-1, 512] for a flat [H*512] q_b.
	Shape []int `json:"shape,omitempty"`

	re    *regexp.Regexp
	kind  Kind
	hasK  bool
	dtype DType
}

//go:embed maps/*.json
var builtinMaps embed.FS

// ParseNameMap parses and compiles a name map; src names it in errors.
func ParseNameMap(data []byte, src string) (*NameMap, error) {
	var m NameMap
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("dump: name map %s: %w", src, userfile.JSONError(err))
	}
	if len(m.Files) == 0 {
		return nil, fmt.Errorf("dump: name map %s: no file rules", src)
	}
	for i := range m.Files {
		fr := &m.Files[i]
		var err error
		if fr.re, err = compileCaptures(fr.File); err != nil {
			return nil, fmt.Errorf("dump: name map %s: files[%d].file: %w", src, i, err)
		}
		fr.kind = KindStage
		if fr.Kind != "" {
			k, ok := ParseKind(fr.Kind)
			if !ok {
				return nil, fmt.Errorf("dump: name map %s: files[%d]: unknown kind %s", src, i, userfile.Quote(fr.Kind))
			}
			fr.kind = k
		}
		for j := range fr.Rules {
			r := &fr.Rules[j]
			if r.re, err = compileCaptures(r.Match); err != nil {
				return nil, fmt.Errorf("dump: name map %s: files[%d].rules[%d].match: %w", src, i, j, err)
			}
			if r.Kind != "" {
				if r.kind, r.hasK = ParseKind(r.Kind); !r.hasK {
					return nil, fmt.Errorf("dump: name map %s: files[%d].rules[%d]: unknown kind %s", src, i, j, userfile.Quote(r.Kind))
				}
			}
			if r.DType != "" {
				var ok bool
				if r.dtype, ok = ParseDType(r.DType); !ok {
					return nil, fmt.Errorf("dump: name map %s: files[%d].rules[%d]: unknown dtype %s", src, i, j, userfile.Quote(r.DType))
				}
			}
			if !r.Skip && r.Stage == "" && r.re.SubexpIndex("stage") < 0 {
				return nil, fmt.Errorf("dump: name map %s: files[%d].rules[%d]: neither a stage nor a (?P<stage>) capture", src, i, j)
			}
		}
	}
	return &m, nil
}

// compileCaptures compiles re and checks that its named groups are known.
func compileCaptures(expr string) (*regexp.Regexp, error) {
	re, err := regexp.Compile(expr)
	if err != nil {
		return nil, regexpError(err)
	}
	for _, n := range re.SubexpNames() {
		switch n {
		case "", "request", "step", "layer", "stage":
		default:
			return nil, fmt.Errorf("unknown capture group %s (want request, step, layer or stage)", userfile.Quote(n))
		}
	}
	return re, nil
}

// MaxNameMap bounds the size of a name map file (a real one is a few KiB).
const MaxNameMap = 4 << 20

// LoadNameMap reads a name map file, or a built-in map by name.
func LoadNameMap(pathOrName string) (*NameMap, error) {
	if m, err := BuiltinNameMap(pathOrName); err == nil {
		return m, nil
	}
	data, err := userfile.ReadFile(pathOrName, MaxNameMap)
	if errors.Is(err, fs.ErrNotExist) {
		// Neither a file nor a built-in name: say both, and the names.
		return nil, fmt.Errorf("dump: name map: %w", &userfile.Error{Path: pathOrName, Err: err,
			Reason: "no such file, and no built-in map of that name (built-in: " + strings.Join(BuiltinNameMaps(), ", ") + ")"})
	}
	if err != nil {
		return nil, fmt.Errorf("dump: name map: %w", err)
	}
	return ParseNameMap(data, pathOrName)
}

// BuiltinNameMaps lists the embedded maps (dump/maps/*.json).
func BuiltinNameMaps() []string {
	ents, _ := builtinMaps.ReadDir("maps")
	var out []string
	for _, e := range ents {
		out = append(out, e.Name()[:len(e.Name())-len(".json")])
	}
	sort.Strings(out)
	return out
}

// BuiltinNameMap returns an embedded map by name (e.g. "official-v4-tiny").
func BuiltinNameMap(name string) (*NameMap, error) {
	data, err := builtinMaps.ReadFile("maps/" + name + ".json")
	if err != nil {
		return nil, fmt.Errorf("dump: no built-in name map %q", name)
	}
	return ParseNameMap(data, "built-in "+name)
}

// detects reports whether every Detect glob matches some file in dir.
func (m *NameMap) detects(dir string) bool {
	if len(m.Detect) == 0 {
		return false
	}
	for _, g := range m.Detect {
		hits, err := filepath.Glob(filepath.Join(dir, g))
		if err != nil || len(hits) == 0 {
			return false
		}
	}
	return true
}

// DetectNameMap returns the first built-in map whose detect globs all match
// files of dir, or nil.
func DetectNameMap(dir string) *NameMap {
	for _, n := range BuiltinNameMaps() {
		m, err := BuiltinNameMap(n)
		if err == nil && m.detects(dir) {
			return m
		}
	}
	return nil
}

// fileRule returns the rule for a relative file path, or nil.
func (m *NameMap) fileRule(rel string) (*FileRule, []string) {
	for i := range m.Files {
		fr := &m.Files[i]
		if sm := fr.re.FindStringSubmatch(filepath.ToSlash(rel)); sm != nil {
			return fr, sm
		}
	}
	return nil, nil
}

// mapped is the result of mapping one tensor name.
type mapped struct {
	key   Key
	kind  Kind
	dtype DType // Invalid = keep the stored dtype
	view  []int // nil = keep the shape
	skip  bool
	prev  bool // state valid after the step before the first dumped step
}

// mapName maps tensor name of a file matched by fr (file submatches fsm).
// ok is false when no name rule matches.
func (fr *FileRule) mapName(name string, fsm []string) (mapped, bool, error) {
	out := mapped{key: Key{Step: NoStep, Layer: Global}, kind: fr.kind, prev: fr.StateAfterPrev}
	if err := applyCaptures(&out.key, fr.re, fsm); err != nil {
		return out, false, err
	}
	for i := range fr.Rules {
		r := &fr.Rules[i]
		sm := r.re.FindStringSubmatch(name)
		if sm == nil {
			continue
		}
		if r.Skip {
			out.skip = true
			return out, true, nil
		}
		if r.Stage != "" {
			out.key.Stage = r.Stage
		}
		if r.Layer != nil {
			out.key.Layer = *r.Layer
		}
		if r.Step != nil {
			out.key.Step = *r.Step
		}
		if r.Request != "" {
			out.key.Request = r.Request
		}
		if r.hasK {
			out.kind = r.kind
		}
		out.dtype = r.dtype
		out.view = r.Shape
		if err := applyCaptures(&out.key, r.re, sm); err != nil {
			return out, false, err
		}
		return out, true, nil
	}
	return out, false, nil
}

func applyCaptures(k *Key, re *regexp.Regexp, sm []string) error {
	for i, n := range re.SubexpNames() {
		if n == "" || i >= len(sm) || sm[i] == "" {
			continue
		}
		switch n {
		case "request":
			k.Request = sm[i]
		case "stage":
			k.Stage = sm[i]
		case "step", "layer":
			v, err := strconv.Atoi(sm[i])
			if err != nil || v < 0 {
				return fmt.Errorf("capture %s = %s is not a non-negative integer", n, userfile.Quote(sm[i]))
			}
			if n == "step" {
				k.Step = v
			} else {
				k.Layer = v
			}
		}
	}
	return nil
}

// overrideDType reinterprets a tensor's bytes as dtype to. The byte count
// must stay the same; when the element size changes, the last dimension is
// scaled (u8 [.., n] -> fp4 [.., 2n]; u8 [.., 2n] -> bf16 [.., n]).
func overrideDType(from DType, shape []int, to DType) ([]int, error) {
	if to == Invalid || to == from {
		return shape, nil
	}
	fb, tb := from.Bits(), to.Bits()
	if fb == tb {
		return shape, nil
	}
	if len(shape) == 0 {
		return nil, fmt.Errorf("cannot reinterpret a scalar %s as %s", from, to)
	}
	out := append([]int(nil), shape...)
	last := out[len(out)-1]
	if (last*fb)%tb != 0 {
		return nil, fmt.Errorf("last dimension %d of %s does not divide into %s elements", last, from, to)
	}
	out[len(out)-1] = last * fb / tb
	return out, nil
}

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }

// regexpError bounds a regexp compile error: regexp/syntax echoes the
// expression (a name map's or a sidecar's, up to megabytes) or the part
// of it that is wrong; it is cut by userfile.Clip. A normal-sized one is
// returned as is.
func regexpError(err error) error {
	var se *syntax.Error
	if errors.As(err, &se) && len(se.Expr) > 64 {
		return &syntax.Error{Code: se.Code, Expr: userfile.Clip(se.Expr)}
	}
	return err
}
