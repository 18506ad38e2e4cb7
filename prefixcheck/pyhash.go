package prefixcheck

import (
	"math/bits"
	"strconv"
)

// SGLang before sgl-project/sglang PR #13488 (merged November 2025) named a
// page in its KV events by Python's built-in hash of the page's token tuple,
// hash(tuple(page_tokens)), and a page's parent by the same hash of the
// previous page (python/sglang/srt/mem_cache/radix_cache.py,
// RadixCache._record_store_event and _record_remove_event, e.g. at commit
// 95769b280eaaf946a45dd3b50f7e864df09ac893). Python's hash of a tuple of ints
// does not depend on PYTHONHASHSEED, so the hashes of such a stream can be
// recomputed from its token ids; pyTupleHash does it (CPython 3.8 and later,
// 64-bit: the xxHash-based tuple hash over the ints' own hashes).

const (
	pyXXPrime1 = 11400714785074694791
	pyXXPrime2 = 14029467366897019727
	pyXXPrime5 = 2870177450012600261
	pyHashMod  = 1<<61 - 1 // the modulus of Python's int hash
)

// pyIntHash is Python's hash of an int that fits in 32 bits.
func pyIntHash(v int32) uint64 {
	x := int64(v)
	if x < 0 {
		h := -((-x) % pyHashMod)
		if h == -1 {
			h = -2
		}
		return uint64(h)
	}
	return uint64(x % pyHashMod)
}

// pyTupleHash is Python's hash(tuple(toks)).
func pyTupleHash(toks []int32) int64 {
	acc := uint64(pyXXPrime5)
	for _, t := range toks {
		acc += pyIntHash(t) * pyXXPrime2
		acc = bits.RotateLeft64(acc, 31)
		acc *= pyXXPrime1
	}
	acc += uint64(len(toks)) ^ (pyXXPrime5 ^ 3527539)
	if acc == ^uint64(0) {
		return 1546275796
	}
	return int64(acc)
}

// pyPageHash is pyTupleHash as a BlockHash (an int hash in canonical text).
func pyPageHash(toks []int32) BlockHash {
	return BlockHash(strconv.FormatInt(pyTupleHash(toks), 10))
}

// pyRootHash is hash(()): the parent hash those SGLang versions gave the
// first page of a node under the tree's root (the root's key is empty).
var pyRootHash = pyPageHash(nil)
