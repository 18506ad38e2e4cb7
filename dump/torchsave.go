package dump

import (
	"archive/zip"
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/nlpodyssey/gopickle/pickle"
	"github.com/nlpodyssey/gopickle/types"

	"sparsemla/userfile"
)

// torch.save zip files (".pt"): a zip archive <prefix>/data.pkl (a pickle,
// protocol 2 by default) + <prefix>/data/<key> (one raw little-endian member
// per storage, stored uncompressed) + byteorder / version members.
//
// The pickle (data.pkl) is decoded in torchsave_pickle.go under a strict
// allow-list; this file reads the zip archive, its storages and tensors.

// maxPickle bounds the data.pkl member read into memory.
const maxPickle = 256 << 20

// ptStorage is one storage of a torch.save file: a zip member of raw bytes.
type ptStorage struct {
	key    string
	dtype  DType // element type of a typed storage (Invalid for UntypedStorage)
	numel  int64 // elements (bytes for UntypedStorage)
	member *zip.File
}

// ptTensor is a tensor of a torch.save file: a strided view of a storage.
type ptTensor struct {
	storage *ptStorage
	dtype   DType
	shape   []int
	stride  []int64
	offset  int64 // elements
	nbytes  int64 // contiguous byte count of the tensor
	span    int64 // bytes of storage from the first to one past the last element
	contig  bool
	fp4x2   bool // float4_e2m1fn_x2: one byte holds two codes
}

func newPtTensor(st *ptStorage, dt DType, fp4 bool, off int64, size, stride []int64) (*ptTensor, error) {
	esz := int64(dt.Bits() / 8)
	if fp4 || dt.Bits() < 8 {
		esz = 1
	}
	t := &ptTensor{storage: st, dtype: dt, offset: off, fp4x2: fp4, stride: stride}
	n := int64(1)
	last := off // index of the last element
	empty := false
	expect := int64(1)
	t.contig = true
	for i := len(size) - 1; i >= 0; i-- {
		s, k := size[i], stride[i]
		if s < 0 || k < 0 {
			return nil, fmt.Errorf("negative size %s or stride %s", userfile.Dims(size), userfile.Dims(stride))
		}
		if s == 0 {
			empty = true
		}
		if s > 1 && k != expect {
			t.contig = false
		}
		expect *= s
		if s > 0 && n > math.MaxInt64/s {
			return nil, fmt.Errorf("size %s overflows", userfile.Dims(size))
		}
		n *= s
		if s > 1 {
			if k > 0 && (s-1) > (math.MaxInt64/4-last)/k {
				return nil, fmt.Errorf("size %s stride %s overflow", userfile.Dims(size), userfile.Dims(stride))
			}
			last += (s - 1) * k
		}
	}
	shape := make([]int, len(size))
	for i, s := range size {
		if s > math.MaxInt32 {
			return nil, fmt.Errorf("dimension %d too large", s)
		}
		shape[i] = int(s)
	}
	if fp4 {
		if len(shape) == 0 {
			shape = []int{2}
		} else {
			shape[len(shape)-1] *= 2
		}
	}
	t.shape = shape
	if n > math.MaxInt64/esz {
		return nil, fmt.Errorf("size %s overflows", userfile.Dims(size))
	}
	t.nbytes = n * esz
	stBytes := st.numel
	if st.dtype != Invalid {
		sb := int64(st.dtype.Bits() / 8)
		if st.numel > math.MaxInt64/sb {
			return nil, fmt.Errorf("storage %s numel %d overflows", userfile.Clip(st.key), st.numel)
		}
		stBytes = st.numel * sb
	}
	if !empty {
		if last > math.MaxInt64/esz-1 || (last+1)*esz > stBytes {
			return nil, fmt.Errorf("view (offset %d, size %s, stride %s) reaches element %d of storage %s that holds %d bytes", off, userfile.Dims(size), userfile.Dims(stride), last, userfile.Clip(st.key), stBytes)
		}
		t.span = (last+1)*esz - off*esz
		// A view is read as a gather of distinct storage elements, so its
		// bytes never exceed the storage's. A view that names one element
		// more than once (a broadcast made by expand, or an overlapping
		// as_strided window) is legal in PyTorch but would make the reader
		// allocate what the shape claims, not what the file holds: a
		// 1-element storage viewed as (2^30, 2^30) with stride (0, 0).
		for i, s := range size {
			if s > 1 && stride[i] == 0 {
				return nil, fmt.Errorf("view (offset %d, size %s, stride %s) of storage %s is broadcast (stride 0 on dimension %d of size %d): expanded views are not read, save a contiguous copy (x.contiguous())", off, userfile.Dims(size), userfile.Dims(stride), userfile.Clip(st.key), i, s)
			}
		}
		if t.nbytes > t.span {
			return nil, fmt.Errorf("view (offset %d, size %s, stride %s) of storage %s overlaps itself (%d bytes of elements in a span of %d bytes): overlapping views are not read, save a contiguous copy (x.contiguous())", off, userfile.Dims(size), userfile.Dims(stride), userfile.Clip(st.key), t.nbytes, t.span)
		}
	}
	return t, nil
}

