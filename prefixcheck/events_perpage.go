package prefixcheck

import (
	"encoding/binary"
	"fmt"
)

// perPageHashes reports whether the followed events' block hashes are
// SGLang's per-page hashes: every stored block's hash (at least one) is
// Python's hash of its own token tuple. A chained hash depends on the parent
// too and is never that, so a vLLM stream (or SGLang's since PR #13488) is
// never read as per-page.
func perPageHashes(batches []EventBatch, skip func(int, *Event) int) bool {
	n := 0
	for bi := range batches {
		for ei := range batches[bi].Events {
			ev := &batches[bi].Events[ei]
			if ev.Type != "BlockStored" || skip(bi, ev) != 0 {
				continue
			}
			B := ev.BlockSize
			if B <= 0 || len(ev.TokenIDs) != len(ev.BlockHashes)*B {
				return false
			}
			for i, h := range ev.BlockHashes {
				if h != pyPageHash(ev.TokenIDs[i*B:(i+1)*B]) {
					return false
				}
				n++
			}
		}
	}
	return n > 0
}

// pendingRemoval is a block removed with per-page hashes, and its eviction
// (ok: its place is known), held until a request takes it: SGLang before PR
// #13488 announced the split of a radix node as the removal of its pages and
// their store again at the same place, which is no eviction.
type pendingRemoval struct {
	b  *evBlock
	e  Eviction
	ok bool
}

// place is where a block with per-page hashes sits in the tree: its hash,
// the block before it (and that block's hash as the event gave it), its
// extra key, namespace and tokens (little-endian int32s). Two cached blocks
// never share a place, so finding one is a map lookup, whatever the number
// of pages with the same hash or of removals pending.
type place struct {
	hash, parentHash BlockHash
	parent           *evBlock
	extra, ns, toks  string
}

func placeOf(h BlockHash, parent *evBlock, parentHash BlockHash, extra, ns string, toks []int32) place {
	b := make([]byte, 0, 4*len(toks))
	for _, t := range toks {
		b = binary.LittleEndian.AppendUint32(b, uint32(t))
	}
	return place{hash: h, parentHash: parentHash, parent: parent, extra: extra, ns: ns, toks: string(b)}
}

func (b *evBlock) place() place {
	return placeOf(b.hash, b.parent, b.parentHash, b.extra, b.ns, b.tokens)
}

// pageParent places the first block of a BlockStored event with per-page
// hashes: under the root (the parent hash is hash(()), the root's empty
// key), or under the one cached page its parent hash names; why says why
// the place is not known (no parent hash, a hash no cached page or several
// have).
func (r *eventsReader) pageParent(ev *Event) (root bool, parent *evBlock, why string) {
	switch cands := r.live[ev.Parent]; {
	case ev.Parent == "":
		r.noParent++
		return false, nil, "no parent hash: with per-page hashes SGLang gave the first page of a radix node under the root hash(()), and some versions before PR #13488 no parent at all, so its place in the tree is not known"
	case ev.Parent == pyRootHash:
		return true, nil, ""
	case len(cands) == 1:
		return false, cands[0], ""
	case len(cands) == 0:
		return false, nil, fmt.Sprintf("parent block %s is not cached in this stream (it starts mid-run?)", ev.Parent)
	default:
		if p := r.pendingUnder(ev); p != nil {
			return false, p, ""
		}
		r.ambiguousParent++
		return false, nil, fmt.Sprintf("parent hash %s is a per-page hash %d cached pages have (one page's tokens alone, SGLang before PR #13488), so the place of this block is not known", ev.Parent, len(cands))
	}
}

// pendingUnder is the parent of the first block of a BlockStored event whose
// parent hash several cached pages have, when that block is stored again
// where the one removed block of its hash, parent hash and content no request
// has taken yet was, under a page still cached (nil: none, or several): a
// radix node split under a page whose tokens recur in the tree.
func (r *eventsReader) pendingUnder(ev *Event) *evBlock {
	if len(ev.BlockHashes) == 0 {
		return nil
	}
	x := ""
	if ev.ExtraKeys != nil {
		x = ev.ExtraKeys[0]
	}
	i, ok := r.pendBy[placeOf(ev.BlockHashes[0], nil, ev.Parent, x, namespaceOf(ev), ev.TokenIDs[:ev.BlockSize])]
	if !ok || i < 0 {
		return nil
	}
	if b := r.pend[i].b; b != nil && b.parent != nil && b.parent.live > 0 {
		return b.parent
	}
	return nil
}

// revive stores again the block removed at place at whose removal no
// request has taken yet (nil: none): its removal is withdrawn.
func (r *eventsReader) revive(at place) *evBlock {
	i, ok := r.pendAt[at]
	if !ok {
		return nil
	}
	delete(r.pendAt, at)
	loose := at
	loose.parent = nil
	if r.pendBy[loose] == i {
		delete(r.pendBy, loose)
	}
	b := r.pend[i].b
	r.pend[i] = pendingRemoval{}
	b.live = 1
	r.live[b.hash] = append(r.live[b.hash], b)
	r.at[at] = b
	return b
}

// removedPage follows BlockRemoved with per-page hashes: a hash one cached
// page has removes it (an eviction, unless the page is stored again at the
// same place before the next request); a hash several cached pages have
// removes none of them (which one went is not known).
func (r *eventsReader) removedPage(ev *Event, bi, ei int) error {
	for _, h := range ev.BlockHashes {
		cands := r.live[h]
		switch {
		case len(cands) == 0:
			r.unknownRemoved++
			continue
		case len(cands) > 1:
			r.ambiguousRemoved++
			r.pendAmb[h]++
			continue
		}
		b := cands[0]
		if b.live--; b.live > 0 {
			continue
		}
		delete(r.live, h)
		at := b.place()
		delete(r.at, at)
		toks, extra, ids, ok, err := r.chain(b, ev.Offset, 0)
		if err != nil {
			return fmt.Errorf("prefixcheck: %s: %s: %w", r.input, where(bi, ei, ev), err)
		}
		p := pendingRemoval{b: b, ok: ok}
		if ok {
			p.e = Eviction{Namespace: b.ns, Prefix: toks, Extra: extra, PageID: ids[len(ids)-1]}
		}
		r.pendAt[at] = len(r.pend)
		loose := at
		loose.parent = nil
		if _, several := r.pendBy[loose]; several {
			r.pendBy[loose] = -1
		} else {
			r.pendBy[loose] = len(r.pend)
		}
		r.pend = append(r.pend, p)
	}
	return nil
}
