package dump

import (
	"archive/zip"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/big"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/nlpodyssey/gopickle/pickle"
	"github.com/nlpodyssey/gopickle/types"
)

// torch.save zip files (".pt"): a zip archive <prefix>/data.pkl (a pickle,
// protocol 2 by default) + <prefix>/data/<key> (one raw little-endian member
// per storage, stored uncompressed) + byteorder / version members.
//
// The pickle is decoded by gopickle under a strict allow-list: the only
// globals it may name are the tensor rebuild functions
// (torch._utils._rebuild_tensor_v2 / _v3 / _rebuild_parameter), the storage
// classes of each dtype (torch.FloatStorage, ..., torch.storage.UntypedStorage),
// torch dtypes (torch.bfloat16, torch.float8_e4m3fn, ...) and
// collections.OrderedDict. Nothing is constructed but Go values (dicts, lists,
// tuples, strings, numbers, tensors described by their storage, offset,
// shape and strides): a .pt from the internet can only fail. Before gopickle
// runs, every length the pickle claims (strings, bytes, frames) is checked
// against the bytes that are left, so nothing is allocated by claim.

// maxPickle bounds the data.pkl member read into memory.
const maxPickle = 256 << 20

// maxPickleDepth bounds the nesting of containers walked after decoding.
const maxPickleDepth = 64

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

// torch storage class names -> dtype.
var ptStorageTypes = map[string]DType{
	"FloatStorage": F32, "DoubleStorage": F64, "HalfStorage": F16, "BFloat16Storage": BF16,
	"CharStorage": I8, "ShortStorage": I16, "IntStorage": I32, "LongStorage": I64,
	"ByteStorage": U8, "BoolStorage": Bool,
}

// torch dtype attribute names -> dtype (fp4x2 handled apart).
var ptDTypes = map[string]DType{
	"float32": F32, "float": F32, "float64": F64, "double": F64, "float16": F16, "half": F16,
	"bfloat16": BF16, "int8": I8, "int16": I16, "short": I16, "int32": I32, "int": I32,
	"int64": I64, "long": I64, "uint8": U8, "bool": Bool, "uint16": U16, "uint32": U32, "uint64": U64,
	"float8_e4m3fn": E4M3, "float8_e5m2": E5M2, "float8_e8m0fnu": E8M0,
}

type ptDTypeValue struct {
	dt    DType
	fp4x2 bool
	name  string
}

type ptStorageClass struct {
	name string
	dt   DType // Invalid for UntypedStorage
}

// ptRebuild is torch._utils._rebuild_tensor_v2 / _v3 / _rebuild_parameter.
type ptRebuild struct{ name string }

