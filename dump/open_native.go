// Opening native (.smd) dumps, from a file or from memory (OpenReaderAt).

package dump

import (
	"archive/zip"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"sparsemla/userfile"
)

// OpenReaderAt opens a native dump file held in r, size bytes long (e.g. a
// bytes.Reader over a file already in memory), without a file system. name
// stands for the file in errors, in Entry.File and as Dump.Path. It is the
// reader Open uses for a .smd file, with the same checks and messages:
// every claimed length (frame meta, msgpack arrays, maps and strings,
// record data) is checked against the size bytes before anything is
// allocated for it, and a stream cut at a frame boundary is listed in
// Incomplete. The Dump reads its records from r on demand: r must stay
// valid and unchanged until the Dump is no longer used; Close does not
// close it.
func OpenReaderAt(name string, r io.ReaderAt, size int64) (*Dump, error) {
	if size < 0 {
		return nil, fmt.Errorf("dump: %s: negative size %d", name, size)
	}
	// The size bounds every claim: a size r cannot back is refused here,
	// before a record's claimed length is checked against it.
	if size > 0 {
		var last [1]byte
		if n, err := r.ReadAt(last[:], size-1); n != 1 {
			return nil, fmt.Errorf("dump: %s: size %d, but its last byte cannot be read: %v", name, size, err)
		}
	}
	d := &Dump{Path: name, Format: "native", byKey: map[entryID]int{}}
	d.srcs = append(d.srcs, r)
	if err := d.addNativeFrom(name, r, size, 0); err != nil {
		return nil, err
	}
	if err := d.mergeShards(); err != nil {
		return nil, err
	}
	if err := d.indexKeys(); err != nil {
		return nil, err
	}
	return d, nil
}

// addNative indexes one native file.
func (d *Dump) addNative(path string) error {
	f, size, src, err := d.addSource(path)
	if err != nil {
		return err
	}
	return d.addNativeFrom(path, f, size, src)
}

// addNativeFrom indexes the native file in r (size bytes, d.srcs[src]),
// named path: one pass over the frame metas, skipping the data.
func (d *Dump) addNativeFrom(path string, r io.ReaderAt, size int64, src int) error {
	s := frameScanner{name: path, r: newSeekBuffer(r, size), size: size}
	br := s.r.(*seekBuffer)
	v, err := s.readFileHeader()
	if err != nil {
		return err
	}
	for {
		fi, err := s.next()
		if err == errEnd {
			if s.index == 0 {
				return s.errf("missing header frame")
			}
			if !s.ended {
				d.Incomplete = append(d.Incomplete, path)
			}
			break
		}
		if err != nil {
			return err
		}
		switch fi.meta.T {
		case frameHeader:
			h := *fi.meta.Header
			h.Version = v
			d.noteTPRank(path, h)
			if err := d.mergeHeader(h, path); err != nil {
				return err
			}
		case framePrefix:
			h := *fi.meta.Prefix
			h.File, h.Record, h.Offset = path, fi.index, fi.offset
			d.Prefix = append(d.Prefix, h)
		case frameTensor:
			r := fi.meta.record()
			d.Entries = append(d.Entries, Entry{
				Key: r.Key, Kind: r.Kind, Name: r.Name, DType: r.DType, Shape: r.Shape,
				NBytes: fi.meta.NBytes, Page: r.Page, File: path, Record: fi.index, Offset: fi.dataOff,
				src: src, fromDT: r.DType, Shard: fi.meta.Shard,
			})
		}
		if err := br.skip(fi.meta.NBytes); err != nil {
			return fmt.Errorf("dump: %s: record %d at offset %d: %w", path, fi.index, fi.dataOff, err)
		}
		s.advance(fi)
	}
	return nil
}

// mergeHeader keeps the first header with model args; a second, different
// one (another file of a directory dump) is an error.
func (d *Dump) mergeHeader(h Header, path string) error {
	if d.Header.Version == 0 {
		d.Header = h
		return nil
	}
	if h.ModelArgs != "" && d.Header.ModelArgs != "" && h.ModelArgs != d.Header.ModelArgs {
		return fmt.Errorf("dump: %s: header model_args differ from the first file's", path)
	}
	if d.Header.ModelArgs == "" && h.ModelArgs != "" {
		v := d.Header.Version
		d.Header = h
		d.Header.Version = v
	}
	return nil
}

