package kvcache

import (
	"encoding/binary"
	"fmt"
	"slices"
	"sort"
	"sync"
)

// RadixCache is a prefix cache keyed by token ids, in the spirit of SGLang's
// RadixCache (tools-and-formats.md §3.1) with DeepSeek-V4 resume points (§3.4):
//
//   - keys are token ids, matched and stored a page at a time: a request's
//     unaligned tail is never cached, every node boundary is a page boundary;
//   - each token carries an int64 value (its KV slot, as SGLang stores), handed
//     back by MatchPrefix and by eviction so the caller can free it;
//   - keys live in namespaces (a LoRA adapter, a cache salt: requests of
//     different namespaces never share a prefix); the methods without a
//     namespace argument use the namespace "";
//   - Lock/Unlock count references on a node and all its ancestors; only
//     unlocked leaves are evicted, least recently used first (an indexed heap
//     over the unlocked leaves, so Evict costs O(log n) a node, never a walk);
//   - a prefix of n tokens is resumable only where the state to continue is
//     kept: a Snapshot of the compressor state at n (with the ratio-4 halo)
//     and the window rows of tokens [n-Window, n) (see Schedule.Needs).
//     MatchPrefix returns the longest resumable prefix and says why a longer
//     matched one was refused.
//
// All methods are safe for concurrent use (one mutex).
type RadixCache struct {
	mu    sync.Mutex
	page  int
	sched Schedule
	sizes Sizes
	roots map[string]*node // by namespace
	tick  uint64

	// leaves holds exactly the unlocked leaves (Evict's candidates), windows
	// exactly the unlocked nodes whose window rows are kept (EvictWindows'),
	// both ordered by (last, seq).
	leaves, windows lruHeap
	seq             uint64

	evictable, protected int // tokens in nodes with lock 0 / lock > 0
	windowTokens         int // tokens whose window rows are kept
	snapshots            int // state snapshots kept
	nodes                int // nodes excluding the root
}

// Sizes gives the byte cost used by Usage.Bytes.
type Sizes struct {
	PrefixBytesPerToken int // compressed rows + indexer keys (prefix lifetime), per token
	WindowBytesPerToken int // window rows of every layer, per token
	SnapshotBytes       int // one compressor-state snapshot, all layers
}

type node struct {
	parent   *node
	children map[string]*node // keyed by the node's first page of tokens
	key      []int32          // tokens, a whole number of pages (empty for the root)
	vals     []int64          // one value (KV slot) per token
	start    int              // absolute position of key[0]
	endPos   int              // start + len(key); never changes, so Handle.End needs no lock
	lock     int
	last     uint64           // access tick (LRU)
	seq      uint64           // creation order (tie-break)
	window   bool             // window rows of these tokens still kept
	snaps    map[int]Snapshot // by absolute position At ∈ (start, start+len(key)]
	dead     bool
	ns       string // namespace (roots only)
	hidx     [2]int // index in c.leaves, c.windows; -1 when absent
}

const (
	inLeaves  = 0
	inWindows = 1
)

func (c *RadixCache) newNode(n *node) *node {
	n.hidx = [2]int{-1, -1}
	return n
}

func (n *node) end() int { return n.endPos }

// Handle names a node of the cache (the end of a matched or inserted prefix).
// It stays valid across node splits; after the node is evicted Lock fails.
type Handle struct{ n *node }

// End is the number of tokens of the prefix the handle ends (0 for the root).
// Safe to call concurrently with cache operations (a node's end never moves:
// a split gives the prefix to a new parent).
func (h Handle) End() int {
	if h.n == nil {
		return 0
	}
	return h.n.endPos
}

// NewRadixCache returns an empty cache matching pageSize tokens at a time.
func NewRadixCache(pageSize int, sched Schedule, sizes Sizes) *RadixCache {
	if pageSize <= 0 || sched.Window < 0 {
		panic("kvcache: NewRadixCache page size must be positive")
	}
	return &RadixCache{page: pageSize, sched: sched, sizes: sizes, roots: map[string]*node{},
		leaves: lruHeap{which: inLeaves}, windows: lruHeap{which: inWindows}}
}

