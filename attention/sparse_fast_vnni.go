package attention

import (
	"math"
	"sync"
)

// The VNNI kernels (index_vnni_amd64.s) are written by internal/vnnigen.
//go:generate go run ./internal/vnnigen

// The index scores' q·k products as integers (indexTerms64VNNI, AVX-512
// VNNI), where that gives the reference's bits.
//
// The V4 indexer's query and keys are FP4-rounded per block of 32 dims
// (FQ4: an E2M1 value times a power-of-two scale), so within a block every
// value is v = n·2^e with n a small integer. With e = floor(log2 max|v|) − 3
// over a block, |n| ≤ 15 whenever n is an integer at all. The reference
// dot product Σ_k q[k]·k[k] (fp32, k ascending) then rounds nowhere when
// every partial sum is a multiple of 2^Emin (the smallest block exponent
// e_q + e_k of the pair) below 2^24·2^Emin in magnitude: it is the exact
// sum. A bound that holds for every partial sum: Σ_b 32·15·15·2^(E_b − Emin)
// < 2^24, which holds when the exponents' spread over the blocks, the
// query's plus the key's, is at most 9 (32·225·(1 + 3·2^9) ≈ 1.1·2^23). The
// kernel then takes each block's Σ n_q·n_k (an int32, exact), adds the
// blocks shifted to Emin (exact, |T| < 2^24) and scales T by 2^Emin:
// the reference's fp32 value, bit for bit. Exponents are kept in [−60, 40]
// so that nothing under- or overflows. Keys that are not of that form (a
// value off its block's integer grid, a NaN or infinity, a wider spread)
// are left to the fp32 kernel; a query that is not, the whole call.

// vnniSpread is the largest spread of block exponents (query's plus key's)
// the integer products take (see above).
const vnniSpread = 9

// vnniExpMin and vnniExpMax bound a block exponent e (= floor(log2 max) − 3).
const vnniExpMin, vnniExpMax = -60, 40

// vnniPrefetch is how far ahead (bytes of fp32 rows; records half as far)
// vnniVerifyRows prefetches: in a decode step the key cache comes from
// memory, behind the step's weights. On the GPU host's Xeon, one thread,
// the CSA step's index scoring took 1.90-1.95 ms with it and 2.05 ms
// without (bench/README.md, round 11); on the VM no difference showed.
var vnniPrefetch = 4096

// vnniQuery is one call's indexer query in the form indexTerms64VNNI reads
// (64 heads × 128 dims; the kernel uses the byte offsets in the comments,
// checked by TestVNNIQueryLayout).
type vnniQuery struct {
	panel [32 * 64 * 4]int8 // 0: step s, head h, i < 4: n_q[h][4s+i]
	corr  [4 * 64]int32     // 8192: block b, head h: −15·Σ_{k in b} n_q[h][k]
	shift [4 * 64]int32     // 9216: block b, head h: e_q[h][b] − emin_q[h] (0 for a zero block)
	emin  [64]float32       // 10240: head h: emin_q[h]
	w     [64]float32       // 10496: the head weights
	maxSq int64             // 10752: the largest spread e_q max − min over the heads
}

// vnniRecord is the size of vnniPackRows's record of one row (bytes), and
// the offsets in it past the 128 codes (vnniPackRows, indexTerms64VNNI and
// vnniVerifyRows read the same offsets).
const (
	vnniRecord    = 136
	vnniRecShifts = 128 // 4 bytes: the blocks' shifts E − Emin
	vnniRecEmin   = 132 // Emin − 3, an int8
	vnniRecSpread = 133 // Emax − Emin
	vnniRecTaken  = 134 // 1 if the row is taken, else 0
)

// vnniPackRowRef is vnniPackRows on one row of 128 values in plain Go (the
// tests hold the assembly to it): it fills rec (vnniRecord bytes: the codes
// n + 15 at 0-127, the blocks' shifts E − Emin at 128-131, Emin − 3 as an
// int8 at 132, the spread Emax − Emin at 133, 1 at 134 if the row is taken,
// else 0) and reports whether the row is taken. Per block of 32 values,
// E = floor(log2 max|v|) and n = v·2^(3−E) must be integers (|n| ≤ 15
// follows); a zero block counts as E = Emax of the others; −57 ≤ Emin ≤
// Emax ≤ 43 and Emax − Emin ≤ limit.
func vnniPackRowRef(rec []byte, v []float32, limit int) bool {
	rec[vnniRecTaken] = 0
	const blk = 32
	var es [4]int
	var zero [4]bool
	emin, emax := math.MaxInt, math.MinInt
	for b := range es {
		var amax float32
		for _, x := range v[b*blk : (b+1)*blk] {
			if x != x || math.IsInf(float64(x), 0) {
				return false
			}
			amax = max(amax, float32(math.Abs(float64(x))))
		}
		if amax == 0 {
			zero[b] = true
			continue
		}
		_, exp := math.Frexp(float64(amax)) // amax = f·2^exp, f in [0.5, 1)
		es[b] = exp - 1
		emin, emax = min(emin, es[b]), max(emax, es[b])
	}
	if emin > emax || emax-3 > vnniExpMax || emin-3 < vnniExpMin || emax-emin > limit {
		return false // (an all-zero row too)
	}
	var codes [128]byte
	for b := range es {
		if zero[b] {
			es[b] = emax
		}
		for i, x := range v[b*blk : (b+1)*blk] {
			m := math.Ldexp(float64(x), 3-es[b]) // exact: a power-of-two scaling in range
			if m != math.Trunc(m) {
				return false
			}
			codes[b*blk+i] = byte(int8(m) + 15)
		}
	}
	copy(rec, codes[:])
	for b := range es {
		rec[vnniRecShifts+b] = byte(es[b] - emin)
	}
	rec[vnniRecEmin] = byte(int8(emin - 3))
	rec[vnniRecSpread] = byte(emax - emin)
	rec[vnniRecTaken] = 1
	return true
}