// ptArchive is an opened torch.save zip.
type ptArchive struct {
	path     string
	size     int64  // bytes of the zip file
	prefix   string // "<prefix>/" of every member
	members  map[string]*zip.File
	storages map[string]*ptStorage
}

// isTorchZip reports whether a zip holds a torch.save pickle.
func isTorchZip(zr *zip.Reader) bool {
	for _, f := range zr.File {
		if f.Name == "data.pkl" || strings.HasSuffix(f.Name, "/data.pkl") && strings.Count(f.Name, "/") == 1 {
			return true
		}
	}
	return false
}

// readTorchSave decodes the pickle of a torch.save zip (fr of size bytes)
// into Go values: map (*types.Dict / *types.OrderedDict entries kept in
// order as ptDict), []interface{}, string, int64, float64, bool, nil and
// *ptTensor. It also returns the pickle's length, which budgets the
// flattening of the value (newPtFlat).
func readTorchSave(fr io.ReaderAt, size int64, path string) (v interface{}, pklLen int, err error) {
	zr, err := zip.NewReader(fr, size)
	if err != nil {
		return nil, 0, fmt.Errorf("dump: %s: torch.save zip: %w", path, err)
	}
	a := &ptArchive{path: path, size: size, members: map[string]*zip.File{}, storages: map[string]*ptStorage{}}
	var pkl *zip.File
	for _, f := range zr.File {
		a.members[f.Name] = f
		if pkl == nil && (f.Name == "data.pkl" || strings.HasSuffix(f.Name, "/data.pkl") && strings.Count(f.Name, "/") == 1) {
			pkl = f
			a.prefix = strings.TrimSuffix(f.Name, "data.pkl")
		}
	}
	if pkl == nil {
		return nil, 0, fmt.Errorf("dump: %s: zip has no data.pkl member: not a torch.save file", path)
	}
	if bo, ok := a.members[a.prefix+"byteorder"]; ok {
		b, err := readMember(bo, 16)
		if err != nil {
			return nil, 0, fmt.Errorf("dump: %s: byteorder: %w", path, err)
		}
		if string(b) != "little" {
			return nil, 0, fmt.Errorf("dump: %s: byteorder %q (only little-endian files are read)", path, b)
		}
	}
	data, err := readMember(pkl, maxPickle)
	if err != nil {
		return nil, 0, fmt.Errorf("dump: %s: %s: %w", path, userfile.Clip(pkl.Name), err)
	}
	if err := scanPickle(data); err != nil {
		return nil, 0, fmt.Errorf("dump: %s: %s: %w", path, userfile.Clip(pkl.Name), err)
	}
	u := pickle.NewUnpickler(bytes.NewReader(data))
	u.FindClass = ptAllowed
	u.PersistentLoad = a.persistentLoad
	u.GetExtension = func(code int) (interface{}, error) {
		return nil, fmt.Errorf("pickle extension code %d is not allowed", code)
	}
	obj, err := loadPickle(&u)
	if err != nil {
		return nil, 0, fmt.Errorf("dump: %s: %s: %w", path, userfile.Clip(pkl.Name), err)
	}
	v, err = newPtWalk(len(data)).value(obj, 0)
	if err != nil {
		return nil, 0, fmt.Errorf("dump: %s: %s: %w", path, userfile.Clip(pkl.Name), err)
	}
	return v, len(data), nil
}

