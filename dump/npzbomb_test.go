package dump

import (
	"archive/zip"
	"bytes"
	"compress/flate"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// npyPreamble is a v1 .npy header for shape (n,) of descr.
func npyPreamble(descr string, n int64) []byte {
	dict := "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + itoa(n) + ",), }"
	for (10+len(dict)+1)%64 != 0 {
		dict += " "
	}
	dict += "\n"
	return append(append([]byte("\x93NUMPY\x01\x00"), byte(len(dict)), byte(len(dict)>>8)), dict...)
}

func itoa(n int64) string {
	if n == 0 {
		return "0"
	}
	var b []byte
	for ; n > 0; n /= 10 {
		b = append([]byte{byte('0' + n%10)}, b...)
	}
	return string(b)
}

// zeroBomb writes to w a raw deflate stream of hdr followed by zeros
// MiB of zeros, without deflating them: one sync-flushed block of 1 MiB of
// zeros is repeated (its back-references only ever see zeros). It returns
// the uncompressed size and CRC-32.
func zeroBomb(tb testing.TB, w io.Writer, hdr []byte, zeros int) (int64, uint32) {
	var first, chunk bytes.Buffer
	fw, _ := flate.NewWriter(&first, flate.BestCompression)
	fw.Write(hdr)
	fw.Flush()
	cw, _ := flate.NewWriter(&chunk, flate.BestCompression)
	mib := make([]byte, 1<<20)
	cw.Write(mib)
	cw.Flush()
	if _, err := w.Write(first.Bytes()); err != nil {
		tb.Fatal(err)
	}
	crc := crc32.ChecksumIEEE(hdr)
	for i := 0; i < zeros; i++ {
		if _, err := w.Write(chunk.Bytes()); err != nil {
			tb.Fatal(err)
		}
		crc = crc32.Update(crc, crc32.IEEETable, mib)
	}
	// Final empty block: BFINAL=1, fixed Huffman, end-of-block.
	if _, err := w.Write([]byte{0x03, 0x00}); err != nil {
		tb.Fatal(err)
	}
	return int64(len(hdr)) + int64(zeros)<<20, crc
}

// writeZeroBombNpz writes an .npz of members deflated members, each an npy
// header followed by mib MiB of zeros (u1).
func writeZeroBombNpz(tb testing.TB, path string, members, mib int) {
	f, err := os.Create(path)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	zw := zip.NewWriter(f)
	for m := 0; m < members; m++ {
		hdr := npyPreamble("|u1", int64(mib)<<20)
		var comp bytes.Buffer
		size, crc := zeroBomb(tb, &comp, hdr, mib)
		w, err := zw.CreateRaw(&zip.FileHeader{Name: "L" + itoa(int64(m)) + ".q.npy", Method: zip.Deflate,
			CRC32: crc, CompressedSize64: uint64(comp.Len()), UncompressedSize64: uint64(size)})
		if err != nil {
			tb.Fatal(err)
		}
		if _, err := w.Write(comp.Bytes()); err != nil {
			tb.Fatal(err)
		}
	}
	if err := zw.Close(); err != nil {
		tb.Fatal(err)
	}
}

// measure runs fn and returns its wall time and the bytes it allocated.
func measure(fn func()) (time.Duration, uint64) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	t0 := time.Now()
	fn()
	d := time.Since(t0)
	runtime.ReadMemStats(&after)
	return d, after.TotalAlloc - before.TotalAlloc
}

