package hugemem

import (
	"sync"
	"sync/atomic"
	"unsafe"
)

// PageSize is the transparent huge page size the chunks are aligned to.
const PageSize = 2 << 20

// chunkSize is the size of the shared chunks small buffers are carved from;
// a buffer of at least chunkSize/2 gets a chunk of its own.
const chunkSize = 16 * PageSize

// MinBytes is the smallest buffer Bytes places on huge pages; smaller ones
// are plain make (a weight below it spans at most one huge page).
const MinBytes = 256 << 10

// align is the alignment of every buffer Bytes returns (a cache line, and
// a multiple of the sizes of the element types of Float32s and Uint16s).
const align = 64

// enabled is SetEnabled's switch (atomic: benchmarks flip it between runs).
var enabled atomic.Bool

func init() { enabled.Store(true) }

// SetEnabled turns the huge-page advice on or off for the chunks allocated
// after it (true by default) and returns the previous setting: the
// benchmarks' SPARSEMLA_HUGEPAGES=0 measures the same code on ordinary pages.
// Buffers are carved and aligned the same way either way.
func SetEnabled(on bool) bool { return enabled.Swap(on) }

var arena struct {
	sync.Mutex
	free []byte // the current chunk's unused, aligned tail
}

// Bytes returns n zero bytes, 64-byte aligned, on memory advised for
// transparent huge pages when n ≥ MinBytes (plain make below it).
func Bytes(n int) []byte {
	if n < MinBytes {
		return make([]byte, n)
	}
	if n >= chunkSize/2 {
		return newChunk(n)
	}
	arena.Lock()
	defer arena.Unlock()
	if len(arena.free) < n {
		arena.free = newChunk(chunkSize)
	}
	b := arena.free[:n:n]
	skip := min(len(arena.free), (n+align-1)/align*align)
	arena.free = arena.free[skip:]
	return b
}

// Float32s is Bytes for n float32 values.
func Float32s(n int) []float32 {
	if n == 0 {
		return []float32{}
	}
	b := Bytes(4 * n)
	return unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(b))), n)
}

// Uint16s is Bytes for n uint16 values.
func Uint16s(n int) []uint16 {
	if n == 0 {
		return []uint16{}
	}
	b := Bytes(2 * n)
	return unsafe.Slice((*uint16)(unsafe.Pointer(unsafe.SliceData(b))), n)
}

// newChunk allocates n bytes starting on a PageSize boundary (n rounded up to
// whole huge pages) and advises them; it returns the first n.
func newChunk(n int) []byte {
	size := (n + PageSize - 1) / PageSize * PageSize
	raw := make([]byte, size+PageSize)
	off := int(-uintptr(unsafe.Pointer(unsafe.SliceData(raw))) & (PageSize - 1))
	c := raw[off : off+size : off+size]
	if enabled.Load() {
		advise(c)
	}
	return c[:n:n]
}
