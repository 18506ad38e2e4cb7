package hugemem

import (
	"testing"
	"unsafe"
)

func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// TestBytes: every size gives n zero bytes (len = cap = n), 64-byte aligned,
// that no other buffer overlaps, and keeps what is written to it.
func TestBytes(t *testing.T) {
	for _, on := range []bool{true, false} {
		prev := SetEnabled(on)
		testBytes(t)
		SetEnabled(prev)
	}
}

func testBytes(t *testing.T) {
	t.Helper()
	sizes := []int{0, 1, 100, MinBytes - 1, MinBytes, MinBytes + 1, 3 << 20, chunkSize/2 - 1, chunkSize / 2, chunkSize + 5}
	var bufs [][]byte
	for round := range 3 {
		for i, n := range sizes {
			b := Bytes(n)
			if len(b) != n || cap(b) != n {
				t.Fatalf("Bytes(%d): len %d cap %d", n, len(b), cap(b))
			}
			if n >= MinBytes && addr(b)%align != 0 {
				t.Fatalf("Bytes(%d) at %#x: not %d-aligned", n, addr(b), align)
			}
			if n >= chunkSize/2 && addr(b)%PageSize != 0 {
				t.Fatalf("Bytes(%d) at %#x: a buffer with its own chunk is not huge-page aligned", n, addr(b))
			}
			for j, v := range b {
				if v != 0 {
					t.Fatalf("Bytes(%d)[%d] = %d, want 0", n, j, v)
				}
			}
			for j := range b {
				b[j] = byte(round*len(sizes) + i + 1)
			}
			bufs = append(bufs, b)
		}
	}
	for i, b := range bufs {
		want := byte(i + 1)
		for j, v := range b {
			if v != want {
				t.Fatalf("buffer %d (len %d): byte %d is %d, want %d (overlapping buffers)", i, len(b), j, v, want)
			}
		}
	}
}

// TestTyped: Float32s and Uint16s give n aligned zero elements.
func TestTyped(t *testing.T) {
	for _, n := range []int{0, 3, MinBytes, 1 << 20} {
		f := Float32s(n)
		u := Uint16s(n)
		if len(f) != n || len(u) != n {
			t.Fatalf("n=%d: len %d, %d", n, len(f), len(u))
		}
		for i := range f {
			if f[i] != 0 || u[i] != 0 {
				t.Fatalf("n=%d: element %d not zero", n, i)
			}
			f[i], u[i] = float32(i), uint16(i)
		}
		for i := range f {
			if f[i] != float32(i) || u[i] != uint16(i) {
				t.Fatalf("n=%d: element %d lost", n, i)
			}
		}
	}
}

// TestProcessHugeBytes logs whether this machine grants huge pages (it is a
// hint: a kernel without them is not an error).
func TestProcessHugeBytes(t *testing.T) {
	b := Bytes(chunkSize)
	for i := range b {
		b[i] = 1
	}
	t.Logf("AnonHugePages after a %d MiB buffer: %d MiB", chunkSize>>20, ProcessHugeBytes()>>20)
}