// TestNpzZipBomb: a 1 GiB deflated member of about 1 MB on disk, and 200
// members of 64 MiB each, are indexed by inflating their npy headers only
// (it used to take 87 s and 7.4 GB, and to never finish); reading the 1 GiB
// member is refused by the ratio limit instead of inflated.
func TestNpzZipBomb(t *testing.T) {
	if testing.Short() {
		t.Skip("writes 13 MB")
	}
	dir := t.TempDir()
	one := filepath.Join(dir, "bomb1g.npz")
	writeZeroBombNpz(t, one, 1, 1024)
	if fi, _ := os.Stat(one); fi.Size() > 2<<20 {
		t.Fatalf("bomb is %d bytes", fi.Size())
	}
	var d *Dump
	var err error
	el, alloc := measure(func() { d, err = Open(one) })
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	t.Logf("1 GiB member: indexed in %v, %d KiB allocated", el, alloc>>10)
	if alloc > 16<<20 || el > 10*time.Second {
		t.Errorf("indexing the 1 GiB member: %v, %d MiB", el, alloc>>20)
	}
	if len(d.Entries) != 1 || d.Entries[0].NBytes != 1<<30 {
		t.Fatalf("entries %+v", d.Entries)
	}
	el, alloc = measure(func() { _, err = d.Read(&d.Entries[0]) })
	if err == nil || !strings.Contains(err.Error(), "np.savez") {
		t.Errorf("reading the bomb: %v", err)
	}
	if alloc > 16<<20 {
		t.Errorf("refusing the bomb allocated %d MiB", alloc>>20)
	}

	many := filepath.Join(dir, "bomb200.npz")
	writeZeroBombNpz(t, many, 200, 64)
	var d2 *Dump
	el, alloc = measure(func() { d2, err = Open(many) })
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	t.Logf("200 x 64 MiB members: indexed in %v, %d KiB allocated", el, alloc>>10)
	if len(d2.Entries) != 200 || el > 10*time.Second || alloc > 64<<20 {
		t.Errorf("200 members: %d entries, %v, %d MiB", len(d2.Entries), el, alloc>>20)
	}
}

// TestNpzDeflatedRead: a deflated member below the ratio-free size reads
// back exactly; a corrupt CRC, a member longer or shorter than its
// directory entry are errors at Read.
func TestNpzDeflatedRead(t *testing.T) {
	payload := bytes.Repeat([]byte{1, 2, 3, 4, 5, 6, 7, 8}, 1000)
	hdr := npyPreamble("|u1", int64(len(payload)))
	full := append(append([]byte(nil), hdr...), payload...)
	build := func(crcDelta uint32, sizeDelta int64) string {
		var comp bytes.Buffer
		fw, _ := flate.NewWriter(&comp, flate.DefaultCompression)
		fw.Write(full)
		fw.Close()
		var buf bytes.Buffer
		zw := zip.NewWriter(&buf)
		w, err := zw.CreateRaw(&zip.FileHeader{Name: "L0.q.npy", Method: zip.Deflate, CRC32: crc32.ChecksumIEEE(full) + crcDelta,
			CompressedSize64: uint64(comp.Len()), UncompressedSize64: uint64(int64(len(full)) + sizeDelta)})
		if err != nil {
			t.Fatal(err)
		}
		w.Write(comp.Bytes())
		zw.Close()
		p := filepath.Join(t.TempDir(), "m.npz")
		os.WriteFile(p, buf.Bytes(), 0o644)
		return p
	}
	read := func(p string) ([]byte, error) {
		d, err := Open(p)
		if err != nil {
			return nil, err
		}
		defer d.Close()
		r, err := d.Read(&d.Entries[0])
		return r.Data, err
	}
	if got, err := read(build(0, 0)); err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("clean member: %d bytes, %v", len(got), err)
	}
	if _, err := read(build(1, 0)); err == nil {
		t.Error("corrupt CRC read without error")
	}
	for _, delta := range []int64{-8, 8} {
		if _, err := read(build(0, delta)); err == nil {
			t.Errorf("size off by %d read without error", delta)
		}
	}
}

// TestZipInflationLimit: the ratio limit shared by .npz members and deflated
// torch.save storages: free below NpzRatioFree, NpzMaxRatio:1 above it.
func TestZipInflationLimit(t *testing.T) {
	for _, c := range []struct {
		comp, size uint64
		ok         bool
	}{
		{1 << 10, NpzRatioFree, true},             // small: any ratio
		{1 << 20, 1 << 30, false},                 // 1 GiB from 1 MiB: 1024:1
		{(1 << 30) / NpzMaxRatio, 1 << 30, true},  // exactly the limit
		{(1<<30)/NpzMaxRatio - 1, 1 << 30, false}, // just past it
		{1 << 40, MaxNpzMember + 1, false},        // past the member cap
	} {
		f := &zip.File{FileHeader: zip.FileHeader{Name: "m", CompressedSize64: c.comp, UncompressedSize64: c.size}}
		err := checkZipInflation(f, "hint")
		if (err == nil) != c.ok {
			t.Errorf("%d -> %d bytes: err %v, want ok %v", c.comp, c.size, err, c.ok)
		}
	}
}
