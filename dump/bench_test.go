package dump

import (
	"bufio"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// writeBenchDump writes a native dump of n records of recBytes bf16 bytes
// each (stage names cycle through the canonical table, steps and layers
// vary) and returns its path and total data bytes.
func writeBenchDump(tb testing.TB, dir string, n int, recBytes int) (string, int64) {
	tb.Helper()
	p := filepath.Join(dir, "bench.smd")
	w, err := Create(p, Header{CompressRatios: []int{0, 4, 128, 4}})
	if err != nil {
		tb.Fatal(err)
	}
	data := make([]byte, recBytes)
	for i := range data {
		data[i] = byte(i * 7)
	}
	var total int64
	for i := 0; i < n; i++ {
		r := Record{Key: Key{Step: i / (4 * len(Stages)), Layer: (i / len(Stages)) % 4, Stage: Stages[i%len(Stages)].Name},
			DType: BF16, Shape: []int{recBytes / 2}, Data: data}
		if err := w.Write(&r); err != nil {
			tb.Fatal(err)
		}
		total += int64(recBytes)
	}
	if err := w.Close(); err != nil {
		tb.Fatal(err)
	}
	return p, total
}

// readAll indexes the dump and reads every record once (what inspect does).
func readAll(tb testing.TB, p string) {
	d, err := Open(p)
	if err != nil {
		tb.Fatal(err)
	}
	defer d.Close()
	var buf []byte
	for i := range d.Entries {
		r, err := d.ReadBuf(&d.Entries[i], buf)
		if err != nil {
			tb.Fatal(err)
		}
		buf = r.Data
	}
}

// BenchmarkNativeRead measures Open (index pass) + reading every record of a
// 256 MiB dump from the page cache. Reported MB/s = data bytes per second.
func BenchmarkNativeRead(b *testing.B) {
	p, total := writeBenchDump(b, b.TempDir(), 1024, 256<<10)
	readAll(b, p) // warm the page cache
	b.SetBytes(total)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		readAll(b, p)
	}
}

// BenchmarkNativeStream reads the same dump with the sequential StreamReader.
func BenchmarkNativeStream(b *testing.B) {
	p, total := writeBenchDump(b, b.TempDir(), 1024, 256<<10)
	b.SetBytes(total)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		f, err := os.Open(p)
		if err != nil {
			b.Fatal(err)
		}
		sr, err := NewStreamReader(bufio.NewReaderSize(f, 1<<20), p)
		if err != nil {
			b.Fatal(err)
		}
		for {
			if _, err := sr.Next(); err == io.EOF {
				break
			} else if err != nil {
				b.Fatal(err)
			}
		}
		f.Close()
	}
}

// BenchmarkNativeIndex measures the index pass alone (inspect --index-only)
// over 64k small records.
func BenchmarkNativeIndex(b *testing.B) {
	p, _ := writeBenchDump(b, b.TempDir(), 65536, 1024)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		d, err := Open(p)
		if err != nil {
			b.Fatal(err)
		}
		d.Close()
	}
	b.ReportMetric(float64(65536*b.N)/b.Elapsed().Seconds(), "records/s")
}

// BenchmarkNativeBig writes a dump larger than 4 GiB (4608 records of 1 MiB)
// and reads it all, reporting the peak resident set size: memory must stay
// bounded by the largest record, not the file. Runs only with SPARSEMLA_BIG=1
// (it writes 4.5 GiB to the temp dir).
func BenchmarkNativeBig(b *testing.B) {
	if os.Getenv("SPARSEMLA_BIG") != "1" {
		b.Skip("set SPARSEMLA_BIG=1 to write and read a 4.5 GiB dump")
	}
	p, total := writeBenchDump(b, b.TempDir(), 4608, 1<<20)
	runtime.GC()
	b.SetBytes(total)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		readAll(b, p)
	}
	b.StopTimer()
	b.ReportMetric(float64(peakRSS())/(1<<20), "peak-RSS-MiB")
	b.ReportMetric(float64(total)/(1<<30), "file-GiB")
}

// peakRSS reads VmHWM from /proc/self/status (Linux); 0 elsewhere.
func peakRSS() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		if f := strings.Fields(string(line)); len(f) >= 2 && f[0] == "VmHWM:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}
