package dump

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/vmihailenco/msgpack/v5"

	"sparsemla/userfile"
)

// Native format constants (FORMAT.md).
const (
	Magic         = "SPMLDUMP" // first 8 bytes of every native dump file
	Version       = 1          // current format version
	MaxMetaLen    = 1 << 20    // largest msgpack meta block of one frame
	fileHeaderLen = len(Magic) + 4
)

// Frame types (the "t" field of a frame's meta map).
const (
	frameHeader = "header"
	frameTensor = "tensor"
	framePrefix = "prefix"
	frameEnd    = "end" // last frame: {"records": number of tensor frames}
)

// Header is the model/config record every native file starts with.
type Header struct {
	// Version is the format version read from the file (set by readers).
	Version int `msgpack:"-"`
	// ModelArgs is the official ModelArgs JSON (config.json), kept raw.
	ModelArgs string `msgpack:"model_args,omitempty"`
	// CompressRatios is the layer schedule: compress ratio of each layer
	// (0 = window only, 4 = C4 + indexer, 128 = C128).
	CompressRatios []int `msgpack:"compress_ratios,omitempty"`
	// DTypePolicy names the number formats the producer used, e.g.
	// {"activations": "bf16", "linear": "fp8-e4m3", "kv_cache": "v4-model1"}.
	DTypePolicy map[string]string `msgpack:"dtype_policy,omitempty"`
	// Producer says which engine/kernel revision wrote the dump, e.g.
	// {"engine": "sglang", "engine_revision": "...", "kernel": "flashmla", "gpu": "H200"}.
	Producer map[string]string `msgpack:"producer,omitempty"`
	// User is free-form metadata.
	User map[string]string `msgpack:"user,omitempty"`
}

// PrefixHit records that request Request reused the first Tokens tokens of
// request Source from a prefix cache (so its state before step Tokens is
// Source's state, not a fresh prefill).
type PrefixHit struct {
	Request string `msgpack:"request"`
	Source  string `msgpack:"source"`
	Tokens  int    `msgpack:"tokens"`

	// Where the record lies (set by Open, not written): the file, its frame
	// number and byte offset, for errors about the record.
	File   string `msgpack:"-" json:"-"`
	Record int    `msgpack:"-" json:"-"`
	Offset int64  `msgpack:"-" json:"-"`
}

// checkStrings refuses a request or source name longer than MaxKeyString.
func (p *PrefixHit) checkStrings() error {
	if err := checkName("request", p.Request); err != nil {
		return err
	}
	return checkName("source", p.Source)
}

// frameMeta is the msgpack map at the start of every frame.
type frameMeta struct {
	T string `msgpack:"t"`
	// header
	Header *Header `msgpack:"header,omitempty"`
	// tensor
	Request string    `msgpack:"request,omitempty"`
	Step    int       `msgpack:"step"`
	Layer   int       `msgpack:"layer"`
	Stage   string    `msgpack:"stage,omitempty"`
	Kind    string    `msgpack:"kind,omitempty"`
	Name    string    `msgpack:"name,omitempty"`
	DType   string    `msgpack:"dtype,omitempty"`
	Shape   []int     `msgpack:"shape"`
	NBytes  int64     `msgpack:"nbytes"`
	Page    *PageInfo `msgpack:"page,omitempty"`

	// Shard marks a tensor-parallel shard (FORMAT.md).
	Shard *ShardInfo `msgpack:"shard,omitempty"`
	// prefix
	Prefix *PrefixHit `msgpack:"prefix,omitempty"`
	// end
	Records int `msgpack:"records,omitempty"`
}

// Writer writes a native dump file: magic, version, a header frame, then one
// frame per record. It refuses duplicate (key, kind) pairs.
type Writer struct {
	w       *bufio.Writer
	c       io.Closer
	seen    map[entryID]bool
	n       int // frames written
	records int // tensor frames written
	err     error
	meta    bytes.Buffer
	// Create's file: written as tmp, renamed to final by Close.
	tmp, final string
}

type entryID struct {
	Key
	Kind Kind
}

