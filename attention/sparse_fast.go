package attention

import (
	"math"
	"runtime"

	"sparsemla/quant"
)

// headPanels writes q [heads][d] as panels of 64 heads, each transposed:
// qT[(g·d + k)·64 + l] = q[(g·64 + l)·d + k] (one lane per head, zero lanes
// past heads), so that panel g is contiguous for the kernels.
func headPanels(q []float32, heads, d int) (qT []float32, groups int) {
	groups = (heads + PanelRows - 1) / PanelRows
	return headPanelsInto(make([]float32, groups*d*PanelRows), q, heads, d), groups
}

// panelPool keeps the q panels of SparseAttnFast and IndexScoresKeys calls
// (128 KiB for V4's 64 heads × 512): fresh ones were fresh memory (BufPool;
// one-thread CSA step on the VM: the transpose took 0.35 ms in a step
// against 36 µs alone).
var panelPool BufPool[float32]

// logitPool keeps SparseAttnFast's logits buffers (160 KiB for 64 heads ×
// 640 keys), for the same reason: a fresh one each call cost the one-thread
// step on the VM 0.3-0.4 ms.
var logitPool BufPool[float32]

// pvPool keeps the P·V tasks' accumulators and chunk scratch
// (SparseAttnFast: 17 KiB a goroutine for V4's 8 heads × 512 a task).
var pvPool BufPool[float32]

// headPanelsInto is headPanels into qT (groups·d·64 values, every one
// written: the zero lanes past heads too).
func headPanelsInto(qT, q []float32, heads, d int) []float32 {
	if heads%PanelRows != 0 {
		clear(qT)
	}
	// blocks of 16 dims, goroutines over blocks: a head's 16 values are one
	// cache line of q and the block's 16 panel rows stay in L1 (head by head
	// over all d, the serial transpose of 64 heads × 512 took 78 µs, a tenth
	// of the attention's wall time at 16 threads on the GPU host)
	const kb = 16
	parallelFor((d+kb-1)/kb, 8*heads*d, func(lo, hi int) {
		for k0 := lo * kb; k0 < min(d, hi*kb); k0 += kb {
			k1 := min(d, k0+kb)
			for h := 0; h < heads; h++ {
				g, l := h/PanelRows, h%PanelRows
				for k := k0; k < k1; k++ {
					qT[(g*d+k)*PanelRows+l] = q[h*d+k]
				}
			}
		}
	})
	return qT
}

