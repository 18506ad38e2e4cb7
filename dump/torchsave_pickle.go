package dump

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/big"
	"strconv"

	"github.com/nlpodyssey/gopickle/pickle"
	"github.com/nlpodyssey/gopickle/types"

	"sparsemla/userfile"
)

// The data.pkl member of a torch.save file (torchsave.go reads the zip).
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

// maxPickleDepth bounds the nesting of containers walked after decoding.
const maxPickleDepth = 64

// maxPickleLong bounds the bytes of a LONG1 / LONG4 integer (little-endian
// two's complement). gopickle decodes a longer one in time quadratic in its
// length (a 10 MiB LONG4 takes hours); a tensor file's integers (sizes,
// strides, offsets, element counts) are int64s, which need at most 8.
const maxPickleLong = 8

// maxPickleIntText bounds the text of an INT / LONG opcode ("I123\n",
// "L123L\n"), parsed by math/big past 64 bits in time quadratic in its
// length. An int64 is at most 20 characters, and "L" adds one.
const maxPickleIntText = 24

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
		return nil, fmt.Errorf("%s: storage offset %s", r.name, ptDescribe(args[1]))
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
		return nil, fmt.Errorf("%s: size %s and stride %s differ in rank", r.name, userfile.Dims(size), userfile.Dims(stride))
	}
	return newPtTensor(st, dt, fp4, off, size, stride)
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
	return 0, fmt.Errorf("%s (%T) is not an integer", ptDescribe(v), v)
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
	return nil, fmt.Errorf("pickle names global %s.%s, which a tensor file may not name (allowed: torch._utils._rebuild_tensor_v2/_v3/_rebuild_parameter, torch storage classes and dtypes, collections.OrderedDict)", userfile.Clip(module), userfile.Clip(name))
}

// ptDict is an ordered dict of a decoded pickle.
type ptDict struct {
	keys []string
	vals map[string]interface{}
}

// ptNameBytesPerPickleByte and minPtNameBytes budget the names of a pickle
// of n bytes: the dict keys the walk visits (ptWalk) and, apart, the dotted
// names built from them (ptFlat) may each hold ptNameBytesPerPickleByte*n
// bytes, and at least minPtNameBytes. A state dict spells its keys out (a
// flat one has no more name bytes than its keys hold); nested dicts repeat
// short keys and prefixes, but every tensor costs tens of pickle bytes.
const (
	ptNameBytesPerPickleByte = 8
	minPtNameBytes           = 1 << 20
)

// ptNameBudget is the name-byte budget of a pickle of n bytes:
// ptNameBytesPerPickleByte a byte, and at least minPtNameBytes.
func ptNameBudget(n int) int64 { return ptNameBytesPerPickleByte*int64(n) + minPtNameBytes }

// ptWalk converts gopickle's values into the closed set a tensor file may
// hold. A pickle can name one container many times (its memo), so the tree it
// spells can be exponentially larger than the file: 40 nested tuples that
// each hold the one before twice are 2^40 values in a few hundred bytes. The
// walk therefore counts every value it visits against left, set from the
// pickle's length (a tensor file's values are spelled out, or are strings and
// tensors named again at two bytes a name), and stops when it runs out.
// Each dict key it visits is hashed, so their bytes are counted too: the
// memo can name one long key under many dicts.
type ptWalk struct {
	left     int64 // values the walk may still visit
	limit    int64 // the budget it started with, for the error
	keyLeft  int64 // dict key bytes the walk may still visit
	keyLimit int64
}

// newPtWalk budgets a walk of the pickle of n bytes: 4 values a byte, and at
// least 1<<16; key bytes as ptNameBytesPerPickleByte says.
func newPtWalk(n int) *ptWalk {
	l := 4*int64(n) + 1<<16
	k := ptNameBudget(n)
	return &ptWalk{left: l, limit: l, keyLeft: k, keyLimit: k}
}