// Create starts the native dump file path and writes the file header and
// h. The records go to a temporary file beside path, which Close renames
// over path when every write succeeded (a failed write or close removes it
// and leaves path as it was); an existing path is replaced, never written
// through (a symbolic link at path is replaced, not followed).
func Create(path string, h Header) (*Writer, error) {
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	f, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return nil, fmt.Errorf("dump: %w", userfile.Describe(path, err))
	}
	w, err := NewWriter(f, h)
	if err != nil {
		f.Close()
		os.Remove(f.Name())
		return nil, err
	}
	w.c, w.tmp, w.final = f, f.Name(), path
	return w, nil
}

// NewWriter writes the file header and h to w.
func NewWriter(w io.Writer, h Header) (*Writer, error) {
	nw := &Writer{w: bufio.NewWriterSize(w, 1<<20), seen: map[entryID]bool{}}
	var fh [fileHeaderLen]byte
	copy(fh[:], Magic)
	binary.LittleEndian.PutUint32(fh[len(Magic):], Version)
	if _, err := nw.w.Write(fh[:]); err != nil {
		return nil, fmt.Errorf("dump: writing file header: %w", err)
	}
	if err := nw.frame(&frameMeta{T: frameHeader, Header: &h}, nil); err != nil {
		return nil, err
	}
	return nw, nil
}

func (w *Writer) frame(m *frameMeta, data []byte) error {
	if w.err != nil {
		return w.err
	}
	// Sorted map keys: the same records always give the same bytes.
	w.meta.Reset()
	enc := msgpack.NewEncoder(&w.meta)
	enc.SetSortMapKeys(true)
	if err := enc.Encode(m); err != nil {
		return fmt.Errorf("dump: encoding frame %d: %w", w.n, err)
	}
	meta := w.meta.Bytes()
	if len(meta) > MaxMetaLen {
		return fmt.Errorf("dump: frame %d meta is %d bytes (limit %d)", w.n, len(meta), MaxMetaLen)
	}
	var l [4]byte
	binary.LittleEndian.PutUint32(l[:], uint32(len(meta)))
	for _, b := range [][]byte{l[:], meta, data} {
		if _, err := w.w.Write(b); err != nil {
			w.err = fmt.Errorf("dump: writing frame %d: %w", w.n, err)
			return w.err
		}
	}
	w.n++
	return nil
}

// Write appends one record. The record must pass Check and its (key, kind)
// must not have been written before.
func (w *Writer) Write(r *Record) error {
	if err := r.Check(); err != nil {
		return fmt.Errorf("dump: record %s: %w", r.label(), err)
	}
	if r.Kind >= numKinds {
		return fmt.Errorf("dump: record %s: invalid kind %d", r.label(), r.Kind)
	}
	id := entryID{r.Key, r.Kind}
	if w.seen[id] {
		return fmt.Errorf("dump: duplicate record %s (%s)", clipKey(r.Key), r.Kind)
	}
	w.seen[id] = true
	w.records++
	shape := r.Shape
	if shape == nil {
		shape = []int{}
	}
	return w.frame(&frameMeta{
		T: frameTensor, Request: r.Request, Step: r.Step, Layer: r.Layer, Stage: r.Stage,
		Kind: r.Kind.String(), Name: r.Name, DType: r.DType.String(), Shape: shape,
		NBytes: int64(len(r.Data)), Page: r.Page,
	}, r.Data)
}

// WritePrefix records a prefix-cache hit.
func (w *Writer) WritePrefix(p PrefixHit) error {
	if err := p.checkStrings(); err != nil {
		return fmt.Errorf("dump: prefix hit: %w", err)
	}
	if p.Tokens < 0 {
		return fmt.Errorf("dump: prefix hit %q <- %q: negative token count %d", p.Request, p.Source, p.Tokens)
	}
	return w.frame(&frameMeta{T: framePrefix, Prefix: &p, Shape: []int{}}, nil)
}

