package dump

import (
	"archive/zip"
	"encoding/binary"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"

	"sparsemla/userfile"
)

// npyMagic starts every .npy file.
const npyMagic = "\x93NUMPY"

// MaxNpyHeader bounds the .npy header dictionary we accept.
const MaxNpyHeader = 1 << 20

// NpyHeader is the parsed header of a .npy array: dtype, shape and where the
// data starts. numpy has no bf16/fp8 dtypes: save those as uint16/uint8 bits
// (descr <u2 / |u1, or ml_dtypes' void <V2 / |V1) and give the real dtype in
// the name map ("dtype": "bf16").
type NpyHeader struct {
	Descr   string
	DType   DType
	Shape   []int
	DataOff int64 // offset of the first data byte
	NBytes  int64
}

var (
	npyDescrRe   = regexp.MustCompile(`'descr'\s*:\s*'([^']*)'`)
	npyFortranRe = regexp.MustCompile(`'fortran_order'\s*:\s*(True|False)`)
	npyShapeRe   = regexp.MustCompile(`'shape'\s*:\s*\(([^)]*)\)`)
)

// npyDescrDType maps a numpy descr to a dtype (little-endian or byte types only).
func npyDescrDType(d string) (DType, bool) {
	switch d {
	case "<f4":
		return F32, true
	case "<f8":
		return F64, true
	case "<f2":
		return F16, true
	case "|i1", "<i1":
		return I8, true
	case "<i2":
		return I16, true
	case "<i4":
		return I32, true
	case "<i8":
		return I64, true
	case "|u1", "<u1", "|V1":
		return U8, true
	case "<u2", "|V2", "<V2":
		return U16, true
	case "<u4":
		return U32, true
	case "<u8":
		return U64, true
	case "|b1":
		return Bool, true
	}
	return Invalid, false
}

// ParseNpyHeader reads and checks the header of a .npy stream of the given
// size (bytes): magic, version 1-3, dictionary, dtype, C order, and that the
// shape's byte count fits the file exactly.
func ParseNpyHeader(r io.ReaderAt, size int64) (NpyHeader, error) {
	var pre [12]byte
	if size < 10 {
		return NpyHeader{}, fmt.Errorf("npy: %d bytes, shorter than the 10-byte preamble", size)
	}
	if err := readAt(r, pre[:10], 0); err != nil {
		return NpyHeader{}, fmt.Errorf("npy: reading preamble at offset 0: %w", err)
	}
	if string(pre[:6]) != npyMagic {
		return NpyHeader{}, fmt.Errorf("npy: offset 0: bad magic %q", pre[:6])
	}
	var hlen, start int64
	switch pre[6] {
	case 1:
		hlen, start = int64(binary.LittleEndian.Uint16(pre[8:10])), 10
	case 2, 3:
		if size < 12 {
			return NpyHeader{}, fmt.Errorf("npy: %d bytes, shorter than the 12-byte v%d preamble", size, pre[6])
		}
		if err := readAt(r, pre[:12], 0); err != nil {
			return NpyHeader{}, fmt.Errorf("npy: reading preamble at offset 0: %w", err)
		}
		hlen, start = int64(binary.LittleEndian.Uint32(pre[8:12])), 12
	default:
		return NpyHeader{}, fmt.Errorf("npy: offset 6: unsupported format version %d.%d", pre[6], pre[7])
	}
	if hlen > MaxNpyHeader || hlen > size-start {
		return NpyHeader{}, fmt.Errorf("npy: offset 8: header length %d exceeds the file (%d bytes) or the %d-byte limit", hlen, size, MaxNpyHeader)
	}
	hdr := make([]byte, hlen)
	if err := readAt(r, hdr, start); err != nil {
		return NpyHeader{}, fmt.Errorf("npy: reading header at offset %d: %w", start, err)
	}
	h := NpyHeader{DataOff: start + hlen}
	m := npyDescrRe.FindSubmatch(hdr)
	if m == nil {
		return NpyHeader{}, fmt.Errorf("npy: offset %d: header has no 'descr'", start)
	}
	h.Descr = string(m[1])
	dt, ok := npyDescrDType(h.Descr)
	if !ok {
		return NpyHeader{}, fmt.Errorf("npy: offset %d: unsupported descr %s (little-endian numeric types only; save bf16/fp8 as uint16/uint8 bits)", start, userfile.Quote(h.Descr))
	}
	h.DType = dt
	m = npyFortranRe.FindSubmatch(hdr)
	if m == nil {
		return NpyHeader{}, fmt.Errorf("npy: offset %d: header has no 'fortran_order'", start)
	}
	if string(m[1]) == "True" {
		return NpyHeader{}, fmt.Errorf("npy: offset %d: fortran_order arrays are not supported (save with np.ascontiguousarray)", start)
	}
	m = npyShapeRe.FindSubmatch(hdr)
	if m == nil {
		return NpyHeader{}, fmt.Errorf("npy: offset %d: header has no 'shape' tuple", start)
	}
	h.Shape = []int{}
	for _, tok := range strings.Split(string(m[1]), ",") {
		tok = strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(tok), "L"))
		if tok == "" {
			continue
		}
		d, err := strconv.Atoi(tok)
		if err != nil || d < 0 {
			return NpyHeader{}, fmt.Errorf("npy: offset %d: bad shape dimension %s", start, userfile.Quote(tok))
		}
		h.Shape = append(h.Shape, d)
	}
	n, err := NumElements(h.Shape)
	if err != nil {
		return NpyHeader{}, fmt.Errorf("npy: offset %d: %w", start, err)
	}
	if h.NBytes, err = dt.ByteLen(n); err != nil {
		return NpyHeader{}, fmt.Errorf("npy: offset %d: %w", start, err)
	}
	if h.NBytes != size-h.DataOff {
		return NpyHeader{}, fmt.Errorf("npy: shape %s %s needs %d data bytes at offset %d, file has %d", userfile.Dims(h.Shape), h.Descr, h.NBytes, h.DataOff, size-h.DataOff)
	}
	return h, nil
}