// readMember reads a whole zip member of at most max bytes (grown as read,
// never allocated from the claimed size).
func readMember(f *zip.File, max int64) ([]byte, error) {
	if f.UncompressedSize64 > uint64(max) {
		return nil, fmt.Errorf("member of %d bytes (limit %d)", f.UncompressedSize64, max)
	}
	rc, err := f.Open()
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, fmt.Errorf("member longer than %d bytes", max)
	}
	return b, nil
}

// persistentLoad resolves ('storage', storage_type, key, location, numel).
func (a *ptArchive) persistentLoad(pid interface{}) (interface{}, error) {
	t, ok := pid.(*types.Tuple)
	if !ok || t.Len() < 5 {
		return nil, fmt.Errorf("persistent id %s is not a storage tuple", ptDescribe(pid))
	}
	if s, _ := t.Get(0).(string); s != "storage" {
		return nil, fmt.Errorf("persistent id kind %s (want \"storage\")", ptDescribe(t.Get(0)))
	}
	cls, ok := t.Get(1).(*ptStorageClass)
	if !ok {
		return nil, fmt.Errorf("persistent id storage type %s is not a torch storage class", ptDescribe(t.Get(1)))
	}
	key, ok := t.Get(2).(string)
	if !ok || key == "" || strings.ContainsAny(key, "/\\") {
		return nil, fmt.Errorf("storage key %s", ptDescribe(t.Get(2)))
	}
	numel, err := ptInt(t.Get(4))
	if err != nil || numel < 0 {
		return nil, fmt.Errorf("storage %s: numel %s", userfile.Clip(key), ptDescribe(t.Get(4)))
	}
	if st, ok := a.storages[key]; ok {
		if st.dtype != cls.dt || st.numel != numel {
			return nil, fmt.Errorf("storage %s named twice with different types", userfile.Clip(key))
		}
		return st, nil
	}
	m, ok := a.members[a.prefix+"data/"+key]
	if !ok {
		return nil, fmt.Errorf("storage %s: no member %sdata/%s", userfile.Clip(key), userfile.Clip(a.prefix), userfile.Clip(key))
	}
	want := numel
	if cls.dt != Invalid {
		sb := int64(cls.dt.Bits() / 8)
		if numel > math.MaxInt64/sb {
			return nil, fmt.Errorf("storage %s: numel %d overflows", userfile.Clip(key), numel)
		}
		want = numel * sb
	}
	if m.UncompressedSize64 != uint64(want) {
		return nil, fmt.Errorf("storage %s: member holds %d bytes, the pickle claims %d", userfile.Clip(key), m.UncompressedSize64, want)
	}
	if m.Method == zip.Store {
		// a stored member's bytes are read in place: they must lie in the file
		off, err := m.DataOffset()
		if err != nil || m.CompressedSize64 != m.UncompressedSize64 || off < 0 || uint64(off)+m.CompressedSize64 > uint64(a.size) {
			return nil, fmt.Errorf("storage %s: member %s of %d bytes does not lie inside the %d-byte file", userfile.Clip(key), userfile.Clip(m.Name), m.UncompressedSize64, a.size)
		}
	}
	st := &ptStorage{key: key, dtype: cls.dt, numel: numel, member: m}
	a.storages[key] = st
	return st, nil
}