// Close writes the end frame, flushes the buffer and closes the file if
// Create opened it. A file without an end frame (a crashed capture) is still
// readable; readers report it as incomplete.
func (w *Writer) Close() error {
	err := w.frame(&frameMeta{T: frameEnd, Records: w.records, Shape: []int{}}, nil)
	if ferr := w.w.Flush(); err == nil && ferr != nil {
		err = fmt.Errorf("dump: flush: %w", ferr)
	}
	if w.c != nil {
		if cerr := w.c.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("dump: close: %w", cerr)
		}
	}
	if w.tmp != "" {
		if err == nil {
			if cerr := os.Chmod(w.tmp, 0o644); cerr != nil {
				err = fmt.Errorf("dump: %w", cerr)
			} else if rerr := os.Rename(w.tmp, w.final); rerr != nil {
				err = fmt.Errorf("dump: %w", userfile.Describe(w.final, rerr))
			}
		}
		if err != nil {
			os.Remove(w.tmp)
		}
		w.tmp = ""
	}
	return err
}

// Abort drops a file started by Create without writing it (the temporary
// file is removed, path is left as it was); for a Writer of NewWriter it
// does nothing. Close after Abort returns an error and writes nothing.
func (w *Writer) Abort() {
	if w.c != nil {
		w.c.Close()
		w.c = nil
	}
	if w.tmp != "" {
		os.Remove(w.tmp)
		w.tmp = ""
	}
	if w.err == nil {
		w.err = errors.New("dump: writer aborted")
	}
}

// frameInfo is one decoded frame header: its meta and where its data lies.
type frameInfo struct {
	meta    frameMeta
	index   int   // frame number in the file (0 = header frame)
	offset  int64 // byte offset of the frame (its length prefix)
	dataOff int64 // byte offset of its data
}

// frameScanner walks the frames of one native stream. With size >= 0 it
// checks every claimed length against the bytes left before reading.
type frameScanner struct {
	name  string
	r     io.Reader
	size  int64 // total size, -1 when unknown
	off   int64
	index int
	meta  []byte
	// tensors counts tensor frames; ended is set by the end frame.
	tensors int
	ended   bool
}

// errEnd is returned by next at a clean end of the stream.
var errEnd = errors.New("end of dump")

func (s *frameScanner) errf(format string, args ...any) error {
	return fmt.Errorf("dump: %s: record %d at offset %d: %s", s.name, s.index, s.off, fmt.Sprintf(format, args...))
}

// readFileHeader checks the magic and version.
func (s *frameScanner) readFileHeader() (int, error) {
	var fh [fileHeaderLen]byte
	n, err := io.ReadFull(s.r, fh[:])
	if err != nil {
		if n >= len(Magic) && string(fh[:len(Magic)]) != Magic || n < len(Magic) && !bytes.HasPrefix([]byte(Magic), fh[:n]) {
			return 0, fmt.Errorf("dump: %s: offset 0: not a sparsemla dump (magic %q, want %q)", s.name, fh[:n], Magic)
		}
		return 0, fmt.Errorf("dump: %s: offset 0: truncated file header (%d of %d bytes)", s.name, n, fileHeaderLen)
	}
	if string(fh[:len(Magic)]) != Magic {
		return 0, fmt.Errorf("dump: %s: offset 0: not a sparsemla dump (magic %q, want %q)", s.name, fh[:len(Magic)], Magic)
	}
	v := binary.LittleEndian.Uint32(fh[len(Magic):])
	if v != Version {
		return 0, fmt.Errorf("dump: %s: offset %d: format version %d, this reader knows version %d (re-dump with a matching capture package or update sparsemla)", s.name, len(Magic), v, Version)
	}
	s.off = int64(fileHeaderLen)
	return int(v), nil
}