// mapTensor applies the name map to one tensor and appends its entry.
func (d *Dump) mapTensor(e Entry, rel string, prevFix *[]int) error {
	fr, fsm := d.Map.fileRule(rel)
	if fr == nil || fr.Skip {
		d.Unmapped = append(d.Unmapped, rel+": "+e.Name)
		return nil
	}
	mp, ok, err := fr.mapName(e.Name, fsm)
	if err != nil {
		return fmt.Errorf("dump: %s: record %d (%s): name map %s: %w", e.File, e.Record, userfile.Clip(e.Name), userfile.Clip(d.Map.Name), err)
	}
	if !ok {
		d.Unmapped = append(d.Unmapped, rel+": "+e.Name)
		return nil
	}
	if mp.skip {
		return nil
	}
	e.Key, e.Kind = mp.key, mp.kind
	if mp.dtype != Invalid {
		shape, err := overrideDType(e.DType, e.Shape, mp.dtype)
		if err != nil {
			return fmt.Errorf("dump: %s: record %d (%s): dtype override: %w", e.File, e.Record, userfile.Clip(e.Name), err)
		}
		e.Shape, e.DType = shape, mp.dtype
		if err := (&Record{DType: e.DType, Shape: e.Shape, Data: make([]byte, 0)}).checkLen(e.NBytes); err != nil {
			return fmt.Errorf("dump: %s: record %d (%s): dtype override: %w", e.File, e.Record, userfile.Clip(e.Name), err)
		}
	}
	e.view = mp.view
	if mp.prev && e.Kind == KindState {
		*prevFix = append(*prevFix, len(d.Entries))
	}
	d.Entries = append(d.Entries, e)
	return nil
}

func (d *Dump) addSafetensors(path, rel string, prevFix *[]int) error {
	f, size, src, err := d.addSource(path)
	if err != nil {
		return err
	}
	st, err := NewSafetensors(f, size, path)
	if err != nil {
		return err
	}
	if err := d.noteFileMeta(path, st.Metadata); err != nil {
		return err
	}
	for i, te := range st.Entries {
		e := Entry{Name: te.Name, DType: te.DType, Shape: te.Shape, NBytes: te.Size, File: path, Record: i, Offset: te.Offset, src: src, fromDT: te.DType}
		if dt, ok := rawDTypeNote(st.Metadata[te.Name]); ok && (te.DType == U8 || te.DType == I8) {
			// "float8_e8m0fnu stored as raw uint8 bytes": the writer's own
			// note of the real dtype (the official-v4-tiny convention).
			if shape, err := overrideDType(te.DType, te.Shape, dt); err == nil {
				e.DType, e.Shape = dt, shape
			}
		}
		if err := d.mapTensor(e, rel, prevFix); err != nil {
			return err
		}
	}
	return nil
}

func (d *Dump) addNpy(path, rel string, prevFix *[]int) error {
	f, size, src, err := d.addSource(path)
	if err != nil {
		return err
	}
	h, err := ParseNpyHeader(f, size)
	if err != nil {
		return fmt.Errorf("dump: %s: %w", path, err)
	}
	name := strings.TrimSuffix(filepath.Base(rel), ".npy")
	e := Entry{Name: name, DType: h.DType, Shape: h.Shape, NBytes: h.NBytes, File: path, Offset: h.DataOff, src: src, fromDT: h.DType}
	return d.mapTensor(e, rel, prevFix)
}

func (d *Dump) addNpz(path, rel string, prevFix *[]int) error {
	f, size, src, err := d.addSource(path)
	if err != nil {
		return err
	}
	zr, err := zip.NewReader(f, size)
	if err != nil {
		return fmt.Errorf("dump: %s: npz: %w", path, err)
	}
	ms, err := listNpz(zr, f, size, path)
	if err != nil {
		return err
	}
	for i, m := range ms {
		e := Entry{Name: m.name, DType: m.hdr.DType, Shape: m.hdr.Shape, NBytes: m.hdr.NBytes, File: path, Record: i, src: src, fromDT: m.hdr.DType}
		if m.stored >= 0 {
			e.Offset = m.stored + m.hdr.DataOff
		} else {
			e.Offset, e.npz, e.npyData = -1, m.f, m.hdr.DataOff
		}
		if err := d.mapTensor(e, rel, prevFix); err != nil {
			return err
		}
	}
	return nil
}

// rawDTypeNote parses a safetensors metadata note "<torch dtype> stored as
// raw ..." naming the real dtype of a tensor stored as bytes.
func rawDTypeNote(note string) (DType, bool) {
	name, rest, ok := strings.Cut(note, " stored as raw")
	if !ok || rest == "" && name == "" {
		return Invalid, false
	}
	dt, ok := ParseDType(name)
	if !ok || dt.Bits() > 8 {
		return Invalid, false
	}
	return dt, true
}

// checkLen verifies that n bytes hold r's shape.
func (r *Record) checkLen(n int64) error {
	cnt, err := NumElements(r.Shape)
	if err != nil {
		return err
	}
	want, err := r.DType.ByteLen(cnt)
	if err != nil {
		return err
	}
	if want != n {
		return fmt.Errorf("shape %s %s needs %d bytes, have %d", userfile.Dims(r.Shape), r.DType, want, n)
	}
	return nil
}