func (r *ptRebuild) Call(args ...interface{}) (interface{}, error) {
	switch r.name {
	case "_rebuild_parameter", "_rebuild_parameter_with_state":
		if len(args) < 1 {
			return nil, fmt.Errorf("%s: no tensor argument", r.name)
		}
		t, ok := args[0].(*ptTensor)
		if !ok {
			return nil, fmt.Errorf("%s: argument is %T, not a tensor", r.name, args[0])
		}
		return t, nil
	}
	// (storage, storage_offset, size, stride, requires_grad, backward_hooks[, dtype (v3)][, metadata])
	if len(args) < 4 {
		return nil, fmt.Errorf("%s: %d arguments, want at least 4", r.name, len(args))
	}
	st, ok := args[0].(*ptStorage)
	if !ok {
		return nil, fmt.Errorf("%s: storage argument is %T", r.name, args[0])
	}
	dt, fp4 := st.dtype, false
	if r.name == "_rebuild_tensor_v3" {
		if len(args) < 7 {
			return nil, fmt.Errorf("%s: %d arguments, want 7", r.name, len(args))
		}
		dv, ok := args[6].(*ptDTypeValue)
		if !ok {
			return nil, fmt.Errorf("%s: dtype argument is %T", r.name, args[6])
		}
		dt, fp4 = dv.dt, dv.fp4x2
	}
	if dt == Invalid {
		return nil, fmt.Errorf("%s: untyped storage without a dtype", r.name)
	}
	off, err := ptInt(args[1])
	if err != nil || off < 0 {
		return nil, fmt.Errorf("%s: storage offset %v", r.name, args[1])
	}
	size, err := ptInts(args[2])
	if err != nil {
		return nil, fmt.Errorf("%s: size: %w", r.name, err)
	}
	stride, err := ptInts(args[3])
	if err != nil {
		return nil, fmt.Errorf("%s: stride: %w", r.name, err)
	}
	if len(size) != len(stride) {
		return nil, fmt.Errorf("%s: size %v and stride %v differ in rank", r.name, size, stride)
	}
	return newPtTensor(st, dt, fp4, off, size, stride)
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
			return nil, fmt.Errorf("negative size %v or stride %v", size, stride)
		}
		if s == 0 {
			empty = true
		}
		if s > 1 && k != expect {
			t.contig = false
		}
		expect *= s
		if s > 0 && n > math.MaxInt64/s {
			return nil, fmt.Errorf("size %v overflows", size)
		}
		n *= s
		if s > 1 {
			if k > 0 && (s-1) > (math.MaxInt64/4-last)/k {
				return nil, fmt.Errorf("size %v stride %v overflow", size, stride)
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
		return nil, fmt.Errorf("size %v overflows", size)
	}
	t.nbytes = n * esz
	stBytes := st.numel
	if st.dtype != Invalid {
		sb := int64(st.dtype.Bits() / 8)
		if st.numel > math.MaxInt64/sb {
			return nil, fmt.Errorf("storage %s numel %d overflows", st.key, st.numel)
		}
		stBytes = st.numel * sb
	}
	if !empty {
		if last > math.MaxInt64/esz-1 || (last+1)*esz > stBytes {
			return nil, fmt.Errorf("view (offset %d, size %v, stride %v) reaches element %d of storage %s that holds %d bytes", off, size, stride, last, st.key, stBytes)
		}
		t.span = (last+1)*esz - off*esz
	}
	return t, nil
}

func (c *ptStorageClass) Call(args ...interface{}) (interface{}, error) {
	return nil, fmt.Errorf("torch storage class %s called directly (only persistent ids may name storages)", c.name)
}

func ptInt(v interface{}) (int64, error) {
	switch x := v.(type) {
	case int:
		return int64(x), nil
	case int64:
		return x, nil
	case *big.Int:
		if x.IsInt64() {
			return x.Int64(), nil
		}
	case bool:
		if x {
			return 1, nil
		}
		return 0, nil
	}
	return 0, fmt.Errorf("%v (%T) is not an integer", v, v)
}

func ptInts(v interface{}) ([]int64, error) {
	var items []interface{}
	switch x := v.(type) {
	case *types.Tuple:
		items = *x
	case *types.List:
		items = *x
	default:
		return nil, fmt.Errorf("%T is not a tuple", v)
	}
	if len(items) > 64 {
		return nil, fmt.Errorf("rank %d", len(items))
	}
	out := make([]int64, len(items))
	for i, it := range items {
		n, err := ptInt(it)
		if err != nil {
			return nil, err
		}
		out[i] = n
	}
	return out, nil
}

