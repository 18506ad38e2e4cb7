package kvcache

import (
	"container/heap"
	"fmt"
	"sort"
)

// reindex puts n into, or takes it out of, the eviction heaps according to
// its state, and restores the heap order after its access time changed.
// Every change of a node's children, lock, window flag, access time or
// liveness is followed by a reindex of that node.
func (c *RadixCache) reindex(n *node) {
	if n.parent == nil {
		return // a root is never evicted
	}
	c.leaves.place(n, inLeaves, !n.dead && n.lock == 0 && len(n.children) == 0)
	c.windows.place(n, inWindows, !n.dead && n.lock == 0 && n.window)
}

// Evicted describes one node removed (Evict, Remove) or whose window rows
// were dropped (EvictWindows).
type Evicted struct {
	Namespace string  // the node's namespace
	Prefix    []int32 // tokens from the root to the end of the node
	Start     int     // first token of the node
	Vals      []int64 // the node's values (to be freed by the caller)
}

// lruHeap is a binary min-heap of nodes ordered by (last, seq), each node
// knowing its index (node.hidx[which]) so a change of access time or of
// eligibility costs O(log n).
type lruHeap struct {
	which int
	h     []*node
}

func lruLess(a, b *node) bool {
	if a.last != b.last {
		return a.last < b.last
	}
	return a.seq < b.seq
}

func (h *lruHeap) Len() int { return len(h.h) }

func (h *lruHeap) Less(i, j int) bool { return lruLess(h.h[i], h.h[j]) }

func (h *lruHeap) Swap(i, j int) {
	h.h[i], h.h[j] = h.h[j], h.h[i]
	h.h[i].hidx[h.which] = i
	h.h[j].hidx[h.which] = j
}

func (h *lruHeap) Push(x any) {
	n := x.(*node)
	n.hidx[h.which] = len(h.h)
	h.h = append(h.h, n)
}

func (h *lruHeap) Pop() any {
	n := h.h[len(h.h)-1]
	h.h[len(h.h)-1] = nil
	h.h = h.h[:len(h.h)-1]
	n.hidx[h.which] = -1
	return n
}

// place makes n a member of the heap when in is set (fixing its position
// when it already is) and removes it otherwise.
func (h *lruHeap) place(n *node, which int, in bool) {
	i := n.hidx[which]
	switch {
	case in && i < 0:
		heap.Push(h, n)
	case in:
		heap.Fix(h, i)
	case i >= 0:
		heap.Remove(h, i)
	}
}

// drop unlinks node n (a leaf of its subtree being removed) and undoes its
// accounting.
func (c *RadixCache) drop(n *node) Evicted {
	e := Evicted{Namespace: rootOf(n).ns, Prefix: c.prefixOf(n), Start: n.start, Vals: n.vals}
	p := n.parent
	delete(p.children, pageKey(n.key[:c.page]))
	if n.lock > 0 {
		c.protected -= len(n.key)
	} else {
		c.evictable -= len(n.key)
	}
	if n.window {
		c.windowTokens -= len(n.key)
	}
	c.snapshots -= len(n.snaps)
	c.nodes--
	n.dead = true
	c.reindex(n)
	c.reindex(p)
	return e
}

// Evict removes unlocked leaves, least recently used first, until at least
// tokens tokens are freed or nothing evictable is left. A parent that becomes
// an unlocked leaf joins the candidates. It returns what was removed.
// Cost: O(log n) per node removed (the candidates are kept in a heap).
func (c *RadixCache) Evict(tokens int) []Evicted {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []Evicted
	freed := 0
	for freed < tokens && c.leaves.Len() > 0 {
		n := c.leaves.h[0]
		freed += len(n.key)
		out = append(out, c.drop(n))
	}
	return out
}

// EvictWindows drops the window rows (not the prefix-lifetime rows) of
// unlocked nodes, least recently used first, until at least tokens tokens of
// window rows are freed: SGLang's SWA tombstones. Snapshots that needed those
// rows stop being resume points.
func (c *RadixCache) EvictWindows(tokens int) []Evicted {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []Evicted
	freed := 0
	for freed < tokens && c.windows.Len() > 0 {
		n := c.windows.h[0]
		n.window = false
		c.windowTokens -= len(n.key)
		freed += len(n.key)
		c.reindex(n)
		out = append(out, Evicted{Namespace: rootOf(n).ns, Prefix: c.prefixOf(n), Start: n.start, Vals: n.vals})
	}
	return out
}

// ErrLocked is returned by Remove when the prefix to remove, or a longer one
// below it, is locked.
var ErrLocked = fmt.Errorf("kvcache: prefix is locked")

// Remove drops the cached page that ends at len(prefix) (page aligned, > 0)
// in namespace ns and every cached prefix that extends it, as an engine does
// that evicts a page whose descendants can then no longer be matched (vLLM's
// BlockRemoved). Nothing is removed when the page is not cached (nil, nil).
// It fails with ErrLocked, removing nothing, when any of those nodes is
// locked. Removed nodes are returned parents first, children in key order.
func (c *RadixCache) Remove(ns string, prefix []int32) ([]Evicted, error) {
	end := len(prefix)
	if end == 0 || end%c.page != 0 {
		return nil, fmt.Errorf("kvcache: Remove of a %d-token prefix: not a positive multiple of the page %d", end, c.page)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	cur, pos := c.root(ns, false), 0
	if cur == nil {
		return nil, nil
	}
	from := end - c.page // the removed page starts here
	var target *node
	for pos < end {
		child := cur.children[pageKey(prefix[pos:pos+c.page])]
		if child == nil {
			return nil, nil
		}
		l := c.commonPages(child.key, prefix[pos:end])
		if child.start <= from && from < child.start+l {
			target = child
			break
		}
		if l < len(child.key) {
			return nil, nil
		}
		pos += l
		cur = child
	}
	if target == nil {
		return nil, nil
	}
	// Refuse before changing anything.
	var sub []*node
	var collect func(*node)
	collect = func(n *node) {
		sub = append(sub, n)
		keys := make([]string, 0, len(n.children))
		for k := range n.children {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			collect(n.children[k])
		}
	}
	collect(target)
	for _, n := range sub {
		if n.lock > 0 {
			return nil, fmt.Errorf("%w: tokens [%d, %d) of namespace %q", ErrLocked, n.start, n.end(), ns)
		}
	}
	if target.start < from {
		c.split(target, from-target.start) // target keeps [from, ...): sub is unchanged
	}
	out := make([]Evicted, 0, len(sub))
	for _, n := range sub {
		out = append(out, Evicted{Namespace: ns, Prefix: c.prefixOf(n), Start: n.start, Vals: n.vals})
	}
	for i := len(sub) - 1; i >= 0; i-- { // children first, so each is a leaf when dropped
		c.drop(sub[i])
	}
	return out, nil
}