// npzMember is one array of an .npz archive.
type npzMember struct {
	f      *zip.File
	name   string // member name without ".npy"
	hdr    NpyHeader
	stored int64 // offset of the member's bytes in the archive when stored uncompressed, else -1
}

// MaxNpzMember bounds the uncompressed size of one .npz member.
const MaxNpzMember = 1 << 40

// Inflation limits of a deflated .npz member (np.savez_compressed): a member
// larger than NpzRatioFree bytes must not claim more than NpzMaxRatio times
// its compressed size. Real activations and weights (bf16, fp32, fp8 codes)
// deflate by at most a few times; a member past the ratio is a zip bomb or
// a huge constant tensor, which np.savez (stored, read in place) holds
// without inflating anything.
const (
	NpzRatioFree = 16 << 20
	NpzMaxRatio  = 128
)

// checkNpzInflation refuses a deflated member whose declared size is past
// MaxNpzMember or the ratio limit.
func checkNpzInflation(f *zip.File) error {
	return checkZipInflation(f, "save it with np.savez, uncompressed")
}

// checkZipInflation refuses a deflated zip member (.npz, torch.save) whose
// declared size is past MaxNpzMember, or past NpzMaxRatio times its
// compressed size when larger than NpzRatioFree; hint says how to save it
// instead.
func checkZipInflation(f *zip.File, hint string) error {
	if f.UncompressedSize64 > MaxNpzMember {
		return fmt.Errorf("member %s claims %d bytes (limit %d)", userfile.Quote(f.Name), f.UncompressedSize64, uint64(MaxNpzMember))
	}
	if f.UncompressedSize64 > NpzRatioFree && f.UncompressedSize64/NpzMaxRatio > f.CompressedSize64 {
		return fmt.Errorf("member %s inflates %d compressed bytes to %d (over %d:1; %s)", userfile.Quote(f.Name), f.CompressedSize64, f.UncompressedSize64, NpzMaxRatio, hint)
	}
	return nil
}

// readNpzMember inflates one deflated member and returns the n bytes that
// follow its first skip bytes (the npy header), checking that the member
// ends exactly there and has its declared size. It allocates as data
// arrives (readClaimed), never n up front; buf is reused when large enough.
func readNpzMember(f *zip.File, skip, n int64, buf []byte) ([]byte, error) {
	if err := checkNpzInflation(f); err != nil {
		return nil, err
	}
	if skip < 0 || n < 0 || uint64(skip)+uint64(n) != f.UncompressedSize64 {
		return nil, fmt.Errorf("member %s: %d + %d bytes, zip directory says %d", userfile.Quote(f.Name), skip, n, f.UncompressedSize64)
	}
	rc, err := f.Open()
	if err != nil {
		return nil, fmt.Errorf("member %s: %w", userfile.Quote(f.Name), err)
	}
	defer rc.Close()
	if m, err := io.CopyN(io.Discard, rc, skip); err != nil {
		return nil, fmt.Errorf("member %s: inflating its header: after %d bytes: %w", userfile.Quote(f.Name), m, err)
	}
	var data []byte
	if int64(cap(buf)) >= n {
		data = buf[:n]
		if _, err := io.ReadFull(rc, data); err != nil {
			return nil, fmt.Errorf("member %s: inflating %d data bytes: %w", userfile.Quote(f.Name), n, err)
		}
	} else if data, err = readClaimed(rc, n); err != nil {
		return nil, fmt.Errorf("member %s: after %d of %d data bytes: %w", userfile.Quote(f.Name), len(data), n, err)
	}
	// The end: archive/zip checks the CRC-32 and the size when it is met.
	var one [1]byte
	m, err := io.ReadFull(rc, one[:])
	if m != 0 {
		return nil, fmt.Errorf("member %s: longer than the %d bytes the zip directory says", userfile.Quote(f.Name), f.UncompressedSize64)
	}
	if err != io.EOF {
		return nil, fmt.Errorf("member %s: at its end: %w", userfile.Quote(f.Name), err)
	}
	return data, nil
}