// ptAllowed resolves the globals a tensor file may name; anything else fails.
func ptAllowed(module, name string) (interface{}, error) {
	switch module {
	case "torch._utils":
		switch name {
		case "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter":
			return &ptRebuild{name: name}, nil
		}
	case "torch":
		if dt, ok := ptStorageTypes[name]; ok {
			return &ptStorageClass{name: name, dt: dt}, nil
		}
		if dt, ok := ptDTypes[name]; ok {
			return &ptDTypeValue{dt: dt, name: name}, nil
		}
		if name == "float4_e2m1fn_x2" {
			return &ptDTypeValue{dt: FP4, fp4x2: true, name: name}, nil
		}
	case "torch.storage":
		if name == "UntypedStorage" {
			return &ptStorageClass{name: name}, nil
		}
	case "collections":
		if name == "OrderedDict" {
			return &types.OrderedDictClass{}, nil
		}
	}
	return nil, fmt.Errorf("pickle names global %s.%s, which a tensor file may not name (allowed: torch._utils._rebuild_tensor_v2/_v3/_rebuild_parameter, torch storage classes and dtypes, collections.OrderedDict)", module, name)
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
// *ptTensor.
func readTorchSave(fr io.ReaderAt, size int64, path string) (interface{}, error) {
	zr, err := zip.NewReader(fr, size)
	if err != nil {
		return nil, fmt.Errorf("dump: %s: torch.save zip: %w", path, err)
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
		return nil, fmt.Errorf("dump: %s: zip has no data.pkl member: not a torch.save file", path)
	}
	if bo, ok := a.members[a.prefix+"byteorder"]; ok {
		b, err := readMember(bo, 16)
		if err != nil {
			return nil, fmt.Errorf("dump: %s: byteorder: %w", path, err)
		}
		if string(b) != "little" {
			return nil, fmt.Errorf("dump: %s: byteorder %q (only little-endian files are read)", path, b)
		}
	}
	data, err := readMember(pkl, maxPickle)
	if err != nil {
		return nil, fmt.Errorf("dump: %s: %s: %w", path, pkl.Name, err)
	}
	if err := scanPickle(data); err != nil {
		return nil, fmt.Errorf("dump: %s: %s: %w", path, pkl.Name, err)
	}
	u := pickle.NewUnpickler(bytes.NewReader(data))
	u.FindClass = ptAllowed
	u.PersistentLoad = a.persistentLoad
	u.GetExtension = func(code int) (interface{}, error) {
		return nil, fmt.Errorf("pickle extension code %d is not allowed", code)
	}
	obj, err := loadPickle(&u)
	if err != nil {
		return nil, fmt.Errorf("dump: %s: %s: %w", path, pkl.Name, err)
	}
	v, err := ptValue(obj, 0)
	if err != nil {
		return nil, fmt.Errorf("dump: %s: %s: %w", path, pkl.Name, err)
	}
	return v, nil
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
		return nil, fmt.Errorf("persistent id %v is not a storage tuple", pid)
	}
	if s, _ := t.Get(0).(string); s != "storage" {
		return nil, fmt.Errorf("persistent id kind %v (want \"storage\")", t.Get(0))
	}
	cls, ok := t.Get(1).(*ptStorageClass)
	if !ok {
		return nil, fmt.Errorf("persistent id storage type %v is not a torch storage class", t.Get(1))
	}
	key, ok := t.Get(2).(string)
	if !ok || key == "" || strings.ContainsAny(key, "/\\") {
		return nil, fmt.Errorf("storage key %v", t.Get(2))
	}
	numel, err := ptInt(t.Get(4))
	if err != nil || numel < 0 {
		return nil, fmt.Errorf("storage %s: numel %v", key, t.Get(4))
	}
	if st, ok := a.storages[key]; ok {
		if st.dtype != cls.dt || st.numel != numel {
			return nil, fmt.Errorf("storage %s named twice with different types", key)
		}
		return st, nil
	}
	m, ok := a.members[a.prefix+"data/"+key]
	if !ok {
		return nil, fmt.Errorf("storage %s: no member %sdata/%s", key, a.prefix, key)
	}
	want := numel
	if cls.dt != Invalid {
		sb := int64(cls.dt.Bits() / 8)
		if numel > math.MaxInt64/sb {
			return nil, fmt.Errorf("storage %s: numel %d overflows", key, numel)
		}
		want = numel * sb
	}
	if m.UncompressedSize64 != uint64(want) {
		return nil, fmt.Errorf("storage %s: member holds %d bytes, the pickle claims %d", key, m.UncompressedSize64, want)
	}
	if m.Method == zip.Store {
		// a stored member's bytes are read in place: they must lie in the file
		off, err := m.DataOffset()
		if err != nil || m.CompressedSize64 != m.UncompressedSize64 || off < 0 || uint64(off)+m.CompressedSize64 > uint64(a.size) {
			return nil, fmt.Errorf("storage %s: member %s of %d bytes does not lie inside the %d-byte file", key, m.Name, m.UncompressedSize64, a.size)
		}
	}
	st := &ptStorage{key: key, dtype: cls.dt, numel: numel, member: m}
	a.storages[key] = st
	return st, nil
}