// next reads the next frame's meta. The caller must then consume (or skip)
// exactly meta.NBytes data bytes and call advance.
func (s *frameScanner) next() (frameInfo, error) {
	var l [4]byte
	n, err := io.ReadFull(s.r, l[:])
	if err == io.EOF {
		return frameInfo{}, errEnd
	}
	if s.ended {
		return frameInfo{}, s.errf("data after the end frame")
	}
	if err != nil {
		return frameInfo{}, s.errf("truncated frame length (%d of 4 bytes)", n)
	}
	ml := binary.LittleEndian.Uint32(l[:])
	if ml == 0 || ml > MaxMetaLen {
		return frameInfo{}, s.errf("frame meta length %d outside 1..%d", ml, MaxMetaLen)
	}
	if s.size >= 0 && int64(ml) > s.size-s.off-4 {
		return frameInfo{}, s.errf("frame meta length %d exceeds the %d bytes left in the file", ml, s.size-s.off-4)
	}
	if cap(s.meta) < int(ml) {
		s.meta = make([]byte, 0, ml)
	}
	s.meta = s.meta[:ml]
	if n, err := io.ReadFull(s.r, s.meta); err != nil {
		return frameInfo{}, s.errf("truncated frame meta (%d of %d bytes)", n, ml)
	}
	fi := frameInfo{index: s.index, offset: s.off, dataOff: s.off + 4 + int64(ml)}
	// Claimed lengths first: the decoder would allocate them (msgcheck.go).
	if _, err := checkMsgpack(s.meta); err != nil {
		return frameInfo{}, s.errf("bad frame meta: %v", err)
	}
	if err := msgpack.Unmarshal(s.meta, &fi.meta); err != nil {
		return frameInfo{}, s.errf("bad frame meta: %v", err)
	}
	m := &fi.meta
	if m.NBytes < 0 {
		return frameInfo{}, s.errf("negative data length %d", m.NBytes)
	}
	if s.size >= 0 && m.NBytes > s.size-fi.dataOff {
		return frameInfo{}, s.errf("data length %d exceeds the %d bytes left in the file", m.NBytes, s.size-fi.dataOff)
	}
	switch m.T {
	case frameHeader:
		if m.Header == nil {
			return frameInfo{}, s.errf("header frame without a header")
		}
		if s.index != 0 {
			return frameInfo{}, s.errf("second header frame")
		}
		if m.NBytes != 0 {
			return frameInfo{}, s.errf("header frame with %d data bytes", m.NBytes)
		}
	case framePrefix:
		if m.Prefix == nil || m.NBytes != 0 || m.Prefix.Tokens < 0 {
			return frameInfo{}, s.errf("bad prefix frame")
		}
		if err := m.Prefix.checkStrings(); err != nil {
			return frameInfo{}, s.errf("prefix frame: %v", err)
		}
	case frameEnd:
		if m.NBytes != 0 || m.Records != s.tensors {
			return frameInfo{}, s.errf("end frame says %d tensor records, the file has %d", m.Records, s.tensors)
		}
		if s.ended {
			return frameInfo{}, s.errf("second end frame")
		}
	case frameTensor:
		if s.index == 0 {
			return frameInfo{}, s.errf("tensor frame before the header frame")
		}
		if err := m.check(); err != nil {
			return frameInfo{}, s.errf("%v", err)
		}
		s.tensors++
	default:
		return frameInfo{}, s.errf("unknown frame type %s", userfile.Quote(m.T))
	}
	if s.index == 0 && m.T != frameHeader {
		return frameInfo{}, s.errf("first frame is %s, want %q", userfile.Quote(m.T), frameHeader)
	}
	return fi, nil
}

// advance moves past the data of fi.
func (s *frameScanner) advance(fi frameInfo) {
	if fi.meta.T == frameEnd {
		s.ended = true
	}
	s.off = fi.dataOff + fi.meta.NBytes
	s.index++
}

// check validates a tensor frame's meta: key, kind, dtype, shape vs nbytes.
func (m *frameMeta) check() error {
	if m.Stage == "" {
		return errors.New("tensor frame without a stage name")
	}
	if err := (Key{Request: m.Request, Stage: m.Stage}).checkStrings(); err != nil {
		return err
	}
	if _, ok := ParseKind(m.Kind); !ok {
		return fmt.Errorf("%s: unknown kind %s", userfile.Clip(m.Stage), userfile.Quote(m.Kind))
	}
	dt, ok := ParseDType(m.DType)
	if !ok || dt.String() != m.DType {
		return fmt.Errorf("%s: unknown dtype %s", userfile.Clip(m.Stage), userfile.Quote(m.DType))
	}
	cnt, err := NumElements(m.Shape)
	if err != nil {
		return fmt.Errorf("%s: %w", userfile.Clip(m.Stage), err)
	}
	want, err := dt.ByteLen(cnt)
	if err != nil {
		return fmt.Errorf("%s: shape %s: %w", userfile.Clip(m.Stage), userfile.Dims(m.Shape), err)
	}
	if want != m.NBytes {
		return fmt.Errorf("%s: shape %s %s needs %d bytes, frame says %d", userfile.Clip(m.Stage), userfile.Dims(m.Shape), m.DType, want, m.NBytes)
	}
	if m.Step < NoStep || m.Layer < Global {
		return fmt.Errorf("%s: step %d / layer %d below -1", userfile.Clip(m.Stage), m.Step, m.Layer)
	}
	return nil
}