// SparseAttnFast is SparseAttn, bit-identical at any GOMAXPROCS: the same
// chunked online softmax per head, in the same order, with the two inner loops
// on SIMD lanes. The logits ℓ_i = f32(q_h·K_i)·τ run with one lane per head
// (each lane a sequential fp32 dot product, k ascending; with AVX-512 four
// keys at a time, sharing the loads of q), the P·V update with
// one lane per dim (O[k] = O[k]·α, then O[k] += bf16(P_i)·K_i[k], i ascending).
// The logits are spread over goroutines by key, the P·V updates by groups of
// 8, 4 or 2 heads (each head computed by one goroutine), 64 dims and at most
// 16 keys at a time for all the group's heads. Shapes as SparseAttn; d must
// be a multiple of 64 for the kernels (other d run the reference).
func SparseAttnFast(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32) (lse []float32) {
	heads := checkAttn(q, kv, d, idx)
	if len(o) != len(q) || len(sink) != heads {
		panic("attention: SparseAttnFast output or sink length mismatch")
	}
	if !useAsm() || d%PanelRows != 0 || len(idx) == 0 {
		return SparseAttn(o, q, kv, d, idx, sink, scale)
	}
	L := len(idx)
	// logits[i*S+h] = f32(q_h·K_i)·τ, −∞ for −1 entries, key-major (S =
	// groups·64 per key, written by the kernel in place): each key's logits
	// are the cache lines of the goroutine that computes them (head-major, the
	// goroutines' adjacent keys shared cache lines, and writing them took a
	// seventh of the CPU time at 16 threads)
	groups := (heads + PanelRows - 1) / PanelRows
	buf := panelPool.Get(groups * d * PanelRows)
	defer panelPool.Put(buf)
	qT := headPanelsInto(*buf, q, heads, d)
	S := groups * PanelRows
	lbuf := logitPool.Get(L * S)
	defer logitPool.Put(lbuf)
	logits := *lbuf // every value written below
	z := useAVX512()
	parallelFor(L, L*heads*d, func(lo, hi int) {
		// with AVX-512 the keys go in fours (f32Panel64x4AVX512: one read
		// of each q panel per four keys), the rest one at a time; every
		// logit has the same bits either way
		var quad [4]int // the positions i of up to four pending keys
		pending := 0
		var ys, xs [4]*float32
		flush := func(n int) {
			if n == 4 {
				for g := 0; g < groups; g++ {
					for r, i := range quad {
						ys[r], xs[r] = &logits[i*S+g*PanelRows], &kv[int(idx[i])*d]
					}
					f32Panel64x4AVX512(&ys, &qT[g*d*PanelRows], &xs, d)
				}
			} else {
				for _, i := range quad[:n] {
					for g := 0; g < groups; g++ {
						f32Panel64(z, &logits[i*S+g*PanelRows], &qT[g*d*PanelRows], &kv[int(idx[i])*d], d)
					}
				}
			}
			for _, i := range quad[:n] {
				li := logits[i*S : i*S+heads]
				for l := range li {
					li[l] = float32(li[l] * scale)
				}
			}
		}
		for i := lo; i < hi; i++ {
			if idx[i] < 0 {
				li := logits[i*S : (i+1)*S]
				for l := range li {
					li[l] = negInf
				}
				continue
			}
			quad[pending] = i
			pending++
			if pending == 4 && z {
				flush(4)
				pending = 0
			} else if !z {
				flush(pending)
				pending = 0
			}
		}
		flush(pending)
	})
	lse = make([]float32, heads)
	// P·V, heads in tasks of 8, 4 or 2 (below): for each chunk
	// of keys, every head's softmax update (m, α, bf16 P), then for each
	// 64-dim column tile and each 16 of the chunk's rows, every head's update
	// of that tile, so that the rows' tile is read from L1 by all the task's
	// heads (one head at a time over all dims re-read the whole chunk, 128
	// KiB, from L2 for every head; and the rows, 2 KiB apart, map a tile of
	// more than about 24 of them onto too few L1 sets). Each O[k] still gets
	// O[k]·α once, then its adds in key order, so the bits do not depend on
	// the split.
	// 8 heads per task while that leaves a task for every P, else 4 or 2
	// (GPU host, 64 heads at 64K: 1 thread 2.85 ms with 8, 3.5-4.5 with 4;
	// 16 threads 0.51-0.58 ms with 4, 0.73 with 8)
	const maxHeadsPerTask = 8
	const pvRows = 16
	headsPerTask := maxHeadsPerTask
	for headsPerTask > 2 && (heads+headsPerTask-1)/headsPerTask < runtime.GOMAXPROCS(0) {
		headsPerTask /= 2
	}
	tasks := (heads + headsPerTask - 1) / headsPerTask
	parallelFor(tasks, heads*L*d, func(t0, t1 int) {
		// acc, p, arg and pv from a pool (fresh ones each call were fresh
		// memory: BufPool); acc is cleared per task, the others are written
		// before they are read
		sb := pvPool.Get(headsPerTask*d + 2*AttnChunk + headsPerTask*AttnChunk)
		defer pvPool.Put(sb)
		s := *sb
		acc := s[: headsPerTask*d : headsPerTask*d]
		s = s[len(acc):]
		p, arg := s[:AttnChunk:AttnChunk], s[AttnChunk:2*AttnChunk:2*AttnChunk] // arg: the exponents of a chunk (expFast)
		pv := s[2*AttnChunk:]
		var rowsBuf [AttnChunk]int
		rows := rowsBuf[:0] // offsets in kv of the chunk's rows
		var tile [AttnChunk]*float32
		var m, l, alpha [maxHeadsPerTask]float32
		for t := t0; t < t1; t++ {
			h0, h1 := t*headsPerTask, min(heads, (t+1)*headsPerTask)
			nh := h1 - h0
			for i := range nh {
				m[i], l[i] = negInf, 0
			}
			clear(acc)
			for c0 := 0; c0 < L; c0 += AttnChunk {
				chunk := idx[c0:min(c0+AttnChunk, L)]
				rows = rows[:0]
				for _, j := range chunk {
					if j >= 0 {
						rows = append(rows, int(j)*d)
					}
				}
				n := len(rows)
				for i := range nh {
					h := h0 + i
					mNew := m[i]
					for r := range chunk {
						mNew = max(mNew, logits[(c0+r)*S+h])
					}
					alpha[i] = exp32(m[i] - mNew)
					for r := range chunk {
						arg[r] = logits[(c0+r)*S+h] - mNew
					}
					expFast(p[:len(chunk)], arg[:len(chunk)])
					var sum float32
					for _, v := range p[:len(chunk)] {
						sum += v
					}
					l[i] = float32(l[i]*alpha[i]) + sum
					hp := pv[i*AttnChunk : i*AttnChunk : (i+1)*AttnChunk]
					for r, j := range chunk {
						if j >= 0 {
							hp = append(hp, quant.BF16Round(p[r]))
						}
					}
					m[i] = mNew
				}
				for k0 := 0; k0 < d; k0 += PanelRows {
					var rp **float32
					if n > 0 {
						for r, off := range rows {
							tile[r] = &kv[off+k0]
						}
						rp = &tile[0]
					}
					if n == 0 {
						for i := range nh {
							pvChunk(z, &acc[i*d+k0], rp, &pv[i*AttnChunk], 0, alpha[i], PanelRows)
						}
						continue
					}
					for r0 := 0; r0 < n; r0 += pvRows {
						nr := min(pvRows, n-r0)
						i := 0
						for ; z && i+2 <= nh; i += 2 { // two heads a call, one load of the tile
							a0, a1 := alpha[i], alpha[i+1]
							if r0 > 0 {
								a0, a1 = 1, 1
							}
							pvChunk2AVX512(&acc[i*d+k0], &acc[(i+1)*d+k0], &tile[r0], &pv[i*AttnChunk+r0], &pv[(i+1)*AttnChunk+r0], nr, a0, a1)
						}
						for ; i < nh; i++ {
							a := alpha[i]
							if r0 > 0 {
								a = 1 // α once, before the first rows (O·1 = O exactly)
							}
							pvChunk(z, &acc[i*d+k0], &tile[r0], &pv[i*AttnChunk+r0], nr, a, PanelRows)
						}
					}
				}
			}
			for i := range nh {
				h := h0 + i
				li := l[i] + exp32(sink[h]-m[i])
				oh := o[h*d : (h+1)*d]
				for k, v := range acc[i*d : (i+1)*d] {
					oh[k] = quant.BF16Round(v / li)
				}
				lse[h] = m[i] + log32(li)
			}
		}
	})
	return lse
}

