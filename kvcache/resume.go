package kvcache

import (
	"fmt"
	"math"
)

// Schedule is what a model caches per layer, as far as resuming from a prefix
// is concerned: the sliding window and the compress ratio of every layer
// (V4-Flash: window 128, ratios [0, 0, 4, 128, 4, …, 4]).
type Schedule struct {
	Window int
	Ratios []int // per layer: 0, 4 or 128 (V4.1: 1 or 2 at its KV sources, 0 elsewhere)
	// IndexRatios, per layer, is the ratio of the index keys the layer owns
	// outside V4's r = 4 rule: DeepSeek-V4.1's index sources that are KV
	// sources keep one key per r tokens of their own compressor (no
	// indexer compressor, no overlap); 0 or nil elsewhere.
	IndexRatios []int
}

// Needs lists the state a V4 request must get back to continue decoding at
// position n (its next token is n) after a prefix hit of n tokens
// (tools-and-formats.md §3.4, spec §2.3-2.4, §5):
//
//   - every layer: the window rows of tokens [max(0, n-Window), n);
//   - r > 0 layers: compressed rows 0 … n div r − 1 (prefix lifetime);
//   - r = 4 layers: indexer keys 0 … n div 4 − 1 (V4.1: n div r − 1 at the
//     layers of IndexRatios);
//   - r > 0 layers: the compressor state (main, and indexer for r = 4) of the
//     unfinished group, tokens [n − n mod r, n); for r = 4 also the previous
//     group's 4 tokens, whose A halves the next row pools (the overlap halo),
//     so tokens [max(0, n − n mod 4 − 4), n).
//
// At a page-aligned n (page 256) the unfinished groups are empty, but a ratio-4
// layer still needs the 4-token halo: a prefix hit without it cannot produce
// compressed row n/4 correctly.
type Needs struct {
	N          int
	WindowFrom int         // window rows needed for tokens [WindowFrom, N)
	Compressed map[int]int // ratio → number of compressed rows needed
	IndexKeys  int         // indexer keys needed (0 without ratio-4 layers)
	StateFrom  int         // compressor state needed for tokens [StateFrom, N) (N when none)
}

// Needs returns what resuming at n requires.
func (s Schedule) Needs(n int) Needs {
	nd := Needs{N: n, WindowFrom: max(0, n-s.Window), Compressed: map[int]int{}, StateFrom: s.StateFrom(n)}
	for _, r := range s.Ratios {
		switch r {
		case 0:
		case 4:
			nd.Compressed[4] = n / 4
			nd.IndexKeys = n / 4
		default:
			nd.Compressed[r] = n / r
		}
	}
	for _, r := range s.IndexRatios {
		if r > 0 {
			nd.IndexKeys = max(nd.IndexKeys, n/r)
		}
	}
	return nd
}

// StateFrom is Needs(n).StateFrom without the rest: the first token whose
// compressor state a resume at n needs, min over the compressed layers of
// n − n mod r (r = 128) and max(0, n − n mod 4 − 4) (r = 4, the halo); n when
// no layer compresses.
func (s Schedule) StateFrom(n int) int {
	from := n
	for _, r := range s.Ratios {
		switch r {
		case 0:
		case 4:
			from = min(from, max(0, n-n%4-4))
		default:
			from = min(from, n-n%r)
		}
	}
	return from
}

// Snapshot records that the state needed to resume at At was kept when the
// prefix was cached: the compressor (and indexer-compressor) state of tokens
// [StateFrom, At) for every compressed layer. Window rows are tracked by the
// radix cache per node (they can be dropped separately, as SGLang's SWA
// tombstones do); compressed rows and indexer keys live with the prefix.
type Snapshot struct {
	At        int
	StateFrom int
}

// ResumeRefusal says why a matched prefix of Matched tokens cannot be resumed
// at a longer point than the one returned.
type ResumeRefusal struct {
	At     int    // the longest matched page boundary that was refused
	Reason string // what is missing there
}

func (r *ResumeRefusal) Error() string {
	return fmt.Sprintf("kvcache: prefix of %d tokens is cached but not resumable: %s", r.At, r.Reason)
}

// Sizes returns the byte costs of caching under this schedule with the given
// layouts (main KV rows and indexer keys), for RadixCache accounting:
//
//	PrefixBytesPerToken = Σ_{r>0} kvEntry/r + Σ_{r=4} indexEntry/4   (rounded up)
//	WindowBytesPerToken = layers · kvEntry
//	SnapshotBytes       = Σ_{r>0} fp32 state of the tokens a resume at a
//	                      page boundary needs: r = 4: the 4-token halo, of
//	                      which the next row reads only the A halves (kv and
//	                      score, d channels each): 4·2·512·4 B = 16 KiB (main)
//	                      + 4·2·128·4 B = 4 KiB (indexer), tools-and-formats
//	                      §3.4; r = 128: nothing at a 128-aligned boundary.
//
// With V4-Flash's schedule, MODEL1 and the FP8 indexer this gives spec §8.5's
// ≈ 3,850 bytes per token of prefix.
func (s Schedule) Sizes(kv, index Layout) Sizes {
	kvb := MustFormat(kv, 512, 1).EntryBytes()
	ib := MustFormat(index, 128, 1).EntryBytes()
	var prefix float64
	sz := Sizes{WindowBytesPerToken: len(s.Ratios) * kvb}
	for _, r := range s.Ratios {
		if r > 0 {
			prefix += float64(kvb) / float64(r)
		}
		if r == 4 {
			prefix += float64(ib) / 4
			sz.SnapshotBytes += 4*2*512*4 + 4*2*128*4
		}
	}
	sz.PrefixBytesPerToken = int(math.Ceil(prefix))
	return sz
}