// root returns the root of namespace ns, creating it when create is set (nil
// otherwise when the namespace holds nothing yet).
func (c *RadixCache) root(ns string, create bool) *node {
	r := c.roots[ns]
	if r == nil && create {
		r = c.newNode(&node{children: map[string]*node{}, window: true, ns: ns})
		c.roots[ns] = r
	}
	return r
}

// PageSize is the matching granularity in tokens.
func (c *RadixCache) PageSize() int { return c.page }

func pageKey(tokens []int32) string {
	b := make([]byte, 4*len(tokens))
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(t))
	}
	return string(b)
}

// commonPages is the length of the common prefix of a and b, rounded down to a
// whole number of pages.
func (c *RadixCache) commonPages(a, b []int32) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n / c.page * c.page
}

// split cuts n after its first l tokens (0 < l < len, page aligned): a new
// parent takes the prefix; n keeps the suffix (so handles on n stay valid).
func (c *RadixCache) split(n *node, l int) *node {
	c.seq++
	p := c.newNode(&node{parent: n.parent, children: map[string]*node{}, key: n.key[:l:l], vals: n.vals[:l:l],
		start: n.start, endPos: n.start + l, lock: n.lock, last: n.last, seq: c.seq, window: n.window})
	for at, s := range n.snaps {
		if at <= n.start+l {
			if p.snaps == nil {
				p.snaps = map[int]Snapshot{}
			}
			p.snaps[at] = s
			delete(n.snaps, at)
		}
	}
	n.parent.children[pageKey(n.key[:c.page])] = p
	n.key, n.vals, n.start, n.parent = n.key[l:], n.vals[l:], n.start+l, p
	p.children[pageKey(n.key[:c.page])] = n
	c.nodes++
	c.reindex(p)
	return p
}

// Insert caches tokens (truncated to whole pages) with one value per token and
// the snapshots kept for it. It returns how many leading tokens were already
// cached: the caller frees its own values for those (the cache keeps the
// existing ones). Snapshot positions must be page-aligned and within the
// inserted length (it panics otherwise: programmer error).
func (c *RadixCache) Insert(tokens []int32, vals []int64, snaps []Snapshot) (existing int, h Handle) {
	return c.InsertNS("", tokens, vals, snaps)
}

