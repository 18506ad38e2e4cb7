package attention

import "sync"

// BufPool keeps slices of T between calls (a sync.Pool of *[]T). A decode
// step's large scratch buffers come from pools: with the weights live no GC
// runs for hundreds of steps, so a buffer made fresh each step is fresh
// memory, and on the VM each fresh 128 KiB cost the one-thread CSA step
// about 0.3 ms in the phase that first wrote it (bench/README.md, round
// 11). The zero value is an empty pool.
type BufPool[T any] struct{ p sync.Pool }

// Get returns a buffer of len n: a kept one if its capacity suffices (its
// values stale: the caller writes every value it reads), else a new one.
func (bp *BufPool[T]) Get(n int) *[]T {
	if b, _ := bp.p.Get().(*[]T); b != nil && cap(*b) >= n {
		*b = (*b)[:n]
		return b
	}
	b := make([]T, n)
	return &b
}

// Put keeps b for a later Get; the caller no longer uses it.
func (bp *BufPool[T]) Put(b *[]T) { bp.p.Put(b) }
