package prefixcheck

// The msgpack reader of the event decoder: every length checked against the
// bytes left, every error at its byte offset.

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strconv"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

type evReader struct {
	name string
	data []byte
	r    *bytes.Reader
	d    *msgpack.Decoder
}

func (e *evReader) off() int64 { return int64(len(e.data) - e.r.Len()) }

func (e *evReader) left() int { return e.r.Len() }

func (e *evReader) errf(at int64, format string, args ...any) error {
	return fmt.Errorf("prefixcheck: %s: byte %d: %s", e.name, at, fmt.Sprintf(format, args...))
}

func (e *evReader) peek() (byte, error) {
	at := e.off()
	c, err := e.d.PeekCode()
	if err != nil {
		return 0, e.errf(at, "truncated: %v", err)
	}
	return c, nil
}

// isNil consumes a nil if one is next.
func (e *evReader) isNil() (bool, error) {
	c, err := e.peek()
	if err != nil || c != msgpcode.Nil {
		return false, err
	}
	return true, e.d.DecodeNil()
}

// arrayLen reads an array header (nil: -1) and checks the claim (at least a
// byte an element) against the bytes left.
func (e *evReader) arrayLen(what string) (int, error) {
	at := e.off()
	c, err := e.peek()
	if err != nil {
		return 0, err
	}
	if c != msgpcode.Nil && !msgpcode.IsFixedArray(c) && c != msgpcode.Array16 && c != msgpcode.Array32 {
		return 0, e.errf(at, "%s: want an array, found msgpack code 0x%02x", what, c)
	}
	n, err := e.d.DecodeArrayLen()
	if err != nil {
		return 0, e.errf(at, "%s: %v", what, err)
	}
	if n > e.left() {
		return 0, e.errf(at, "%s: array of %d elements claimed, %d bytes left", what, n, e.left())
	}
	return n, nil
}

func (e *evReader) mapLen(what string) (int, error) {
	at := e.off()
	c, err := e.peek()
	if err != nil {
		return 0, err
	}
	if !msgpcode.IsFixedMap(c) && c != msgpcode.Map16 && c != msgpcode.Map32 {
		return 0, e.errf(at, "%s: want a map, found msgpack code 0x%02x", what, c)
	}
	n, err := e.d.DecodeMapLen()
	if err != nil {
		return 0, e.errf(at, "%s: %v", what, err)
	}
	if 2*n > e.left() {
		return 0, e.errf(at, "%s: map of %d entries claimed, %d bytes left", what, n, e.left())
	}
	return n, nil
}

// rawLen returns the length a str or bin header at the current position
// claims, checked against the bytes left, without consuming anything.
func (e *evReader) rawLen(what string, bin bool) (int, error) {
	at := e.off()
	b := e.data[at:]
	if len(b) == 0 {
		return 0, e.errf(at, "%s: truncated", what)
	}
	c := b[0]
	var n, hdr int
	switch {
	case !bin && msgpcode.IsFixedString(c):
		n, hdr = int(c&msgpcode.FixedStrMask), 1
	case !bin && c == msgpcode.Str8, bin && c == msgpcode.Bin8:
		if len(b) < 2 {
			return 0, e.errf(at, "%s: truncated length", what)
		}
		n, hdr = int(b[1]), 2
	case !bin && c == msgpcode.Str16, bin && c == msgpcode.Bin16:
		if len(b) < 3 {
			return 0, e.errf(at, "%s: truncated length", what)
		}
		n, hdr = int(binary.BigEndian.Uint16(b[1:])), 3
	case !bin && c == msgpcode.Str32, bin && c == msgpcode.Bin32:
		if len(b) < 5 {
			return 0, e.errf(at, "%s: truncated length", what)
		}
		u := binary.BigEndian.Uint32(b[1:])
		if int64(u) > int64(len(b)) {
			return 0, e.errf(at, "%s: %d bytes claimed, %d left", what, u, len(b)-5)
		}
		n, hdr = int(u), 5
	default:
		kind := "a string"
		if bin {
			kind = "bytes"
		}
		return 0, e.errf(at, "%s: want %s, found msgpack code 0x%02x", what, kind, c)
	}
	if n > len(b)-hdr {
		return 0, e.errf(at, "%s: %d bytes claimed, %d left", what, n, len(b)-hdr)
	}
	return n, nil
}

func (e *evReader) str(what string) (string, error) {
	if null, err := e.isNil(); null || err != nil {
		return "", err
	}
	at := e.off()
	n, err := e.rawLen(what, false)
	if err != nil {
		return "", err
	}
	if n > maxStrBytes {
		return "", e.errf(at, "%s: string of %d bytes (at most %d)", what, n, maxStrBytes)
	}
	s, err := e.d.DecodeString()
	if err != nil {
		return "", e.errf(at, "%s: %v", what, err)
	}
	return s, nil
}

