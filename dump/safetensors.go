package dump

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"sort"

	"sparsemla/userfile"
)

// MaxSafetensorsHeader is the largest JSON header accepted (the safetensors
// reference implementation's limit is 100 MB).
const MaxSafetensorsHeader = 100 << 20

// SafetensorsEntry is one tensor's header entry. Offset is absolute in the
// file (8 + header length + data_offsets[0]).
type SafetensorsEntry struct {
	Name   string
	DType  DType
	Shape  []int
	Offset int64
	Size   int64
}

// Safetensors is an open safetensors file. Tensors are read lazily with
// ReadAt; only the header is held in memory.
//
// Layout: u64 little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [b, e]}, ...,
// "__metadata__": {"k": "v"}}, then the data area (offsets relative to 8+N).
type Safetensors struct {
	Path     string
	Metadata map[string]string
	Entries  []SafetensorsEntry // sorted by offset, then name
	byName   map[string]int
	r        io.ReaderAt
	closer   io.Closer
}

// OpenSafetensors opens path and validates its header against the file size.
func OpenSafetensors(path string) (*Safetensors, error) {
	f, fi, err := userfile.Open(path)
	if err != nil {
		return nil, fmt.Errorf("dump: %w", err)
	}
	st, err := NewSafetensors(f, fi.Size(), path)
	if err != nil {
		f.Close()
		return nil, err
	}
	st.closer = f
	return st, nil
}