// value converts v (at nesting depth) and what it holds.
func (w *ptWalk) value(v interface{}, depth int) (interface{}, error) {
	if depth > maxPickleDepth {
		return nil, fmt.Errorf("containers nested deeper than %d", maxPickleDepth)
	}
	if w.left--; w.left < 0 {
		return nil, fmt.Errorf("the pickle's containers hold more than %d values (one container named again and again): not a tensor file", w.limit)
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
		return w.list(*x, depth)
	case *types.List:
		return w.list(*x, depth)
	case *types.Dict:
		d := &ptDict{vals: map[string]interface{}{}}
		for _, e := range *x {
			if err := w.set(d, e.Key, e.Value, depth); err != nil {
				return nil, err
			}
		}
		return d, nil
	case *types.OrderedDict:
		d := &ptDict{vals: map[string]interface{}{}}
		for e := x.List.Front(); e != nil; e = e.Next() {
			oe := e.Value.(*types.OrderedDictEntry)
			if err := w.set(d, oe.Key, oe.Value, depth); err != nil {
				return nil, err
			}
		}
		return d, nil
	case *ptDTypeValue:
		return "torch." + x.name, nil
	}
	return nil, fmt.Errorf("pickle constructs a %T, which a tensor file may not hold", v)
}

func (w *ptWalk) list(items []interface{}, depth int) ([]interface{}, error) {
	out := make([]interface{}, len(items))
	for i, it := range items {
		v, err := w.value(it, depth+1)
		if err != nil {
			return nil, err
		}
		out[i] = v
	}
	return out, nil
}

// set converts a dict entry into d.
func (w *ptWalk) set(d *ptDict, k, v interface{}, depth int) error {
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
	if w.keyLeft -= int64(len(key)); w.keyLeft < 0 {
		return fmt.Errorf("the pickle's dict keys hold more than %d bytes in all (one long key named again and again): not a tensor file", w.keyLimit)
	}
	val, err := w.value(v, depth+1)
	if err != nil {
		return err
	}
	if _, dup := d.vals[key]; !dup {
		d.keys = append(d.keys, key)
	}
	d.vals[key] = val
	return nil
}

// ptDescribe names a decoded pickle value for an error message: a scalar by
// its value (a string quoted, at most 64 bytes of it), a container by its
// kind and length only. It never walks into a container: a pickle can make a
// container hold itself, and printing it with %v would never end.
func ptDescribe(v interface{}) string {
	switch x := v.(type) {
	case nil:
		return "None"
	case string:
		return userfile.Quote(x)
	case bool, int, int64, float64:
		return fmt.Sprint(x)
	case *big.Int:
		return fmt.Sprintf("an integer of %d bits", x.BitLen())
	case *types.Tuple:
		return "a tuple of " + count(x.Len(), "item", "items")
	case *types.List:
		return "a list of " + count(x.Len(), "item", "items")
	case *types.Dict:
		return "a dict of " + count(x.Len(), "entry", "entries")
	case *types.OrderedDict:
		return "an OrderedDict of " + count(x.Len(), "entry", "entries")
	}
	return fmt.Sprintf("a %T", v)
}

// count is "1 item" or "n items".
func count(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return strconv.Itoa(n) + " " + many
}