// ptFlat lists the tensors of a decoded pickle under dotted names (dict
// keys and list indexes joined with "."), and its non-tensor leaves as
// name -> printed value.
//
// A name is built at every node of the tree and repeats every key above the
// node, and the pickle's memo lets one deep container be named again and
// again: a 64-byte key nested 62 deep, named 64 times, spells 8 MB of names
// from a 704-byte pickle, where the walk's budgets (ptWalk) count each key
// once per visit. Every name built is therefore charged to a byte budget set
// from the pickle's length (ptNameBytesPerPickleByte), and so is the
// SGLang record name addPT puts before each tensor's.
type ptFlat struct {
	left  int64 // name bytes it may still build
	limit int64 // the budget it started with, for the error
}

// newPtFlat budgets the flattening of a pickle of n bytes (see
// ptNameBytesPerPickleByte).
func newPtFlat(n int) *ptFlat {
	l := ptNameBudget(n)
	return &ptFlat{left: l, limit: l}
}

// join returns prefix + "." + k (k alone at the root), charged to the
// budget.
func (f *ptFlat) join(prefix, k string) (string, error) {
	if prefix == "" {
		return f.name("", "", k)
	}
	return f.name(prefix, ".", k)
}

// name returns a + sep + b, charged to the budget.
func (f *ptFlat) name(a, sep, b string) (string, error) {
	if f.left -= int64(len(a) + len(sep) + len(b)); f.left < 0 {
		return "", fmt.Errorf("the pickle's keys spell names of more than %d bytes in all (one container named again and again under long keys): not a tensor file", f.limit)
	}
	return a + sep + b, nil
}

// flatten appends the tensors of v (named prefix) to tensors and, when meta
// is not nil, the non-tensor leaves to meta.
func (f *ptFlat) flatten(prefix string, v interface{}, tensors *[]ptNamed, meta map[string]string) error {
	switch x := v.(type) {
	case *ptTensor:
		*tensors = append(*tensors, ptNamed{prefix, x})
	case *ptDict:
		for _, k := range x.keys {
			n, err := f.join(prefix, k)
			if err != nil {
				return err
			}
			if err := f.flatten(n, x.vals[k], tensors, meta); err != nil {
				return err
			}
		}
	case []interface{}:
		for i, it := range x {
			n, err := f.join(prefix, strconv.Itoa(i))
			if err != nil {
				return err
			}
			if err := f.flatten(n, it, tensors, meta); err != nil {
				return err
			}
		}
	case string:
		if meta != nil {
			meta[prefix] = x // not copied: one string can be named many times
		}
	default:
		if meta != nil {
			meta[prefix] = fmt.Sprint(x)
		}
	}
	return nil
}

type ptNamed struct {
	name string
	t    *ptTensor
}

// readPT reads a torch tensor's bytes (contiguous, row-major) into buf.
func readPT(t *ptTensor, srcFile io.ReaderAt, buf []byte) ([]byte, error) {
	if int64(cap(buf)) >= t.nbytes {
		buf = buf[:t.nbytes]
	} else {
		buf = make([]byte, t.nbytes)
	}
	if t.nbytes == 0 {
		return buf, nil
	}
	esz := int64(t.dtype.Bits() / 8)
	if t.fp4x2 || esz == 0 {
		esz = 1
	}
	var src []byte
	m := t.storage.member
	if off, err := m.DataOffset(); err == nil && m.Method == zip.Store {
		if t.contig {
			return buf, readAt(srcFile, buf, off+t.offset*esz)
		}
		src = make([]byte, t.span)
		if err := readAt(srcFile, src, off+t.offset*esz); err != nil {
			return nil, err
		}
	} else {
		// A deflated storage (torch.save writes them stored): inflation is
		// bounded like an .npz member's, so a zip bomb is refused.
		if err := checkZipInflation(m, "torch.save writes storages uncompressed: re-save it"); err != nil {
			return nil, err
		}
		all, err := readMember(m, int64(m.UncompressedSize64))
		if err != nil {
			return nil, err
		}
		if int64(len(all)) < t.offset*esz+t.span {
			return nil, errors.New("storage member shorter than its view")
		}
		src = all[t.offset*esz : t.offset*esz+t.span]
		if t.contig {
			copy(buf, src)
			return buf, nil
		}
	}
	// gather a strided view, row-major
	shape := t.shape
	if t.fp4x2 && len(shape) > 0 {
		shape = append([]int(nil), shape...)
		shape[len(shape)-1] /= 2
	}
	idx := make([]int, len(shape))
	n := t.nbytes / esz
	for i := int64(0); i < n; i++ {
		var o int64
		for d, j := range idx {
			o += int64(j) * t.stride[d]
		}
		copy(buf[i*esz:(i+1)*esz], src[o*esz:(o+1)*esz])
		for d := len(idx) - 1; d >= 0; d-- {
			idx[d]++
			if idx[d] < shape[d] {
				break
			}
			idx[d] = 0
		}
	}
	return buf, nil
}