// NewSafetensors reads the header of a safetensors stream of the given size.
// name is used in error messages.
func NewSafetensors(r io.ReaderAt, size int64, name string) (*Safetensors, error) {
	var lenBuf [8]byte
	if size < 8 {
		return nil, fmt.Errorf("dump: %s: safetensors: file is %d bytes, shorter than the 8-byte header length", name, size)
	}
	if err := readAt(r, lenBuf[:], 0); err != nil {
		return nil, fmt.Errorf("dump: %s: safetensors: reading header length at offset 0: %w", name, err)
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	if n > MaxSafetensorsHeader {
		return nil, fmt.Errorf("dump: %s: safetensors: header length %d at offset 0 exceeds the %d-byte limit", name, n, MaxSafetensorsHeader)
	}
	if int64(n) > size-8 {
		return nil, fmt.Errorf("dump: %s: safetensors: header length %d at offset 0 exceeds the file (%d bytes after the length)", name, n, size-8)
	}
	hdr := make([]byte, n)
	if err := readAt(r, hdr, 8); err != nil {
		return nil, fmt.Errorf("dump: %s: safetensors: reading %d-byte header at offset 8: %w", name, n, err)
	}
	st, err := ParseSafetensorsHeader(hdr, size-8-int64(n))
	if err != nil {
		return nil, fmt.Errorf("dump: %s: safetensors: %w", name, err)
	}
	for i := range st.Entries {
		st.Entries[i].Offset += 8 + int64(n)
	}
	st.Path, st.r = name, r
	return st, nil
}

type stEntryJSON struct {
	DType       string  `json:"dtype"`
	Shape       []int   `json:"shape"`
	DataOffsets []int64 `json:"data_offsets"`
}

// ParseSafetensorsHeader parses the JSON header of a safetensors file whose
// data area has dataSize bytes. Entry offsets are relative to the data area.
// It checks every entry's dtype, shape, byte count and bounds, and that no two
// entries overlap.
func ParseSafetensorsHeader(hdr []byte, dataSize int64) (*Safetensors, error) {
	raw, err := jsonObject(hdr)
	if err != nil {
		return nil, fmt.Errorf("header JSON at offset 8: %w", err)
	}
	st := &Safetensors{Metadata: map[string]string{}, byName: map[string]int{}}
	// Entries are checked in name order, and their bounds in file order
	// below, so an error names the same tensor on every run (the header is
	// a JSON object, decoded into a map).
	names := make([]string, 0, len(raw))
	for name := range raw {
		names = append(names, name)
	}
	sort.Strings(names)
	type bounds struct {
		name   string
		b, end int64
	}
	var outside []bounds
	for _, name := range names {
		msg := raw[name]
		if name == "__metadata__" {
			if err := json.Unmarshal(msg, &st.Metadata); err != nil {
				return nil, fmt.Errorf("__metadata__: want a string-to-string map: %w", userfile.JSONError(err))
			}
			continue
		}
		var e stEntryJSON
		if err := json.Unmarshal(msg, &e); err != nil {
			return nil, fmt.Errorf("tensor %s: %w", userfile.Quote(name), userfile.JSONError(err))
		}
		dt, ok := ParseDType(e.DType)
		if !ok || e.DType != dt.SafetensorsName() {
			return nil, fmt.Errorf("tensor %s: unknown dtype %s", userfile.Quote(name), userfile.Quote(e.DType))
		}
		if e.Shape == nil {
			return nil, fmt.Errorf("tensor %s: missing shape", userfile.Quote(name))
		}
		if len(e.DataOffsets) != 2 {
			return nil, fmt.Errorf("tensor %s: data_offsets has %d values, want 2", userfile.Quote(name), len(e.DataOffsets))
		}
		b, end := e.DataOffsets[0], e.DataOffsets[1]
		if b < 0 || end < b || end > dataSize {
			outside = append(outside, bounds{name, b, end})
			continue
		}
		cnt, err := NumElements(e.Shape)
		if err != nil {
			return nil, fmt.Errorf("tensor %s: %w", userfile.Quote(name), err)
		}
		want, err := dt.ByteLen(cnt)
		if err != nil {
			return nil, fmt.Errorf("tensor %s: shape %s: %w", userfile.Quote(name), userfile.Dims(e.Shape), err)
		}
		if want != end-b {
			return nil, fmt.Errorf("tensor %s: shape %s %s needs %d bytes, data_offsets [%d, %d] hold %d", userfile.Quote(name), userfile.Dims(e.Shape), e.DType, want, b, end, end-b)
		}
		st.Entries = append(st.Entries, SafetensorsEntry{Name: name, DType: dt, Shape: e.Shape, Offset: b, Size: end - b})
	}
	if len(outside) > 0 {
		// The first in file order: in a truncated file, the first tensor
		// the file cuts off.
		sort.Slice(outside, func(i, j int) bool {
			if outside[i].b != outside[j].b {
				return outside[i].b < outside[j].b
			}
			return outside[i].name < outside[j].name
		})
		o := outside[0]
		return nil, fmt.Errorf("tensor %s: data_offsets [%d, %d] outside the %d-byte data area", userfile.Quote(o.name), o.b, o.end, dataSize)
	}
	sort.Slice(st.Entries, func(i, j int) bool {
		a, b := st.Entries[i], st.Entries[j]
		if a.Offset != b.Offset {
			return a.Offset < b.Offset
		}
		return a.Name < b.Name
	})
	for i := range st.Entries {
		if i > 0 {
			p, e := st.Entries[i-1], st.Entries[i]
			if e.Offset < p.Offset+p.Size {
				return nil, fmt.Errorf("tensor %s [%d, %d] overlaps tensor %s [%d, %d]", userfile.Quote(e.Name), e.Offset, e.Offset+e.Size, userfile.Quote(p.Name), p.Offset, p.Offset+p.Size)
			}
		}
		st.byName[st.Entries[i].Name] = i
	}
	return st, nil
}

// Names returns the tensor names in file order.
func (s *Safetensors) Names() []string {
	out := make([]string, len(s.Entries))
	for i, e := range s.Entries {
		out[i] = e.Name
	}
	return out
}

// Entry returns the header entry of name.
func (s *Safetensors) Entry(name string) (SafetensorsEntry, bool) {
	i, ok := s.byName[name]
	if !ok {
		return SafetensorsEntry{}, false
	}
	return s.Entries[i], true
}

// Has reports whether the file holds a tensor called name.
func (s *Safetensors) Has(name string) bool { _, ok := s.byName[name]; return ok }

// Read reads one tensor. The record's Name is the tensor name; its Key is
// zero apart from Step = NoStep and Layer = Global (a name map assigns keys).
func (s *Safetensors) Read(name string) (Record, error) {
	e, ok := s.Entry(name)
	if !ok {
		return Record{}, fmt.Errorf("dump: %s: no tensor %s", s.Path, userfile.Quote(name))
	}
	data := make([]byte, e.Size)
	if err := readAt(s.r, data, e.Offset); err != nil {
		return Record{}, fmt.Errorf("dump: %s: tensor %s: reading %d bytes at offset %d: %w", s.Path, userfile.Quote(name), e.Size, e.Offset, err)
	}
	return Record{
		Key:   Key{Step: NoStep, Layer: Global, Stage: name},
		Kind:  KindStage,
		Name:  name,
		DType: e.DType,
		Shape: append([]int(nil), e.Shape...),
		Data:  data,
	}, nil
}

// ReadRange reads len(dst) bytes of tensor name from byte off of its data
// (e.g. one row of a large table): the range must lie inside the tensor.
func (s *Safetensors) ReadRange(name string, off int64, dst []byte) error {
	e, ok := s.Entry(name)
	if !ok {
		return fmt.Errorf("dump: %s: no tensor %s", s.Path, userfile.Quote(name))
	}
	if off < 0 || off > e.Size || int64(len(dst)) > e.Size-off {
		return fmt.Errorf("dump: %s: tensor %s: bytes [%d, %d) outside its %d bytes", s.Path, userfile.Quote(name), off, off+int64(len(dst)), e.Size)
	}
	if err := readAt(s.r, dst, e.Offset+off); err != nil {
		return fmt.Errorf("dump: %s: tensor %s: reading %d bytes at offset %d: %w", s.Path, userfile.Quote(name), len(dst), e.Offset+off, err)
	}
	return nil
}

// Float32 reads name and decodes it to fp32 (see Record.Float32).
func (s *Safetensors) Float32(name string) ([]float32, []int, error) {
	r, err := s.Read(name)
	if err != nil {
		return nil, nil, err
	}
	v, err := r.Float32()
	if err != nil {
		return nil, nil, fmt.Errorf("dump: %s: %w", s.Path, err)
	}
	return v, r.Shape, nil
}

// Int64 reads name and decodes it to int64 (see Record.Int64).
func (s *Safetensors) Int64(name string) ([]int64, []int, error) {
	r, err := s.Read(name)
	if err != nil {
		return nil, nil, err
	}
	v, err := r.Int64()
	if err != nil {
		return nil, nil, fmt.Errorf("dump: %s: %w", s.Path, err)
	}
	return v, r.Shape, nil
}

// Close closes the underlying file (if OpenSafetensors opened it).
func (s *Safetensors) Close() error {
	if s.closer != nil {
		return s.closer.Close()
	}
	return nil
}

// WriteSafetensors writes records as a safetensors file (names = Record.Name,
// or Key.String() when Name is empty), with the given metadata. Used by tests
// and by tools that convert dumps.
func WriteSafetensors(w io.Writer, recs []Record, metadata map[string]string) error {
	hdr := map[string]any{}
	if len(metadata) > 0 {
		hdr["__metadata__"] = metadata
	}
	var off int64
	for i := range recs {
		r := &recs[i]
		if err := r.Check(); err != nil {
			return fmt.Errorf("dump: WriteSafetensors record %d: %w", i, err)
		}
		name := r.Name
		if name == "" {
			name = r.Key.String()
		}
		if _, dup := hdr[name]; dup {
			return fmt.Errorf("dump: WriteSafetensors: duplicate tensor name %q", name)
		}
		shape := r.Shape
		if shape == nil {
			shape = []int{}
		}
		hdr[name] = map[string]any{"dtype": r.DType.SafetensorsName(), "shape": shape, "data_offsets": []int64{off, off + int64(len(r.Data))}}
		off += int64(len(r.Data))
	}
	js, err := json.Marshal(hdr)
	if err != nil {
		return fmt.Errorf("dump: WriteSafetensors: %w", err)
	}
	for len(js)%8 != 0 {
		js = append(js, ' ')
	}
	var lenBuf [8]byte
	binary.LittleEndian.PutUint64(lenBuf[:], uint64(len(js)))
	if _, err := w.Write(lenBuf[:]); err != nil {
		return err
	}
	if _, err := w.Write(js); err != nil {
		return err
	}
	for i := range recs {
		if _, err := w.Write(recs[i].Data); err != nil {
			return err
		}
	}
	return nil
}

// readAt fills b from r at off. A full read that also reports io.EOF (allowed
// by the io.ReaderAt contract at the end of the input) is a success.
func readAt(r io.ReaderAt, b []byte, off int64) error {
	if len(b) == 0 {
		return nil
	}
	n, err := r.ReadAt(b, off)
	if n == len(b) {
		return nil
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return err
}

// jsonObject decodes a JSON object into its members, rejecting duplicate
// keys (encoding/json would silently keep the last one).
func jsonObject(b []byte) (map[string]json.RawMessage, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, fmt.Errorf("want a JSON object, got %s", jsonTokenText(tok))
	}
	out := map[string]json.RawMessage{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		key, ok := tok.(string)
		if !ok {
			return nil, fmt.Errorf("want an object key, got %v", tok)
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, fmt.Errorf("member %s: %w", userfile.Quote(key), userfile.JSONError(err))
		}
		if _, dup := out[key]; dup {
			return nil, fmt.Errorf("duplicate tensor name %s", userfile.Quote(key))
		}
		out[key] = v
	}
	if _, err := dec.Token(); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("data after the header object")
	}
	return out, nil
}

// jsonTokenText prints a JSON token for an error message as %v does, a
// string cut by userfile.Clip (a header can be one 100 MB string).
func jsonTokenText(tok json.Token) string {
	if s, ok := tok.(string); ok {
		return userfile.Clip(s)
	}
	return fmt.Sprint(tok)
}