// ptDict is an ordered dict of a decoded pickle.
type ptDict struct {
	keys []string
	vals map[string]interface{}
}

// ptValue converts gopickle's values into the closed set a tensor file may hold.
func ptValue(v interface{}, depth int) (interface{}, error) {
	if depth > maxPickleDepth {
		return nil, fmt.Errorf("containers nested deeper than %d", maxPickleDepth)
	}
	switch x := v.(type) {
	case nil, string, bool, float64, *ptTensor:
		return x, nil
	case int:
		return int64(x), nil
	case int64:
		return x, nil
	case *big.Int:
		if x.IsInt64() {
			return x.Int64(), nil
		}
		return x.String(), nil
	case *types.Tuple:
		return ptList(*x, depth)
	case *types.List:
		return ptList(*x, depth)
	case *types.Dict:
		d := &ptDict{vals: map[string]interface{}{}}
		for _, e := range *x {
			if err := d.set(e.Key, e.Value, depth); err != nil {
				return nil, err
			}
		}
		return d, nil
	case *types.OrderedDict:
		d := &ptDict{vals: map[string]interface{}{}}
		for e := x.List.Front(); e != nil; e = e.Next() {
			oe := e.Value.(*types.OrderedDictEntry)
			if err := d.set(oe.Key, oe.Value, depth); err != nil {
				return nil, err
			}
		}
		return d, nil
	case *ptDTypeValue:
		return "torch." + x.name, nil
	}
	return nil, fmt.Errorf("pickle constructs a %T, which a tensor file may not hold", v)
}

func ptList(items []interface{}, depth int) ([]interface{}, error) {
	out := make([]interface{}, len(items))
	for i, it := range items {
		v, err := ptValue(it, depth+1)
		if err != nil {
			return nil, err
		}
		out[i] = v
	}
	return out, nil
}

func (d *ptDict) set(k, v interface{}, depth int) error {
	var key string
	switch x := k.(type) {
	case string:
		key = x
	case int:
		key = strconv.Itoa(x)
	case int64:
		key = strconv.FormatInt(x, 10)
	default:
		return fmt.Errorf("dict key of type %T", k)
	}
	val, err := ptValue(v, depth+1)
	if err != nil {
		return err
	}
	if _, dup := d.vals[key]; !dup {
		d.keys = append(d.keys, key)
	}
	d.vals[key] = val
	return nil
}