// IndexScoresFast is the fast path of the indexer's IndexQK followed by
// IndexScore (indexer.ScoreRows), bit-identical at any GOMAXPROCS:
//
//	score[j] = bf16( Σ_h bf16( max(bf16(iq[h]·icache[j]), 0) · w[h] ) )
//
// with each dot product a sequential fp32 sum (k ascending) and the head sum in
// fp32 in head order. The assembly runs one lane per head (64 heads × 128 dims,
// the V4 indexer); other shapes, and rows whose score is not finite (where the
// SIMD bf16 rounding of a NaN may differ), run the scalar reference form. With
// AVX-512 VNNI (UseVNNI), the keys whose dot products are exact sums of
// small integers times powers of two (FP4-rounded query and keys; see
// sparse_fast_vnni.go) take them as integer products, the others the fp32
// kernel.
// score [Tc], iq [heads][hd], icache [Tc][hd], w [heads].
func IndexScoresFast(score, iq, icache, w []float32, heads, hd int) {
	IndexScoresKeys(score, iq, icache, nil, w, heads, hd)
}

// IndexScoresKeys is IndexScoresFast with the keys' integer form kept in
// keys between calls (IndexKeys; nil packs every key in the call): the same
// bits, whatever keys holds.
func IndexScoresKeys(score, iq, icache []float32, keys *IndexKeys, w []float32, heads, hd int) {
	if hd <= 0 || heads != len(w) || len(iq) != heads*hd || len(icache) != len(score)*hd {
		panic("attention: IndexScoresFast shape mismatch")
	}
	tc := len(score)
	asm := useAsm() && heads == PanelRows && hd == 128
	var iqT []float32
	if asm {
		buf := panelPool.Get(heads * hd)
		defer panelPool.Put(buf)
		iqT = headPanelsInto(*buf, iq, heads, hd) // heads = 64: one panel, every value written
	}
	avx512 := asm && useAVX512()
	// the integer products (sparse_fast_vnni.go) where the query allows them
	var vq *vnniQuery
	vnni := avx512 && UseVNNI && hasVNNI && tc > 0
	if vnni {
		vq, vnni = packVNNIQuery(iq, w)
	}
	if vq != nil {
		defer vnniQueryPool.Put(vq)
	}
	if vnni && keys != nil {
		keys.sync(icache, tc)
	}
	limit := 0
	if vnni {
		limit = vnniSpread - int(vq.maxSq)
	}
	const rowsPerTask = 256
	parallelFor((tc+rowsPerTask-1)/rowsPerTask, tc*heads*hd, func(lo, hi int) {
		var terms [8 * PanelRows]float32 // 8 keys' score terms (indexTerms64AVX2)
		var recs [8 * vnniRecord]byte    // 8 keys' vnniPackRows records
		qk := make([]float32, heads)
		for t := lo; t < hi; t++ {
			j0, j1 := t*rowsPerTask, min(tc, (t+1)*rowsPerTask)
			// groups of 8 keys: their terms, then their sums (indexSum64)
			for g := j0; asm && g < j1; g += 8 {
				n := min(8, j1-g)
				if vnni {
					rec := &recs[0]
					var done uint64
					if keys != nil {
						rec = &keys.recs[g*vnniRecord]
						done = vnniVerifyRows(rec, &icache[g*hd], n, limit)
					} else {
						done = vnniPackRows(rec, &icache[g*hd], n, limit)
					}
					indexTerms64VNNI(&terms[0], rec, vq, done, n)
					for r := 0; r < n; r++ {
						if done&(1<<r) != 0 {
							continue
						}
						// a key the integer products do not take (or whose
						// kept record no longer matches it: packed again
						// for the next call)
						if keys != nil && keys.stale(g+r, limit) {
							vnniPackRows(&keys.recs[(g+r)*vnniRecord], &icache[(g+r)*hd], 1, vnniSpread)
						}
						indexTerms64AVX512(&terms[r*PanelRows], &icache[(g+r)*hd], &iqT[0], &w[0], 1)
					}
				} else if avx512 {
					indexTerms64AVX512(&terms[0], &icache[g*hd], &iqT[0], &w[0], n)
				} else {
					indexTerms64AVX2(&terms[0], &icache[g*hd], &iqT[0], &w[0], n)
				}
				indexSum64(&score[g], &terms[0], n)
			}
			for j := j0; j < j1; j++ {
				if asm {
					s := quant.BF16Round(score[j])
					if !math.IsInf(float64(s), 0) && s == s {
						score[j] = s
						continue
					}
				}
				BF16Linear(qk, icache[j*hd:(j+1)*hd], iq, heads, hd)
				var sum float32
				for h, d := range qk {
					sum += quant.BF16Round(max(d, 0) * w[h])
				}
				score[j] = quant.BF16Round(sum)
			}
		}
	})
}