// integer reads any msgpack integer as int64 (a uint64 above MaxInt64 is an
// error).
func (e *evReader) integer(what string) (int64, error) {
	at := e.off()
	c, err := e.peek()
	if err != nil {
		return 0, err
	}
	switch {
	case msgpcode.IsFixedNum(c), c == msgpcode.Int8, c == msgpcode.Int16, c == msgpcode.Int32, c == msgpcode.Int64,
		c == msgpcode.Uint8, c == msgpcode.Uint16, c == msgpcode.Uint32:
		v, err := e.d.DecodeInt64()
		if err != nil {
			return 0, e.errf(at, "%s: %v", what, err)
		}
		return v, nil
	case c == msgpcode.Uint64:
		u, err := e.d.DecodeUint64()
		if err != nil {
			return 0, e.errf(at, "%s: %v", what, err)
		}
		if u > 1<<63-1 {
			return 0, e.errf(at, "%s: %d does not fit an int64", what, u)
		}
		return int64(u), nil
	}
	return 0, e.errf(at, "%s: want an integer, found msgpack code 0x%02x", what, c)
}

func (e *evReader) optInt(what string) (*int64, error) {
	if null, err := e.isNil(); null || err != nil {
		return nil, err
	}
	v, err := e.integer(what)
	return &v, err
}

// hash reads a block hash: an int (signed or unsigned 64-bit) or bytes.
func (e *evReader) hash(what string) (BlockHash, error) {
	at := e.off()
	c, err := e.peek()
	if err != nil {
		return "", err
	}
	switch {
	case c == msgpcode.Uint64:
		u, err := e.d.DecodeUint64()
		if err != nil {
			return "", e.errf(at, "%s: %v", what, err)
		}
		return BlockHash(strconv.FormatUint(u, 10)), nil
	case c == msgpcode.Bin8 || c == msgpcode.Bin16 || c == msgpcode.Bin32:
		n, err := e.rawLen(what, true)
		if err != nil {
			return "", err
		}
		if n == 0 || n > maxHashBytes {
			return "", e.errf(at, "%s: a %d-byte hash (1 to %d)", what, n, maxHashBytes)
		}
		b, err := e.d.DecodeBytes()
		if err != nil {
			return "", e.errf(at, "%s: %v", what, err)
		}
		return BlockHash("0x" + hex.EncodeToString(b)), nil
	}
	v, err := e.integer(what)
	if err != nil {
		return "", e.errf(at, "%s: want an int or bytes block hash, found msgpack code 0x%02x", what, c)
	}
	return BlockHash(strconv.FormatInt(v, 10)), nil
}

func (e *evReader) hashes(what string) ([]BlockHash, error) {
	n, err := e.arrayLen(what)
	if err != nil || n < 0 {
		if n < 0 {
			err = e.errf(e.off(), "%s: null", what)
		}
		return nil, err
	}
	out := make([]BlockHash, 0, n)
	for i := 0; i < n; i++ {
		h, err := e.hash(fmt.Sprintf("%s[%d]", what, i))
		if err != nil {
			return nil, err
		}
		out = append(out, h)
	}
	return out, nil
}

// skip skips one value of any type, nesting at most maxNesting deep, checking
// every claimed length.
func (e *evReader) skip(what string, depth int) error {
	at := e.off()
	if depth > maxNesting {
		return e.errf(at, "%s: nested deeper than %d", what, maxNesting)
	}
	c, err := e.peek()
	if err != nil {
		return err
	}
	switch {
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		n, err := e.arrayLen(what)
		if err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			if err := e.skip(what, depth+1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		n, err := e.mapLen(what)
		if err != nil {
			return err
		}
		for i := 0; i < 2*n; i++ {
			if err := e.skip(what, depth+1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsString(c):
		if _, err := e.rawLen(what, false); err != nil {
			return err
		}
	case msgpcode.IsBin(c):
		if _, err := e.rawLen(what, true); err != nil {
			return err
		}
	case msgpcode.IsExt(c):
		return e.errf(at, "%s: msgpack extension type 0x%02x not expected", what, c)
	}
	if err := e.d.Skip(); err != nil {
		return e.errf(at, "%s: %v", what, err)
	}
	return nil
}

// raw returns the msgpack bytes of the next value (skipped), "" for nil.
func (e *evReader) raw(what string) (string, error) {
	if null, err := e.isNil(); null || err != nil {
		return "", err
	}
	from := e.off()
	if err := e.skip(what, 0); err != nil {
		return "", err
	}
	return string(e.data[from:e.off()]), nil
}