// scanPickle walks the opcodes of a pickle and checks that every length it
// claims (strings, bytes, frames) fits in the bytes left, that every opcode
// is one a torch.save pickle may use, that every integer fits the limits
// above, and that every text GLOBAL is on the allow-list. It runs before
// gopickle so that gopickle never allocates a claimed length larger than
// the file, nor decodes an integer in quadratic time.
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
	// The memo lets a string spelled once be pushed again and again, by GET
	// or DUP at two bytes a time, and gopickle hashes a string each time it
	// is set as an OrderedDict key: one 4 MiB key set into many dicts costs
	// time quadratic in the file. So the scan keeps a model of the stack
	// (stack[j]: the length of a string or bytes, notString for any other
	// value, markItem for a MARK) and of the memo (memo[k], the same for
	// slot k), and budgets the bytes of strings pushed again (reread), as
	// the walk budgets its keys.
	const notString, markItem = -1, -2
	var stack []int64
	memo := map[uint64]int64{}
	rereadLimit := ptNameBudget(len(b))
	reread := rereadLimit
	pop := func(n int) { // pops n items (fewer if the stack is shorter: gopickle fails there)
		stack = stack[:max(0, len(stack)-n)]
	}
	popMark := func() { // pops to the last MARK, and the MARK
		j := len(stack) - 1
		for j >= 0 && stack[j] != markItem {
			j--
		}
		stack = stack[:max(0, j)]
	}
	top := func() int64 {
		if len(stack) == 0 {
			return notString
		}
		return stack[len(stack)-1]
	}
	pushAgain := func(at int, l int64) error { // a value pushed again: GET, DUP
		if l < 0 {
			stack = append(stack, notString) // (a slot PUT from a MARK fails in gopickle)
			return nil
		}
		stack = append(stack, l)
		if reread -= l; reread < 0 {
			return fmt.Errorf("pickle at offset %d: strings pushed again from the memo hold more than %d bytes in all (one long string named again and again): not a tensor file", at, rereadLimit)
		}
		return nil
	}
	get := func(at int, k uint64) error {
		l, ok := memo[k]
		if !ok {
			l = notString
		}
		return pushAgain(at, l)
	}
	lineIndex := func() (uint64, error) { // the decimal memo index of GET / PUT
		at := i
		text, err := line()
		if err != nil {
			return 0, err
		}
		k, err := strconv.ParseUint(text, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("pickle: memo index %s at offset %d", ptDescribe(text), at)
		}
		return k, nil
	}
	for i < len(b) {
		op := b[i]
		at := i
		i++
		switch op {
		// Not the set opcodes (EMPTY_SET, ADDITEMS, FROZENSET): a tensor
		// file holds no set, and gopickle hashes every item added to one,
		// so one long string added to many sets takes time quadratic in
		// the file.
		case '.': // STOP
			return nil
		case '(': // MARK
			stack = append(stack, markItem)
		case ')', ']', '}', 'N', 0x88, 0x89: // empty tuple, list, dict; None, True, False
			stack = append(stack, notString)
		case '0': // POP
			pop(1)
		case '1': // POP_MARK
			popMark()
		case '2': // DUP
			if err := pushAgain(at, top()); err != nil {
				return err
			}
		case 't', 'l', 'd': // TUPLE, LIST, DICT from the items above the MARK
			popMark()
			stack = append(stack, notString)
		case 0x85, 0x86, 0x87: // TUPLE1, TUPLE2, TUPLE3
			pop(int(op - 0x84))
			stack = append(stack, notString)
		case 'a', 'b': // APPEND, BUILD: pop one into the item below
			pop(1)
		case 's': // SETITEM
			pop(2)
		case 'e', 'u': // APPENDS, SETITEMS
			popMark()
		case 'R': // REDUCE: callable and arguments, then the result
			pop(2)
			stack = append(stack, notString)
		case 'Q': // BINPERSID: the id, then the storage
			pop(1)
			stack = append(stack, notString)
		case 0x94: // MEMOIZE: the top into the next slot
			memo[uint64(len(memo))] = top()
		case 0x93:
			// STACK_GLOBAL takes module and name from the stack, where this
			// scan does not check them against the allow-list (and gopickle
			// resolves some builtins itself). torch.save writes protocol 2,
			// which has only the text GLOBAL.
			return fmt.Errorf("pickle STACK_GLOBAL at offset %d: a protocol 4 pickle, which is not read (torch.save's default pickle_protocol 2 writes none)", at)
		case 0x80: // PROTO
			if err := need(1); err != nil {
				return err
			}
			i++
		case 'K': // BININT1
			if err := need(1); err != nil {
				return err
			}
			i++
			stack = append(stack, notString)
		case 'h', 'q': // BINGET, BINPUT
			if err := need(1); err != nil {
				return err
			}
			k := uint64(b[i])
			i++
			if op == 'q' {
				memo[k] = top()
			} else if err := get(at, k); err != nil {
				return err
			}
		case 'M': // BININT2
			if err := need(2); err != nil {
				return err
			}
			i += 2
			stack = append(stack, notString)
		case 'J': // BININT
			if err := need(4); err != nil {
				return err
			}
			i += 4
			stack = append(stack, notString)
		case 'j', 'r': // LONG_BINGET, LONG_BINPUT
			if err := need(4); err != nil {
				return err
			}
			k := uint64(le.Uint32(b[i:]))
			i += 4
			if op == 'r' {
				memo[k] = top()
			} else if err := get(at, k); err != nil {
				return err
			}
		case 'G': // BINFLOAT
			if err := need(8); err != nil {
				return err
			}
			i += 8
			stack = append(stack, notString)
		case 0x95: // FRAME: the opcodes that follow are read on
			if err := need(8); err != nil {
				return err
			}
			n := le.Uint64(b[i:])
			i += 8
			if err := need(n); err != nil {
				return err
			}
		case 'U', 'C', 0x8c, 0x8a: // 1-byte length: SHORT_BINSTRING, SHORT_BINBYTES, SHORT_BINUNICODE, LONG1
			if err := need(1); err != nil {
				return err
			}
			n := uint64(b[i])
			if op == 0x8a && n > maxPickleLong {
				return fmt.Errorf("pickle LONG1 at offset %d: an integer of %d bytes (a tensor file's integers fit in %d)", at, n, maxPickleLong)
			}
			i++
			if err := need(n); err != nil {
				return err
			}
			i += int(n)
			if op == 0x8a {
				stack = append(stack, notString)
			} else {
				stack = append(stack, int64(n))
			}
		case 'T', 'B', 'X', 0x8b: // 4-byte length: BINSTRING, BINBYTES, BINUNICODE, LONG4
			if err := need(4); err != nil {
				return err
			}
			n := uint64(le.Uint32(b[i:]))
			if op == 'T' || op == 0x8b {
				if int32(le.Uint32(b[i:])) < 0 {
					return fmt.Errorf("pickle opcode at offset %d: negative length", at)
				}
			}
			if op == 0x8b && n > maxPickleLong {
				return fmt.Errorf("pickle LONG4 at offset %d: an integer of %d bytes (a tensor file's integers fit in %d)", at, n, maxPickleLong)
			}
			i += 4
			if err := need(n); err != nil {
				return err
			}
			i += int(n)
			if op == 0x8b {
				stack = append(stack, notString)
			} else {
				stack = append(stack, int64(n))
			}
		case 0x8d, 0x8e, 0x96: // 8-byte length: BINUNICODE8, BINBYTES8, BYTEARRAY8
			if err := need(8); err != nil {
				return err
			}
			n := le.Uint64(b[i:])
			i += 8
			if err := need(n); err != nil {
				return err
			}
			i += int(n)
			stack = append(stack, int64(n))
		case 'I', 'L':
			text, err := line()
			if err != nil {
				return err
			}
			if len(text) > maxPickleIntText {
				name := map[byte]string{'I': "INT", 'L': "LONG"}[op]
				return fmt.Errorf("pickle %s at offset %d: an integer of %d characters (a tensor file's integers fit in %d)", name, at, len(text), maxPickleIntText)
			}
			stack = append(stack, notString)
		case 'F': // FLOAT
			if _, err := line(); err != nil {
				return err
			}
			stack = append(stack, notString)
		case 'S', 'V': // STRING, UNICODE: a string on a line
			text, err := line()
			if err != nil {
				return err
			}
			stack = append(stack, int64(len(text)))
		case 'g', 'p': // GET, PUT with a decimal index
			k, err := lineIndex()
			if err != nil {
				return err
			}
			if op == 'p' {
				memo[k] = top()
			} else if err := get(at, k); err != nil {
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
			stack = append(stack, notString)
		default:
			return fmt.Errorf("pickle opcode 0x%02x at offset %d is not allowed in a tensor file", op, at)
		}
	}
	return errors.New("pickle has no STOP opcode")
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