// vnniQueryPool keeps the vnniQuery of finished calls (11 KiB each): a
// step's fresh memory costs more than its packing.
var vnniQueryPool sync.Pool

// packVNNIQuery returns the query of an IndexScoresFast call (64 heads ×
// 128 dims) in vnniQuery form (each head a vnniPackRows row, transposed),
// or false where a head is not of the form the integer products need.
func packVNNIQuery(iq, w []float32) (*vnniQuery, bool) {
	const heads, hd, blk = PanelRows, 128, 32
	var recs [heads * vnniRecord]byte
	if vnniPackRows(&recs[0], &iq[0], heads, vnniSpread) != 1<<heads-1 {
		return nil, false
	}
	q, _ := vnniQueryPool.Get().(*vnniQuery)
	if q == nil {
		q = new(vnniQuery)
	}
	q.maxSq = 0 // (every other field is written below)
	for h := 0; h < heads; h++ {
		rec := recs[h*vnniRecord : (h+1)*vnniRecord]
		for b := 0; b < hd/blk; b++ {
			sum := 0
			for k := b * blk; k < (b+1)*blk; k++ {
				n := int8(rec[k] - 15)
				q.panel[(k/4)*256+h*4+k%4] = n
				sum += int(n)
			}
			q.corr[b*heads+h] = int32(-15 * sum)
			q.shift[b*heads+h] = int32(rec[vnniRecShifts+b])
		}
		q.emin[h] = float32(int8(rec[vnniRecEmin]))
		q.maxSq = max(q.maxSq, int64(rec[vnniRecSpread]))
		q.w[h] = w[h]
	}
	return q, true
}

// IndexKeys keeps the integer form (vnniPackRows records) of an index key
// cache's rows between IndexScoresKeys calls, so that a call packs only the
// rows added since the last one. Nothing in it is trusted: a call checks
// each record against its fp32 row (vnniVerifyRows) before using it, and a
// record that does not match (the cache was replaced or changed in place) is
// packed again from the row. The zero value is empty. An IndexKeys belongs
// to one cache and must not be used by two calls at once.
type IndexKeys struct {
	recs []byte // vnniRecord bytes per row
	n    int    // rows packed
}

// sync packs the rows of icache [tc][128] that k does not have yet (all of
// them after a cache that is shorter than k's rows: another cache).
func (k *IndexKeys) sync(icache []float32, tc int) {
	const hd = 128
	if k.n > tc {
		k.n = 0
	}
	if cap(k.recs) < tc*vnniRecord {
		k.recs = append(k.recs[:cap(k.recs)], make([]byte, tc*vnniRecord-cap(k.recs))...)
	}
	k.recs = k.recs[:tc*vnniRecord]
	n0, rows := k.n, tc-k.n
	const perTask = 64
	parallelFor((rows+perTask-1)/perTask, rows*hd, func(lo, hi int) {
		for t := lo; t < hi; t++ {
			r0 := n0 + t*perTask
			nr := min(perTask, tc-r0)
			vnniPackRows(&k.recs[r0*vnniRecord], &icache[r0*hd], nr, vnniSpread)
		}
	})
	k.n = tc
}

// stale reports whether row r's record, taken and within limit, failed
// vnniVerifyRows: it no longer matches its row (a record not taken, or
// wider than limit, is left as it is).
func (k *IndexKeys) stale(r, limit int) bool {
	rec := k.recs[r*vnniRecord : (r+1)*vnniRecord]
	return rec[vnniRecTaken] == 1 && int(rec[vnniRecSpread]) <= limit
}

// Clone returns a copy of k that shares nothing with it (nil for nil): a
// cloned cache keeps its packed rows.
func (k *IndexKeys) Clone() *IndexKeys {
	if k == nil {
		return nil
	}
	return &IndexKeys{recs: append([]byte(nil), k.recs...), n: k.n}
}