// IndexQKFast is the indexer's IndexQK (index_qk, materialised for a replay
// that compares it), bit-identical at any GOMAXPROCS:
//
//	qk[h][j] = bf16( Σ_k iq[h][k] · icache[j][k] )     k ascending, fp32
//
// with one SIMD lane per head. qk [heads, Tc], iq [heads, hd], icache [Tc, hd].
func IndexQKFast(qk, iq, icache []float32, heads, hd int) {
	if hd <= 0 || len(iq) != heads*hd || len(icache)%hd != 0 || len(qk) != heads*(len(icache)/hd) {
		panic("attention: IndexQKFast shape mismatch")
	}
	tc := len(icache) / hd
	if !useAsm() || tc == 0 {
		for h := 0; h < heads; h++ {
			BF16Linear(qk[h*tc:(h+1)*tc], iq[h*hd:(h+1)*hd], icache, tc, hd)
		}
		return
	}
	qT, groups := headPanels(iq, heads, hd)
	z := useAVX512()
	parallelFor(tc, tc*heads*hd, func(lo, hi int) {
		var tmp [PanelRows]float32
		for j := lo; j < hi; j++ {
			for g := 0; g < groups; g++ {
				f32Panel64(z, &tmp[0], &qT[g*hd*PanelRows], &icache[j*hd], hd)
				for l := 0; l < PanelRows && g*PanelRows+l < heads; l++ {
					qk[(g*PanelRows+l)*tc+j] = quant.BF16Round(tmp[l])
				}
			}
		}
	})
}
