package dump

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"

	"sparsemla/userfile"
)

// SidecarFile is the name of the request / prefix-hit sidecar of a foreign
// dump directory (FORMAT.md "Request and prefix-cache metadata"); a single
// file's sidecar is "<file>.sparsemla.json".
const SidecarFile = "sparsemla.json"

// Safetensors __metadata__ keys of a foreign dump (FORMAT.md).
const (
	MetaRequest = "sparsemla.request"
	MetaPrefix  = "sparsemla.prefix"
)

// maxSidecar bounds the sidecar file.
const maxSidecar = 1 << 20

// Sidecar is the parsed sparsemla.json.
type Sidecar struct {
	Version int           `json:"version"`
	Request string        `json:"request,omitempty"`
	Files   []SidecarRule `json:"files,omitempty"`
	Prefix  []PrefixHit   `json:"prefix,omitempty"`
}

// SidecarRule gives the request of the files whose relative path matches File.
type SidecarRule struct {
	File    string `json:"file"`
	Request string `json:"request"`
	re      *regexp.Regexp
}

// prefixJSON is PrefixHit as JSON (PrefixHit's json tags hide the location).
type prefixJSON struct {
	Request *string `json:"request"`
	Source  *string `json:"source"`
	Tokens  *int    `json:"tokens"`
}

type foreignMeta struct {
	sidecar     *Sidecar
	sidecarPath string
	fileReq     map[string]string // file -> sparsemla.request
	// prefixAt indexes d.Prefix by request while addPrefixHit fills it (a
	// safetensors __metadata__ can hold a million hits: scanning d.Prefix
	// for each one was quadratic).
	prefixAt map[string]int
}

// ParseSidecar parses a sidecar strictly: version 1, no unknown keys, every
// prefix hit complete (request, source, tokens > 0), regexps that compile.
func ParseSidecar(data []byte, src string) (*Sidecar, error) {
	var raw struct {
		Version *int            `json:"version"`
		Request string          `json:"request,omitempty"`
		Files   []SidecarRule   `json:"files,omitempty"`
		Prefix  json.RawMessage `json:"prefix,omitempty"`
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("dump: sidecar %s: %w", src, userfile.JSONError(err))
	}
	if raw.Version == nil || *raw.Version != 1 {
		return nil, fmt.Errorf("dump: sidecar %s: version must be 1", src)
	}
	sc := &Sidecar{Version: 1, Request: raw.Request, Files: raw.Files}
	for i := range sc.Files {
		re, err := regexp.Compile(sc.Files[i].File)
		if err != nil {
			return nil, fmt.Errorf("dump: sidecar %s: files[%d].file: %w", src, i, regexpError(err))
		}
		sc.Files[i].re = re
	}
	if len(raw.Prefix) > 0 {
		hits, err := parsePrefixJSON(raw.Prefix)
		if err != nil {
			return nil, fmt.Errorf("dump: sidecar %s: prefix: %w", src, err)
		}
		sc.Prefix = hits
	}
	return sc, nil
}

func parsePrefixJSON(b []byte) ([]PrefixHit, error) {
	var raw []prefixJSON
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&raw); err != nil {
		return nil, userfile.JSONError(err)
	}
	out := make([]PrefixHit, len(raw))
	for i, p := range raw {
		if p.Request == nil || p.Source == nil || p.Tokens == nil {
			return nil, fmt.Errorf("[%d]: request, source and tokens are required", i)
		}
		if *p.Tokens <= 0 {
			return nil, fmt.Errorf("[%d]: tokens %d must be positive", i, *p.Tokens)
		}
		if *p.Request == *p.Source {
			return nil, fmt.Errorf("[%d]: request %s reuses its own prefix", i, userfile.Quote(*p.Request))
		}
		out[i] = PrefixHit{Request: *p.Request, Source: *p.Source, Tokens: *p.Tokens}
	}
	return out, nil
}

// loadSidecar reads the sidecar of a foreign dump, if there is one.
func (d *Dump) loadSidecar(path string, dir bool) error {
	p := path + ".sparsemla.json"
	if dir {
		p = filepath.Join(path, SidecarFile)
	}
	if _, err := os.Lstat(p); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	b, err := userfile.ReadFile(p, maxSidecar) // a regular file of bounded size
	if err != nil {
		return fmt.Errorf("dump: sidecar: %w", err)
	}
	sc, err := ParseSidecar(b, p)
	if err != nil {
		return err
	}
	d.meta.sidecar, d.meta.sidecarPath = sc, p
	for _, h := range sc.Prefix {
		h.File = p
		if err := d.addPrefixHit(h); err != nil {
			return err
		}
	}
	return nil
}

// noteFileMeta reads the sparsemla.* __metadata__ keys of a safetensors file.
func (d *Dump) noteFileMeta(path string, md map[string]string) error {
	if r, ok := md[MetaRequest]; ok {
		if d.meta.fileReq == nil {
			d.meta.fileReq = map[string]string{}
		}
		d.meta.fileReq[path] = r
	}
	if s, ok := md[MetaPrefix]; ok {
		hits, err := parsePrefixJSON([]byte(s))
		if err != nil {
			return fmt.Errorf("dump: %s: __metadata__ %s: %w", path, MetaPrefix, err)
		}
		for _, h := range hits {
			h.File = path
			if err := d.addPrefixHit(h); err != nil {
				return err
			}
		}
	}
	return nil
}

// addPrefixHit merges a prefix hit: the same request twice must agree, and
// is kept once, where it first came. A foreign dump's d.Prefix is appended
// only here (assignRequests sorts it once all hits are in), so prefixAt
// stays its index.
func (d *Dump) addPrefixHit(h PrefixHit) error {
	if err := h.checkStrings(); err != nil {
		return fmt.Errorf("dump: %s: prefix hit: %w", h.File, err)
	}
	if i, ok := d.meta.prefixAt[h.Request]; ok {
		p := d.Prefix[i]
		if p.Source != h.Source || p.Tokens != h.Tokens {
			return fmt.Errorf("dump: prefix hit of request %s: %s says source %s tokens %d, %s says source %s tokens %d",
				userfile.Quote(h.Request), p.File, userfile.Quote(p.Source), p.Tokens, h.File, userfile.Quote(h.Source), h.Tokens)
		}
		return nil
	}
	if d.meta.prefixAt == nil {
		d.meta.prefixAt = map[string]int{}
	}
	d.meta.prefixAt[h.Request] = len(d.Prefix)
	d.Prefix = append(d.Prefix, h)
	return nil
}

// assignRequests gives entries without a request from the name map the
// request of their file's metadata or of the sidecar (FORMAT.md order).
func (d *Dump) assignRequests(root string) {
	sc := d.meta.sidecar
	if sc == nil && len(d.meta.fileReq) == 0 {
		return
	}
	for i := range d.Entries {
		e := &d.Entries[i]
		if e.Request != "" || e.Kind == KindWeight || e.Kind == KindTable {
			continue
		}
		if r, ok := d.meta.fileReq[e.File]; ok {
			e.Request = r
			continue
		}
		if sc == nil {
			continue
		}
		rel, err := filepath.Rel(root, e.File)
		if err != nil {
			rel = e.File
		}
		rel = filepath.ToSlash(rel)
		found := false
		for _, fr := range sc.Files {
			if fr.re.MatchString(rel) {
				e.Request, found = fr.Request, true
				break
			}
		}
		if !found {
			e.Request = sc.Request
		}
	}
	sort.SliceStable(d.Prefix, func(i, j int) bool { return d.Prefix[i].Request < d.Prefix[j].Request })
}