// Lookup finds the entry of (key, kind).
func (d *Dump) Lookup(k Key, kind Kind) (*Entry, bool) {
	i, ok := d.byKey[entryID{k, kind}]
	if !ok {
		return nil, false
	}
	return &d.Entries[i], true
}

// Get reads the record of (key, kind).
func (d *Dump) Get(k Key, kind Kind) (Record, error) {
	e, ok := d.Lookup(k, kind)
	if !ok {
		return Record{}, fmt.Errorf("dump: %s: no %s record %s", d.Path, kind, clipKey(k))
	}
	return d.Read(e)
}

// Read reads one entry's bytes into a new buffer.
func (d *Dump) Read(e *Entry) (Record, error) { return d.ReadBuf(e, nil) }

// ReadBuf is Read reusing buf's storage when it is large enough (the
// record's Data then aliases buf). Loops over many records use it to avoid
// one allocation per record.
func (d *Dump) ReadBuf(e *Entry, buf []byte) (Record, error) {
	r := Record{Key: e.Key, Kind: e.Kind, Name: e.Name, DType: e.DType, Shape: append([]int(nil), e.Shape...), Page: e.Page}
	if e.parts != nil {
		return d.readMerged(e, buf)
	}
	if e.pt != nil {
		data, err := readPT(e.pt, d.srcs[e.src], buf)
		if err != nil {
			return Record{}, fmt.Errorf("dump: %s: record %d (%s): %w", e.File, e.Record, userfile.Clip(e.Name), err)
		}
		r.Data = data
		return r, nil
	}
	if e.npz != nil {
		data, err := readNpzMember(e.npz, e.npyData, e.NBytes, buf)
		if err != nil {
			return Record{}, fmt.Errorf("dump: %s: record %d (%s): %w", e.File, e.Record, userfile.Clip(e.Name), err)
		}
		r.Data = data
		return r, nil
	}
	if int64(cap(buf)) >= e.NBytes {
		r.Data = buf[:e.NBytes]
	} else {
		r.Data = make([]byte, e.NBytes)
	}
	if err := readAt(d.srcs[e.src], r.Data, e.Offset); err != nil {
		return Record{}, fmt.Errorf("dump: %s: record %d (%s) at offset %d: reading %d bytes: %w", e.File, e.Record, userfile.Clip(e.Name), e.Offset, e.NBytes, err)
	}
	return r, nil
}

// Close closes every file Open opened for the dump (a reader given to
// OpenReaderAt is the caller's and stays open).
func (d *Dump) Close() error {
	var first error
	for _, f := range d.files {
		if err := f.Close(); err != nil && first == nil {
			first = err
		}
	}
	d.files, d.srcs = nil, nil
	return first
}

// seekBuffer is a buffered sequential reader over an io.ReaderAt that can
// skip data without reading it (the index pass of a native dump reads only
// frame metas).
type seekBuffer struct {
	ra  io.ReaderAt
	off int64 // offset in ra of buf[w]
	buf []byte
	r   int // read position in buf
	w   int // end of valid data in buf
}

// newSeekBuffer reads ra (size bytes) from its start through a buffer of at
// most 64 KiB.
func newSeekBuffer(ra io.ReaderAt, size int64) *seekBuffer {
	return &seekBuffer{ra: ra, buf: make([]byte, min(64<<10, max(size, 1)))}
}

func (b *seekBuffer) Read(p []byte) (int, error) {
	if b.r == b.w {
		if len(p) >= len(b.buf) {
			n, err := b.ra.ReadAt(p, b.off)
			b.off += int64(n)
			if n > 0 {
				return n, nil
			}
			return 0, err
		}
		n, err := b.ra.ReadAt(b.buf, b.off)
		b.off += int64(n)
		b.r, b.w = 0, n
		if n == 0 {
			return 0, err
		}
	}
	n := copy(p, b.buf[b.r:b.w])
	b.r += n
	return n, nil
}

// skip discards n bytes: from the buffer first, then by moving the offset.
func (b *seekBuffer) skip(n int64) error {
	inBuf := int64(b.w - b.r)
	if n <= inBuf {
		b.r += int(n)
		return nil
	}
	b.r, b.w = 0, 0
	b.off += n - inBuf
	return nil
}

// compressRatios extracts "compress_ratios" from a ModelArgs JSON, if any.
func compressRatios(cfg []byte) []int {
	var v struct {
		CompressRatios []int `json:"compress_ratios"`
	}
	if err := jsonUnmarshal(cfg, &v); err != nil {
		return nil
	}
	return v.CompressRatios
}
