package dump

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// claimFile is a native file whose header frame's meta is meta (raw
// msgpack bytes), optionally followed by more frames.
func claimFile(meta []byte, more ...[]byte) []byte {
	b := append([]byte(Magic), 1, 0, 0, 0)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(meta)))
	b = append(b, meta...)
	for _, m := range more {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(m)))
		b = append(b, m...)
	}
	return b
}

// mpStr is a msgpack fixstr.
func mpStr(s string) []byte { return append([]byte{0xa0 | byte(len(s))}, s...) }

func cat(bs ...[]byte) []byte { return bytes.Join(bs, nil) }

var (
	arr32Huge = []byte{0xdd, 0xff, 0xff, 0xff, 0xff} // array of 4294967295 values
	map32Huge = []byte{0xdf, 0xff, 0xff, 0xff, 0xff} // map of 4294967295 pairs
	str32Huge = []byte{0xdb, 0xff, 0xff, 0xff, 0xff} // string of 4 GiB
	arr32Mid  = []byte{0xdd, 0x10, 0x00, 0x00, 0x00} // 268435456 values (the 2 GB / 10 s case)
)

// claimCases are native files whose msgpack meta claims lengths its bytes do
// not back: each must fail with an error naming the frame, allocating
// nothing near the claim.
func claimCases() map[string][]byte {
	hdr := func(field string, v []byte) []byte {
		return claimFile(cat([]byte{0x82}, mpStr("t"), mpStr("header"), mpStr("header"), []byte{0x81}, mpStr(field), v))
	}
	okHeader := cat([]byte{0x82}, mpStr("t"), mpStr("header"), mpStr("header"), []byte{0x80})
	tensor := func(field string, v []byte) []byte {
		return claimFile(okHeader, cat([]byte{0x82}, mpStr("t"), mpStr("tensor"), mpStr(field), v))
	}
	page := func(v []byte) []byte {
		return claimFile(okHeader, cat([]byte{0x82}, mpStr("t"), mpStr("tensor"), mpStr("page"), []byte{0x81}, mpStr("block_table"), v))
	}
	deep := cat([]byte{0x81}, mpStr("t"))
	for i := 0; i < 100000; i++ {
		deep = append(deep, 0x91)
	}
	deep = append(deep, 0x00)
	return map[string][]byte{
		"compress_ratios 4G":     hdr("compress_ratios", arr32Huge),
		"compress_ratios 256M":   hdr("compress_ratios", arr32Mid),
		"dtype_policy map 4G":    hdr("dtype_policy", map32Huge),
		"user map 4G":            hdr("user", map32Huge),
		"model_args string 4G":   hdr("model_args", str32Huge),
		"shape 4G":               tensor("shape", arr32Huge),
		"shape 256M":             tensor("shape", arr32Mid),
		"block_table 4G":         page(arr32Huge),
		"unknown field array 4G": tensor("zzz", arr32Huge),
		"nested 100000 deep":     claimFile(deep),
		"bin32 4G":               tensor("zzz", []byte{0xc6, 0xff, 0xff, 0xff, 0xff}),
		"ext32 4G":               tensor("zzz", []byte{0xc9, 0xff, 0xff, 0xff, 0xff, 0x01}),
	}
}

// TestMsgpackClaims: every claim case fails at Open and in the stream
// reader, with the frame in the error, allocating under 16 MiB.
func TestMsgpackClaims(t *testing.T) {
	dir := t.TempDir()
	for name, b := range claimCases() {
		p := filepath.Join(dir, "claim.smd")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		d, err := Open(p)
		serr := streamAll(b)
		runtime.ReadMemStats(&after)
		if err == nil {
			d.Close()
			t.Errorf("%s: Open accepted it", name)
			continue
		}
		if serr == nil {
			t.Errorf("%s: stream reader accepted it", name)
		}
		if !strings.Contains(err.Error(), "claim.smd: record ") || !strings.Contains(err.Error(), "msgpack") {
			t.Errorf("%s: error %q does not name the file, record and cause", name, err)
		}
		if a := after.TotalAlloc - before.TotalAlloc; a > 16<<20 {
			t.Errorf("%s: allocated %d MiB", name, a>>20)
		}
	}
}

// TestMsgpackCheckAcceptsWriter: every frame the Writer writes passes the
// check with its exact length (keyed() covers pages, prefix hits and every
// header field).
func TestMsgpackCheckAcceptsWriter(t *testing.T) {
	b := writeNative(t, keyed(), PrefixHit{Request: "a", Source: "b", Tokens: 3})
	off := fileHeaderLen
	frames := 0
	for off < len(b) {
		ml := int(binary.LittleEndian.Uint32(b[off:]))
		meta := b[off+4 : off+4+ml]
		n, err := checkMsgpack(meta)
		if err != nil || n != ml {
			t.Fatalf("frame %d: check says %d, %v; meta is %d bytes", frames, n, err, ml)
		}
		var m frameMeta
		if err := msgpack.Unmarshal(meta, &m); err != nil {
			t.Fatal(err)
		}
		off += 4 + ml + int(m.NBytes)
		frames++
	}
	if frames < 4 {
		t.Fatalf("only %d frames", frames)
	}
}

// FuzzMsgpackCheck: the check agrees with the library's own Skip about
// where a well-formed value ends, and accepts every value the library can
// skip whose nesting is within the limit.
func FuzzMsgpackCheck(f *testing.F) {
	f.Add(writeNative(f, keyed())[fileHeaderLen+4:])
	for _, b := range claimCases() {
		if len(b) < 4096 {
			f.Add(b[fileHeaderLen+4:])
		}
	}
	f.Add([]byte{0x92, 0xc7, 0x01, 0x05, 0xaa, 0xd4, 0x01, 0x02})
	f.Fuzz(func(t *testing.T, b []byte) {
		n, err := checkMsgpack(b)
		if err != nil {
			return
		}
		// The check passed: the library must skip exactly n bytes.
		br := bytes.NewReader(b)
		dec := msgpack.NewDecoder(br)
		if serr := dec.Skip(); serr != nil {
			t.Fatalf("check accepted %d bytes the library cannot skip: %v", n, serr)
		}
		if br.Len() != len(b)-n {
			t.Fatalf("check says the value is %d of %d bytes, the library leaves %d", n, len(b), br.Len())
		}
	})
}