// InsertNS is Insert in namespace ns.
func (c *RadixCache) InsertNS(ns string, tokens []int32, vals []int64, snaps []Snapshot) (existing int, h Handle) {
	n := len(tokens) / c.page * c.page
	if len(vals) < n {
		panic("kvcache: RadixCache.Insert needs one value per token")
	}
	for _, s := range snaps {
		if s.At <= 0 || s.At > n || s.At%c.page != 0 || s.StateFrom < 0 || s.StateFrom > s.At {
			panic("kvcache: RadixCache.Insert snapshot outside the aligned prefix")
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.tick++
	root := c.root(ns, true)
	cur, pos := root, 0
	for pos < n {
		child := cur.children[pageKey(tokens[pos:pos+c.page])]
		if child == nil {
			break
		}
		child.last = c.tick
		c.reindex(child)
		l := c.commonPages(child.key, tokens[pos:n])
		if l < len(child.key) {
			child = c.split(child, l)
		}
		pos += l
		cur = child
	}
	existing = pos
	if pos < n {
		c.seq++
		leaf := c.newNode(&node{parent: cur, children: map[string]*node{}, key: append([]int32(nil), tokens[pos:n]...),
			vals: append([]int64(nil), vals[pos:n]...), start: pos, endPos: n, last: c.tick, seq: c.seq, window: true})
		cur.children[pageKey(leaf.key[:c.page])] = leaf
		c.reindex(cur)
		c.reindex(leaf)
		c.nodes++
		c.evictable += n - pos
		c.windowTokens += n - pos
		cur = leaf
	}
	// A snapshot lives on the path's node that holds its last token
	// (start < At ≤ end). The path, root excluded, is listed once, in
	// ascending start, and each snapshot's node found by binary search:
	// climbing from cur for every snapshot cost O(depth) each, cubic over a
	// chain of requests that each extend the previous one by a page.
	var path []*node
	if len(snaps) > 0 {
		for x := cur; x != root; x = x.parent {
			path = append(path, x)
		}
		slices.Reverse(path)
	}
	for _, s := range snaps {
		x := path[sort.Search(len(path), func(i int) bool { return path[i].start >= s.At })-1]
		if x.snaps == nil {
			x.snaps = map[int]Snapshot{}
		}
		old, had := x.snaps[s.At]
		if !had {
			c.snapshots++
		} else if old.StateFrom < s.StateFrom {
			s = old // keep the snapshot that holds more
		}
		x.snaps[s.At] = s
	}
	if cur == root {
		return existing, Handle{}
	}
	return existing, Handle{cur}
}

// Match is the result of MatchPrefix.
type Match struct {
	Matched int     // longest page-aligned prefix of the query that is cached
	Len     int     // longest resumable prefix (≤ Matched): what may be reused
	Vals    []int64 // values (KV slots) of tokens [0, Len)
	// LastMatched is the value of token Matched-1 (0 when Matched is 0): who
	// cached the end of the match even when it is not resumable.
	LastMatched int64
	Node        Handle // the node ending at Len (locked when MatchPrefix was asked to)
	// Refusal is non-nil when Len < Matched: why the cache cannot resume at
	// Matched (missing snapshot, snapshot without the overlap halo, window rows
	// evicted).
	Refusal *ResumeRefusal
}

// MatchPrefix finds the longest cached page-aligned prefix of tokens and the
// longest resumable prefix within it, refreshes the LRU time of the matched
// path, and (when lock is true) locks the returned node atomically with the
// match, so no concurrent eviction can take it.
func (c *RadixCache) MatchPrefix(tokens []int32, lock bool) Match {
	return c.MatchPrefixNS("", tokens, lock)
}

// MatchPrefixNS is MatchPrefix in namespace ns.
func (c *RadixCache) MatchPrefixNS(ns string, tokens []int32, lock bool) Match {
	n := len(tokens) / c.page * c.page
	c.mu.Lock()
	defer c.mu.Unlock()
	c.tick++
	var path []*node
	cur, pos := c.root(ns, false), 0
	if cur == nil {
		n = 0
	}
	for pos < n {
		child := cur.children[pageKey(tokens[pos:pos+c.page])]
		if child == nil {
			break
		}
		child.last = c.tick
		c.reindex(child)
		path = append(path, child)
		l := c.commonPages(child.key, tokens[pos:n])
		pos += l
		if l < len(child.key) {
			break
		}
		cur = child
	}
	m := Match{Matched: pos}
	if pos > 0 {
		x := path[len(path)-1]
		m.LastMatched = x.vals[pos-1-x.start]
	}
	// Candidate resume points: snapshot positions on the path within the match, and 0.
	var cands []int
	for _, x := range path {
		for at := range x.snaps {
			if at <= pos {
				cands = append(cands, at)
			}
		}
	}
	sort.Sort(sort.Reverse(sort.IntSlice(cands)))
	best := 0
	for _, at := range cands {
		if why := c.resumeProblem(path, at); why == "" {
			best = at
			break
		} else if m.Refusal == nil && at == pos {
			m.Refusal = &ResumeRefusal{At: at, Reason: why}
		}
	}
	if best < pos && m.Refusal == nil {
		m.Refusal = &ResumeRefusal{At: pos, Reason: fmt.Sprintf("no compressor-state snapshot kept at token %d", pos)}
	}
	m.Len = best
	// The node that ends exactly at best (splitting if best falls inside one).
	var end *node
	for _, x := range path {
		if x.start < best && best <= x.end() {
			if best < x.end() {
				x = c.split(x, best-x.start)
			}
			end = x
			break
		}
	}
	m.Vals = c.collectVals(end, make([]int64, 0, best))
	if end != nil {
		m.Node = Handle{end}
		if lock {
			c.lockNode(end)
		}
	}
	return m
}

// collectVals appends the values of the path root → n in order.
func (c *RadixCache) collectVals(n *node, dst []int64) []int64 {
	var chain []*node
	for x := n; x != nil && x.parent != nil; x = x.parent {
		chain = append(chain, x)
	}
	for i := len(chain) - 1; i >= 0; i-- {
		dst = append(dst, chain[i].vals...)
	}
	return dst
}

// resumeProblem says what is missing to resume at position at along path
// ("" when nothing is).
func (c *RadixCache) resumeProblem(path []*node, at int) string {
	need := c.sched.Needs(at)
	var snap Snapshot
	found := false
	for _, x := range path {
		if s, ok := x.snaps[at]; ok {
			snap, found = s, true
		}
	}
	if !found {
		return fmt.Sprintf("no compressor-state snapshot kept at token %d", at)
	}
	if snap.StateFrom > need.StateFrom {
		return fmt.Sprintf("snapshot at %d keeps compressor state from token %d, resuming needs it from token %d (unfinished group and the ratio-4 overlap halo)",
			at, snap.StateFrom, need.StateFrom)
	}
	for _, x := range path {
		if !x.window && x.start < at && x.end() > need.WindowFrom {
			lo, hi := max(x.start, need.WindowFrom), min(x.end(), at)
			return fmt.Sprintf("window rows of tokens [%d, %d) were evicted; resuming at %d needs [%d, %d)", lo, hi, at, need.WindowFrom, at)
		}
	}
	return ""
}

func (c *RadixCache) lockNode(n *node) {
	for x := n; x.parent != nil; x = x.parent {
		if x.lock == 0 {
			c.evictable -= len(x.key)
			c.protected += len(x.key)
		}
		x.lock++
		if x.lock == 1 {
			c.reindex(x)
		}
	}
}

// Lock adds a reference to h's node and its ancestors, protecting them from
// eviction. It fails when the node was evicted.
func (c *RadixCache) Lock(h Handle) error {
	if h.n == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if h.n.dead {
		return fmt.Errorf("kvcache: Lock of an evicted prefix node (tokens [%d, %d))", h.n.start, h.n.end())
	}
	c.lockNode(h.n)
	return nil
}

// Unlock removes a reference added by Lock or a locking MatchPrefix. It panics
// when the node is not locked (an unbalanced Unlock is a programmer error).
func (c *RadixCache) Unlock(h Handle) {
	if h.n == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if h.n.lock <= 0 {
		panic("kvcache: RadixCache.Unlock of an unlocked node")
	}
	for x := h.n; x.parent != nil; x = x.parent {
		x.lock--
		if x.lock == 0 {
			c.protected -= len(x.key)
			c.evictable += len(x.key)
			c.reindex(x)
		}
	}
}

func (c *RadixCache) prefixOf(n *node) []int32 {
	out := make([]int32, n.endPos)
	for x := n; x.parent != nil; x = x.parent {
		copy(out[x.start:], x.key)
	}
	return out
}

func rootOf(n *node) *node {
	for n.parent != nil {
		n = n.parent
	}
	return n
}

// walk visits every node (roots excluded) in a deterministic order:
// namespaces sorted, then depth first with children in key order. Only
// CheckInvariants walks the tree.
func (c *RadixCache) walk(f func(*node)) {
	var rec func(*node)
	rec = func(n *node) {
		keys := make([]string, 0, len(n.children))
		for k := range n.children {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			f(n.children[k])
			rec(n.children[k])
		}
	}
	nss := make([]string, 0, len(c.roots))
	for ns := range c.roots {
		nss = append(nss, ns)
	}
	sort.Strings(nss)
	for _, ns := range nss {
		rec(c.roots[ns])
	}
}

// Usage is the cache's accounting.
type Usage struct {
	Tokens       int   // cached tokens (= Evictable + Protected)
	Evictable    int   // tokens in unlocked nodes
	Protected    int   // tokens in locked nodes
	WindowTokens int   // tokens whose window rows are kept
	Snapshots    int   // compressor-state snapshots kept
	Nodes        int   // nodes (root excluded)
	Bytes        int64 // Sizes applied to the counts above
}

// Usage returns the current accounting.
func (c *RadixCache) Usage() Usage {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.usage()
}

func (c *RadixCache) usage() Usage {
	u := Usage{Tokens: c.evictable + c.protected, Evictable: c.evictable, Protected: c.protected,
		WindowTokens: c.windowTokens, Snapshots: c.snapshots, Nodes: c.nodes}
	u.Bytes = int64(u.Tokens)*int64(c.sizes.PrefixBytesPerToken) + int64(u.WindowTokens)*int64(c.sizes.WindowBytesPerToken) +
		int64(u.Snapshots)*int64(c.sizes.SnapshotBytes)
	return u
}

// CheckInvariants recomputes the accounting from the tree and checks the
// structure: page-aligned non-empty keys, children keyed by their first page,
// contiguous positions, one value per token, snapshots inside their node,
// parent locks ≥ child locks, no dead node reachable. It returns the first
// violation.
func (c *RadixCache) CheckInvariants() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var got Usage
	var err error
	var inHeap [2]int
	c.walk(func(n *node) {
		for w := range inHeap {
			if n.hidx[w] >= 0 {
				inHeap[w]++
			}
		}
		if err != nil {
			return
		}
		switch {
		case n.dead:
			err = fmt.Errorf("evicted node [%d, %d) still reachable", n.start, n.end())
		case len(n.key) == 0 || len(n.key)%c.page != 0:
			err = fmt.Errorf("node at %d has %d tokens, not a positive multiple of the page %d", n.start, len(n.key), c.page)
		case len(n.vals) != len(n.key):
			err = fmt.Errorf("node at %d has %d values for %d tokens", n.start, len(n.vals), len(n.key))
		case n.parent.children[pageKey(n.key[:c.page])] != n:
			err = fmt.Errorf("node at %d is not keyed by its first page", n.start)
		case n.endPos != n.start+len(n.key):
			err = fmt.Errorf("node [%d, %d) records end %d", n.start, n.start+len(n.key), n.endPos)
		case n.start != n.parent.end():
			err = fmt.Errorf("node starts at %d, parent ends at %d", n.start, n.parent.end())
		case n.lock < 0 || (n.parent.parent != nil && n.parent.lock < n.lock):
			err = fmt.Errorf("node at %d has lock %d, parent lock %d", n.start, n.lock, n.parent.lock)
		case (n.hidx[inLeaves] >= 0) != (n.lock == 0 && len(n.children) == 0):
			err = fmt.Errorf("node [%d, %d) (lock %d, %d children): eviction-heap membership %v", n.start, n.end(), n.lock, len(n.children), n.hidx[inLeaves] >= 0)
		case (n.hidx[inWindows] >= 0) != (n.lock == 0 && n.window):
			err = fmt.Errorf("node [%d, %d) (lock %d, window %v): window-heap membership %v", n.start, n.end(), n.lock, n.window, n.hidx[inWindows] >= 0)
		}
		for at := range n.snaps {
			if at <= n.start || at > n.end() {
				err = fmt.Errorf("snapshot at %d outside node [%d, %d)", at, n.start, n.end())
			}
		}
		got.Nodes++
		if n.lock > 0 {
			got.Protected += len(n.key)
		} else {
			got.Evictable += len(n.key)
		}
		if n.window {
			got.WindowTokens += len(n.key)
		}
		got.Snapshots += len(n.snaps)
	})
	if err != nil {
		return err
	}
	for _, h := range []*lruHeap{&c.leaves, &c.windows} {
		for i, n := range h.h {
			if n.dead || n.hidx[h.which] != i {
				return fmt.Errorf("heap %d: node [%d, %d) at %d records index %d (dead %v)", h.which, n.start, n.end(), i, n.hidx[h.which], n.dead)
			}
			if i > 0 && lruLess(n, h.h[(i-1)/2]) {
				return fmt.Errorf("heap %d: order broken at %d", h.which, i)
			}
		}
	}
	if c.leaves.Len() != inHeap[inLeaves] || c.windows.Len() != inHeap[inWindows] {
		return fmt.Errorf("heaps hold %d and %d nodes, the tree %d and %d candidates", c.leaves.Len(), c.windows.Len(), inHeap[inLeaves], inHeap[inWindows])
	}
	want := c.usage()
	got.Tokens = got.Evictable + got.Protected
	got.Bytes = want.Bytes
	if got != want {
		return fmt.Errorf("accounting %+v, tree holds %+v", want, got)
	}
	return nil
}