func (m *frameMeta) record() Record {
	k, _ := ParseKind(m.Kind)
	dt, _ := ParseDType(m.DType)
	return Record{
		Key:   Key{Request: m.Request, Step: m.Step, Layer: m.Layer, Stage: m.Stage},
		Kind:  k,
		Name:  m.Name,
		DType: dt,
		Shape: m.Shape,
		Page:  m.Page,
	}
}

// StreamReader reads a native dump sequentially from any io.Reader (a pipe,
// a socket): memory is bounded by the largest record, and a record's data is
// read as it arrives, never allocated from a claimed length up front.
type StreamReader struct {
	Header Header
	s      frameScanner
	prefix []PrefixHit
	seen   map[entryID]int
}

// NewStreamReader reads the file header and the header frame.
func NewStreamReader(r io.Reader, name string) (*StreamReader, error) {
	sr := &StreamReader{s: frameScanner{name: name, r: r, size: -1}, seen: map[entryID]int{}}
	v, err := sr.s.readFileHeader()
	if err != nil {
		return nil, err
	}
	fi, err := sr.s.next()
	if err == errEnd {
		return nil, sr.s.errf("missing header frame")
	}
	if err != nil {
		return nil, err
	}
	sr.s.advance(fi)
	sr.Header = *fi.meta.Header
	sr.Header.Version = v
	return sr, nil
}

// Next returns the next tensor record, or io.EOF at the end. Prefix-hit
// frames met on the way are collected (see Prefix).
func (sr *StreamReader) Next() (Record, error) {
	for {
		fi, err := sr.s.next()
		if err == errEnd {
			return Record{}, io.EOF
		}
		if err != nil {
			return Record{}, err
		}
		switch fi.meta.T {
		case framePrefix:
			sr.prefix = append(sr.prefix, *fi.meta.Prefix)
			sr.s.advance(fi)
			continue
		case frameEnd:
			sr.s.advance(fi)
			continue
		}
		rec := fi.meta.record()
		id := entryID{rec.Key, rec.Kind}
		if prev, dup := sr.seen[id]; dup {
			return Record{}, sr.s.errf("duplicate record %s (%s), first written as record %d", rec.Key, rec.Kind, prev)
		}
		sr.seen[id] = fi.index
		data, err := readClaimed(sr.s.r, fi.meta.NBytes)
		if err != nil {
			return Record{}, fmt.Errorf("dump: %s: record %d (%s) at offset %d: truncated data (%d of %d bytes)", sr.s.name, fi.index, rec.Key, fi.dataOff, len(data), fi.meta.NBytes)
		}
		rec.Data = data
		sr.s.advance(fi)
		return rec, nil
	}
}

// Complete reports whether the end frame was read (call after Next returned
// io.EOF): false means the file was cut short at a frame boundary, e.g. by a
// crashed capture; the records read are intact.
func (sr *StreamReader) Complete() bool { return sr.s.ended }

// Prefix returns the prefix-cache hits read so far.
func (sr *StreamReader) Prefix() []PrefixHit { return sr.prefix }

// claimChunk is the most readClaimed allocates before the bytes arrive.
const claimChunk = 16 << 20

// readClaimed reads n bytes whose length came from a header: it allocates at
// most claimChunk up front and grows only as data actually arrives, so a
// lying header on a short stream cannot make it allocate n bytes.
func readClaimed(r io.Reader, n int64) ([]byte, error) {
	buf := make([]byte, 0, min(n, claimChunk))
	for int64(len(buf)) < n {
		if len(buf) == cap(buf) {
			buf = append(buf, make([]byte, min(n-int64(len(buf)), int64(cap(buf))))...)[:len(buf)]
		}
		want := min(n-int64(len(buf)), int64(cap(buf)-len(buf)))
		m, err := io.ReadFull(r, buf[len(buf):len(buf)+int(want)])
		buf = buf[:len(buf)+m]
		if err != nil {
			return buf, err
		}
	}
	return buf, nil
}