// prefixReaderAt serves ReadAt from the first bytes of a stream (an
// inflating member), reading them only as far as asked and never past
// limit: ParseNpyHeader then costs the header, not the member.
type prefixReaderAt struct {
	r     io.Reader
	buf   []byte
	limit int64
	err   error
}

func (p *prefixReaderAt) ReadAt(b []byte, off int64) (int, error) {
	end := off + int64(len(b))
	if off < 0 || end > p.limit {
		return 0, fmt.Errorf("npy header reaches past the first %d bytes", p.limit)
	}
	for int64(len(p.buf)) < end && p.err == nil {
		need := int(end) - len(p.buf)
		old := len(p.buf)
		p.buf = append(p.buf, make([]byte, need)...)
		m, err := io.ReadFull(p.r, p.buf[old:])
		p.buf = p.buf[:old+m]
		p.err = err
	}
	if off >= int64(len(p.buf)) {
		return 0, io.ErrUnexpectedEOF
	}
	n := copy(b, p.buf[off:])
	if n < len(b) {
		return n, io.ErrUnexpectedEOF
	}
	return n, nil
}

// npyHeaderDeflated parses the npy header of a deflated member by inflating
// only its first bytes (at most the preamble and MaxNpyHeader).
// The ratio limit applies when the data is read (readNpzMember), so that
// inspect still lists such a member.
func npyHeaderDeflated(f *zip.File) (NpyHeader, error) {
	if f.UncompressedSize64 > MaxNpzMember {
		return NpyHeader{}, fmt.Errorf("member %s claims %d bytes (limit %d)", userfile.Quote(f.Name), f.UncompressedSize64, uint64(MaxNpzMember))
	}
	rc, err := f.Open()
	if err != nil {
		return NpyHeader{}, fmt.Errorf("member %s: %w", userfile.Quote(f.Name), err)
	}
	defer rc.Close()
	return ParseNpyHeader(&prefixReaderAt{r: rc, limit: 12 + MaxNpyHeader}, int64(f.UncompressedSize64))
}

// listNpz parses the header of every .npy member of an archive of size
// bytes. A stored member must lie inside the archive: its size comes from
// the zip directory, and Dump.Read allocates it.
func listNpz(zr *zip.Reader, ra io.ReaderAt, size int64, name string) ([]npzMember, error) {
	var out []npzMember
	for i, f := range zr.File {
		if !strings.HasSuffix(f.Name, ".npy") {
			continue
		}
		var hdr NpyHeader
		var err error
		stored := int64(-1)
		if off, oerr := f.DataOffset(); oerr == nil && f.Method == zip.Store && f.CompressedSize64 == f.UncompressedSize64 {
			if off < 0 || off > size || f.UncompressedSize64 > uint64(size-off) {
				return nil, fmt.Errorf("dump: %s: member %d %s: stored member of %d bytes at offset %d exceeds the %d-byte archive", name, i, userfile.Quote(f.Name), f.UncompressedSize64, off, size)
			}
			// Stored (np.savez): parse in place through the archive's ReaderAt.
			hdr, err = ParseNpyHeader(io.NewSectionReader(ra, off, int64(f.UncompressedSize64)), int64(f.UncompressedSize64))
			stored = off
		} else {
			if f.CompressedSize64 > uint64(size) {
				return nil, fmt.Errorf("dump: %s: member %d %s: %d compressed bytes exceed the %d-byte archive", name, i, userfile.Quote(f.Name), f.CompressedSize64, size)
			}
			// Deflated: inflate the header only (the data is read by Dump.Read).
			hdr, err = npyHeaderDeflated(f)
		}
		if err != nil {
			return nil, fmt.Errorf("dump: %s: member %d %s: %w", name, i, userfile.Quote(f.Name), err)
		}
		out = append(out, npzMember{f: f, name: strings.TrimSuffix(f.Name, ".npy"), hdr: hdr, stored: stored})
	}
	return out, nil
}