// addPT indexes the tensors of a torch.save file.
func (d *Dump) addPT(path, rel string, prevFix *[]int) error {
	f, size, src, err := d.addSource(path)
	if err != nil {
		return err
	}
	obj, pklLen, err := readTorchSave(f, size, path)
	if err != nil {
		return err
	}
	fl := newPtFlat(pklLen)
	var ts []ptNamed
	meta := map[string]string{}
	// SGLang dumper files: {"value": tensor, "meta": {...}}.
	if dd, ok := obj.(*ptDict); ok && len(dd.keys) == 2 && dd.vals["meta"] != nil {
		if _, ok := dd.vals["value"]; ok {
			if err := fl.flatten("", dd.vals["meta"], &ts, meta); err != nil {
				return fmt.Errorf("dump: %s: %w", path, err)
			}
			ts = ts[:0]
			if err := fl.flatten("", dd.vals["value"], &ts, nil); err != nil {
				return fmt.Errorf("dump: %s: %w", path, err)
			}
			if len(ts) == 0 {
				// SGLang also dumps non-tensor values (e.g. the request ids
				// "rids", a list of strings): listed, not indexed
				d.Unmapped = append(d.Unmapped, fmt.Sprintf("%s: %s (value is not a tensor)", rel, userfile.Clip(meta["name"])))
				return nil
			}
			base := meta["name"]
			if base == "" {
				base = "value"
			}
			for i := range ts {
				if ts[i].name == "" {
					ts[i].name = base
				} else {
					n, err := fl.name(base, ".", ts[i].name)
					if err != nil {
						return fmt.Errorf("dump: %s: %w", path, err)
					}
					ts[i].name = n
				}
			}
			goto index
		}
	}
	if err := fl.flatten("", obj, &ts, nil); err != nil {
		return fmt.Errorf("dump: %s: %w", path, err)
	}
	for i := range ts {
		if ts[i].name == "" {
			ts[i].name = strings.TrimSuffix(strings.TrimSuffix(filepath.Base(rel), ".pt"), ".pth")
		}
	}
index:
	if len(ts) == 0 {
		return fmt.Errorf("dump: %s: torch.save file holds no tensor", path)
	}
	for i, nt := range ts {
		t := nt.t
		e := Entry{Name: nt.name, DType: t.dtype, Shape: append([]int(nil), t.shape...), NBytes: t.nbytes, File: path, Record: i, src: src, fromDT: t.dtype, pt: t}
		if off, err := t.storage.member.DataOffset(); err == nil && t.storage.member.Method == zip.Store && t.contig {
			esz := int64(t.dtype.Bits() / 8)
			if t.fp4x2 || esz == 0 {
				esz = 1
			}
			e.Offset = off + t.offset*esz
			e.pt = nil
		} else {
			e.Offset = -1
		}
		if len(meta) > 0 {
			e.Meta = meta
		}
		if err := d.mapTensor(e, rel, prevFix); err != nil {
			return err
		}
	}
	return nil
}

// ptMetaKeys lists a meta map's keys in order (for inspect).
func ptMetaKeys(m map[string]string) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
