package dump

import (
	"encoding/binary"
	"fmt"
)

// maxMetaDepth bounds the nesting of a frame's meta map (the format needs 3:
// frame -> header -> a string map; unknown fields may add a few).
const maxMetaDepth = 16

// checkMsgpack walks the msgpack value at the start of b without decoding
// it and checks that every length it claims is backed by bytes that are
// there: a string, binary or extension of n bytes needs n bytes, an array of
// n values at least n bytes and a map of n pairs at least 2n bytes, every
// value must end inside b, and containers nest at most maxMetaDepth deep.
// It runs before msgpack.Unmarshal because vmihailenco/msgpack v5.4.1 sizes
// a decoded slice by its claimed length (decode_slice.go: decodeSliceValue
// tests `d.flags&disableAllocLimitFlag != 1`, which is always true, so its
// 1e6-element alloc limit never applies): a 46-byte frame claiming a
// 4-billion-element []int would make it allocate 32 GB. After this check
// the claims are true, so what the decoder allocates is bounded by len(b).
// It returns the length of the value.
func checkMsgpack(b []byte) (int, error) {
	off := 0
	// pending[i]: values still to read in the container at depth i.
	pending := []uint64{1}
	for len(pending) > 0 {
		if pending[len(pending)-1] == 0 {
			pending = pending[:len(pending)-1]
			continue
		}
		pending[len(pending)-1]--
		if off >= len(b) {
			return 0, fmt.Errorf("msgpack: value at byte %d: truncated", off)
		}
		c := b[off]
		at := off
		off++
		// uintN reads an n-byte big-endian length.
		uintN := func(n int) (uint64, error) {
			if len(b)-off < n {
				return 0, fmt.Errorf("msgpack: value at byte %d: truncated length", at)
			}
			var v uint64
			switch n {
			case 1:
				v = uint64(b[off])
			case 2:
				v = uint64(binary.BigEndian.Uint16(b[off:]))
			case 4:
				v = uint64(binary.BigEndian.Uint32(b[off:]))
			}
			off += n
			return v, nil
		}
		skip := func(n uint64, what string) error {
			if n > uint64(len(b)-off) {
				return fmt.Errorf("msgpack: %s at byte %d claims %d bytes, %d are left", what, at, n, len(b)-off)
			}
			off += int(n)
			return nil
		}
		var items uint64 // values of a container, 0 for a scalar
		container := false
		var err error
		switch {
		case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
			// fixint, nil, bool
		case c >= 0x80 && c <= 0x8f:
			items, container = 2*uint64(c&0x0f), true
		case c >= 0x90 && c <= 0x9f:
			items, container = uint64(c&0x0f), true
		case c >= 0xa0 && c <= 0xbf:
			err = skip(uint64(c&0x1f), "string")
		case c == 0xc1:
			return 0, fmt.Errorf("msgpack: byte %d: code 0xc1 is never used", at)
		case c == 0xc4, c == 0xc5, c == 0xc6, c == 0xd9, c == 0xda, c == 0xdb:
			var n uint64
			if n, err = uintN(lenWidth(c)); err == nil {
				err = skip(n, "string")
			}
		case c == 0xc7, c == 0xc8, c == 0xc9:
			var n uint64
			if n, err = uintN(lenWidth(c)); err == nil {
				err = skip(n+1, "extension")
			}
		case c == 0xca, c == 0xce, c == 0xd2:
			err = skip(4, "number")
		case c == 0xcb, c == 0xcf, c == 0xd3:
			err = skip(8, "number")
		case c == 0xcc, c == 0xd0:
			err = skip(1, "number")
		case c == 0xcd, c == 0xd1:
			err = skip(2, "number")
		case c >= 0xd4 && c <= 0xd8:
			err = skip(1+uint64(1)<<(c-0xd4), "extension")
		case c == 0xdc, c == 0xdd:
			container = true
			items, err = uintN(lenWidth(c))
		case c == 0xde, c == 0xdf:
			container = true
			items, err = uintN(lenWidth(c))
			items *= 2
		}
		if err != nil {
			return 0, err
		}
		if !container {
			continue
		}
		if items > uint64(len(b)-off) {
			kind := "array"
			if c&0xf0 == 0x80 || c == 0xde || c == 0xdf {
				kind = "map"
			}
			return 0, fmt.Errorf("msgpack: %s at byte %d claims %d values, only %d bytes are left", kind, at, items, len(b)-off)
		}
		if items > 0 {
			if len(pending) >= maxMetaDepth {
				return 0, fmt.Errorf("msgpack: byte %d: nested deeper than %d", at, maxMetaDepth)
			}
			pending = append(pending, items)
		}
	}
	return off, nil
}

// lenWidth is the width in bytes of the length that follows code c
// (str8/bin8/ext8: 1, the 16-bit forms 2, the 32-bit forms 4).
func lenWidth(c byte) int {
	switch c {
	case 0xc4, 0xc7, 0xd9:
		return 1
	case 0xc5, 0xc8, 0xda, 0xdc, 0xde:
		return 2
	}
	return 4
}