// ptFlatten lists the tensors of a decoded value as (name, tensor), names
// joined with "." (dict keys, list indexes), and the non-tensor leaves as
// "name" -> printed value.
func ptFlatten(prefix string, v interface{}, tensors *[]ptNamed, meta map[string]string) {
	join := func(k string) string {
		if prefix == "" {
			return k
		}
		return prefix + "." + k
	}
	switch x := v.(type) {
	case *ptTensor:
		*tensors = append(*tensors, ptNamed{prefix, x})
	case *ptDict:
		for _, k := range x.keys {
			ptFlatten(join(k), x.vals[k], tensors, meta)
		}
	case []interface{}:
		for i, it := range x {
			ptFlatten(join(strconv.Itoa(i)), it, tensors, meta)
		}
	default:
		if meta != nil {
			meta[prefix] = fmt.Sprint(x)
		}
	}
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

// scanPickle walks the opcodes of a pickle and checks that every length it
// claims (strings, bytes, frames) fits in the bytes left, that every opcode
// is one a torch.save pickle may use, and that every text GLOBAL is on the
// allow-list. It runs before gopickle so that gopickle never allocates a
// claimed length larger than the file.
func scanPickle(b []byte) error {
	le := binary.LittleEndian
	i := 0
	need := func(n uint64) error {
		if n > uint64(len(b)-i) {
			return fmt.Errorf("pickle opcode at offset %d claims %d bytes, %d left", i, n, len(b)-i)
		}
		return nil
	}
	line := func() (string, error) {
		j := bytes.IndexByte(b[i:], '\n')
		if j < 0 {
			return "", fmt.Errorf("pickle: unterminated line at offset %d", i)
		}
		s := string(b[i : i+j])
		i += j + 1
		return s, nil
	}
	for i < len(b) {
		op := b[i]
		at := i
		i++
		switch op {
		case '(', '.', '0', '1', '2', 'N', 'Q', 'R', 'a', 'b', 'd', '}', 'e', 'l', ']', 's', 't', ')', 'u',
			0x85, 0x86, 0x87, 0x88, 0x89, 0x8f, 0x90, 0x91, 0x93, 0x94:
			if op == '.' {
				return nil
			}
		case 'K', 'h', 'q', 0x80:
			if err := need(1); err != nil {
				return err
			}
			i++
		case 'M':
			if err := need(2); err != nil {
				return err
			}
			i += 2
		case 'J', 'j', 'r':
			if err := need(4); err != nil {
				return err
			}
			i += 4
		case 'G':
			if err := need(8); err != nil {
				return err
			}
			i += 8
		case 0x95: // FRAME
			if err := need(8); err != nil {
				return err
			}
			n := le.Uint64(b[i:])
			i += 8
			if err := need(n); err != nil {
				return err
			}
		case 'U', 'C', 0x8c, 0x8a: // 1-byte length
			if err := need(1); err != nil {
				return err
			}
			n := uint64(b[i])
			i++
			if err := need(n); err != nil {
				return err
			}
			i += int(n)
		case 'T', 'B', 'X', 0x8b: // 4-byte length
			if err := need(4); err != nil {
				return err
			}
			n := uint64(le.Uint32(b[i:]))
			if op == 'T' || op == 0x8b {
				if int32(le.Uint32(b[i:])) < 0 {
					return fmt.Errorf("pickle opcode at offset %d: negative length", at)
				}
			}
			i += 4
			if err := need(n); err != nil {
				return err
			}
			i += int(n)
		case 0x8d, 0x8e, 0x96: // 8-byte length
			if err := need(8); err != nil {
				return err
			}
			n := le.Uint64(b[i:])
			i += 8
			if err := need(n); err != nil {
				return err
			}
			i += int(n)
		case 'I', 'L', 'F', 'S', 'V', 'g', 'p':
			if _, err := line(); err != nil {
				return err
			}
		case 'c': // GLOBAL module\nname\n
			mod, err := line()
			if err != nil {
				return err
			}
			name, err := line()
			if err != nil {
				return err
			}
			if _, err := ptAllowed(mod, name); err != nil {
				return fmt.Errorf("offset %d: %w", at, err)
			}
		default:
			return fmt.Errorf("pickle opcode 0x%02x at offset %d is not allowed in a tensor file", op, at)
		}
	}
	return errors.New("pickle has no STOP opcode")
}

// addPT indexes the tensors of a torch.save file.
func (d *Dump) addPT(path, rel string, prevFix *[]int) error {
	f, size, src, err := d.addSource(path)
	if err != nil {
		return err
	}
	obj, err := readTorchSave(f, size, path)
	if err != nil {
		return err
	}
	var ts []ptNamed
	meta := map[string]string{}
	// SGLang dumper files: {"value": tensor, "meta": {...}}.
	if dd, ok := obj.(*ptDict); ok && len(dd.keys) == 2 && dd.vals["meta"] != nil {
		if _, ok := dd.vals["value"]; ok {
			ptFlatten("", dd.vals["meta"], &ts, meta)
			ts = ts[:0]
			ptFlatten("", dd.vals["value"], &ts, nil)
			if len(ts) == 0 {
				// SGLang also dumps non-tensor values (e.g. the request ids
				// "rids", a list of strings): listed, not indexed
				d.Unmapped = append(d.Unmapped, fmt.Sprintf("%s: %s (value is not a tensor)", rel, meta["name"]))
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
					ts[i].name = base + "." + ts[i].name
				}
			}
			goto index
		}
	}
	ptFlatten("", obj, &ts, nil)
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

// loadPickle runs gopickle, turning a panic inside it (e.g. an unhashable
// OrderedDict key in a hostile file) into an error.
func loadPickle(u *pickle.Unpickler) (obj interface{}, err error) {
	defer func() {
		if r := recover(); r != nil {
			obj, err = nil, fmt.Errorf("malformed pickle: %v", r)
		}
	}()
	return u.Load()
}
