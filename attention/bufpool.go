package attention

import (
	"math"
	"sync"
	"sync/atomic"
)

// BufPool keeps slices of T between calls (a sync.Pool of *[]T). A decode
// step's scratch buffers come from pools: with the weights live no GC runs
// for hundreds of steps, so a buffer made fresh each step is fresh memory,
// and on the VM each fresh 128 KiB cost the one-thread CSA step about 0.3
// ms in the phase that first wrote it (bench/README.md, round 11); a fresh
// 4 KiB page costs 15-28 µs there (round 13). The zero value is an empty
// pool.
type BufPool[T any] struct{ p sync.Pool }

// Get returns a buffer of len n: a kept one if its capacity suffices (its
// values stale: the caller writes every value it reads), else a new one.
// With PoisonBufPools on, every value of it is a poison value first.
func (bp *BufPool[T]) Get(n int) *[]T {
	b, _ := bp.p.Get().(*[]T)
	if b != nil && cap(*b) >= n {
		*b = (*b)[:n]
	} else {
		s := make([]T, n)
		b = &s
	}
	if poisonPools.Load() {
		poison(*b)
	}
	return b
}

// Put keeps b for a later Get; the caller no longer uses it.
func (bp *BufPool[T]) Put(b *[]T) { bp.p.Put(b) }

var poisonPools atomic.Bool

// PoisonBufPools turns on (or off) the poisoning of every buffer a BufPool
// hands out, kept or new: float32 values become a NaN, integers all ones.
// It is for tests: a fast path that reads a pooled value it did not write
// then gives a NaN or a wild index instead of a stale but plausible value,
// and its bit-identity test against the reference fails. It returns the
// previous setting.
func PoisonBufPools(on bool) bool { return poisonPools.Swap(on) }

// poisonNaN is the float32 poison: a quiet NaN with a payload no
// arithmetic produces.
var poisonNaN = math.Float32frombits(0x7fc0dead)

func poison[T any](s []T) {
	switch v := any(s).(type) {
	case []float32:
		for i := range v {
			v[i] = poisonNaN
		}
	case []uint64:
		for i := range v {
			v[i] = math.MaxUint64
		}
	case []int32:
		for i := range v {
			v[i] = -1
		}
	case []int64:
		for i := range v {
			v[i] = -1
		}
	default:
		panic("attention: PoisonBufPools: no poison for this element type")
	}
}
