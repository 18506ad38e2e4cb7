package prefixcheck

import (
	"errors"
	"fmt"

	"sparsemla/kvcache"
)

// Statuses of a request.
const (
	StatusAgree     = "agree"     // the engine's decision is the correct cache's
	StatusWarn      = "warn"      // a difference this input cannot prove wrong (no eviction record)
	StatusDiverged  = "diverged"  // the engine's decision is wrong
	StatusUnchecked = "unchecked" // not judged (tokens or hit not recorded)
)

// Kinds of decision (see the package doc).
const (
	KindHitTooLong     = "hit-too-long"
	KindNamespaceMix   = "namespace-mix"
	KindOverwritten    = "overwritten-page"
	KindEvicted        = "evicted-page"
	KindBeyondCache    = "beyond-cache"
	KindResumeBeyond   = "resume-beyond-cache"
	KindMissedHit      = "missed-hit"
	CauseNone          = "none"
	CauseAlignment     = "alignment"
	CauseEviction      = "eviction"
	CauseNamespace     = "namespace"
	CauseResume        = "resume"
	maxNotes           = 20
	firstsDefaultLimit = 1 << 22
)

const (
	stCached uint8 = iota + 1
	stEvictedRecorded
	stEvictedModel
)

type pageHist struct {
	req    int32 // the request that cached it (last)
	state  uint8
	before int32 // evicted before this request's arrival (index)
}

type nsHist struct {
	req int32 // the first request that cached the page (its namespace is the page's)
}

type owner struct {
	chain uint64
	req   int32
}

type reqInfo struct {
	id, ns string
	chains []uint64 // chain hash of each whole page (namespace and extra keys included)
	tokens []int32  // nil once dropped (Config.Retain) or when unknown
	keys   []int32  // tokens with extra keys folded in (nil when equal to tokens or dropped)
	n      int      // tokens known
	// unknown: the request's tokens are not recorded (it was not cached).
	unknown bool
}

type internKey struct {
	tok   int32
	extra string
}

// Runner is the ground-truth run, one request at a time (Add), so a trace
// need not be held in memory.
type Runner struct {
	cfg    Config
	flags  Trace // only the flags are used
	cache  *kvcache.RadixCache
	firsts *kvcache.RadixCache // first pages at token granularity (sub-page sharing)
	flim   int
	reqs   []reqInfo
	byID   map[string]int
	hist   map[uint64]pageHist
	nsHist map[uint64]nsHist
	owners map[string]owner
	intern map[internKey]int32
	rep    *Report
	oldest int     // first request whose tokens are still retained
	vals   []int64 // Insert's value buffer
	// reinsertSnaps inserts a snapshot at every page end of every request,
	// those the cache holds already included (the behaviour before
	// snapsFrom; tests compare the two).
	reinsertSnaps bool
}

// NewRunner starts a ground-truth run; flags carries the trace's HitsRecorded,
// EvictionsRecorded and ContentPageIDs (its requests are ignored).
func NewRunner(cfg Config, flags Trace) (*Runner, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if flags.PageSize != 0 && flags.PageSize != cfg.PageSize {
		return nil, fmt.Errorf("prefixcheck: %s records page size %d, the check was asked for %d", flags.Input, flags.PageSize, cfg.PageSize)
	}
	r := &Runner{cfg: cfg, flags: flags, byID: map[string]int{}, hist: map[uint64]pageHist{},
		nsHist: map[uint64]nsHist{}, owners: map[string]owner{}, intern: map[internKey]int32{}}
	r.cache = kvcache.NewRadixCache(cfg.PageSize, cfg.Schedule, kvcache.Sizes{})
	r.firsts = kvcache.NewRadixCache(1, kvcache.Schedule{}, kvcache.Sizes{})
	r.flim = firstsDefaultLimit
	if cfg.Capacity > 0 && !flags.EvictionsRecorded {
		r.flim = cfg.Capacity
	}
	r.rep = newReport(cfg, flags)
	return r, nil
}

// Run judges every request of t and returns the report.
func Run(t *Trace, cfg Config) (*Report, error) {
	r, err := NewRunner(cfg, *t)
	if err != nil {
		return nil, err
	}
	r.rep.Notes = append(r.rep.Notes, t.Notes...)
	for i := range t.Requests {
		if _, err := r.Add(&t.Requests[i]); err != nil {
			return nil, err
		}
	}
	return r.Report(), nil
}

// Report finishes the run and returns its report (call once, after the last
// Add).
func (r *Runner) Report() *Report {
	r.rep.finish()
	return r.rep
}

func (r *Runner) note(format string, args ...any) {
	if len(r.rep.Notes) < maxNotes {
		r.rep.Notes = append(r.rep.Notes, fmt.Sprintf(format, args...))
	} else if len(r.rep.Notes) == maxNotes {
		r.rep.Notes = append(r.rep.Notes, "(further notes left out)")
	}
}

// fold returns the radix keys of tokens: a token of a page with an extra key
// becomes a negative id interned for (token, extra key), so pages match only
// when tokens and extra keys do.
func (r *Runner) fold(tokens []int32, extra []string) []int32 {
	has := false
	for _, e := range extra {
		if e != "" {
			has = true
			break
		}
	}
	if !has {
		return tokens
	}
	P := r.cfg.PageSize
	out := make([]int32, len(tokens))
	for i, t := range tokens {
		e := ""
		if i/P < len(extra) {
			e = extra[i/P]
		}
		if e == "" {
			out[i] = t
			continue
		}
		k := internKey{t, e}
		id, ok := r.intern[k]
		if !ok {
			id = -1 - int32(len(r.intern))
			r.intern[k] = id
		}
		out[i] = id
	}
	return out
}

// chains returns the chain hash of every whole page of keys (an FNV-1a-style
// multiply-xor over 32-bit keys, then a final mix per page), with and without
// the namespace: equal hashes mean equal prefixes (up to 2^-64 collisions).
func chains(ns string, keys []int32, P int) (withNS, without []uint64) {
	const off, prime = 14695981039346656037, 1099511628211
	h, g := uint64(off), uint64(off)
	for i := 0; i < len(ns); i++ {
		h = (h ^ uint64(ns[i])) * prime
	}
	h = (h ^ 0x1ff) * prime
	n := len(keys) / P
	withNS, without = make([]uint64, n), make([]uint64, n)
	for p := 0; p < n; p++ {
		for _, k := range keys[p*P : (p+1)*P] {
			h = (h ^ uint64(uint32(k))) * prime
			g = (g ^ uint64(uint32(k))) * prime
		}
		withNS[p], without[p] = mix64(h), mix64(g)
	}
	return withNS, without
}

// mix64 is a 64-bit finaliser (splitmix64's), so page hashes spread over all
// bits.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

func val(req, pos int) int64 { return int64(req)<<32 | int64(pos) }
func valReq(v int64) int     { return int(v >> 32) }

// markEvicted records the eviction of removed nodes in the page history.
func (r *Runner) markEvicted(ev []kvcache.Evicted, state uint8, before int) {
	P := r.cfg.PageSize
	for _, e := range ev {
		for p := e.Start / P; p < len(e.Prefix)/P; p++ {
			src := valReq(e.Vals[p*P-e.Start])
			c := r.reqs[src].chains[p]
			h := r.hist[c]
			h.state, h.before = state, int32(before)
			r.hist[c] = h
		}
	}
}

// evictedAlready reports whether the page ending at len(keys) left the
// correct cache earlier (e.g. with a parent the engine evicted first).
func (r *Runner) evictedAlready(ns string, keys []int32) bool {
	c, _ := chains(ns, keys, r.cfg.PageSize)
	h, ok := r.hist[c[len(c)-1]]
	return ok && h.state != stCached
}

func lcp(a, b []int32) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// Add judges one request (the next in arrival order) and caches it.
func (r *Runner) Add(q *Request) (*Result, error) {
	idx := len(r.reqs)
	if _, dup := r.byID[q.ID]; dup {
		return nil, fmt.Errorf("prefixcheck: %s: request %q arrives twice (requests %d and %d)", r.flags.Input, q.ID, r.byID[q.ID], idx)
	}
	if q.Hit != nil && q.Hit.Tokens < 0 {
		return nil, fmt.Errorf("prefixcheck: %s: request %q: negative hit length %d", r.flags.Input, q.ID, q.Hit.Tokens)
	}
	P := r.cfg.PageSize
	// The engine's recorded cache events since the previous request.
	if q.Clear {
		r.cache = kvcache.NewRadixCache(P, r.cfg.Schedule, kvcache.Sizes{})
		r.firsts = kvcache.NewRadixCache(1, kvcache.Schedule{}, kvcache.Sizes{})
		for c, h := range r.hist {
			if h.state == stCached {
				h.state, h.before = stEvictedRecorded, int32(idx)
				r.hist[c] = h
			}
		}
	}
	for _, e := range q.Evictions {
		keys := r.fold(e.Prefix, e.Extra)
		if len(keys) == 0 || len(keys)%P != 0 {
			return nil, fmt.Errorf("prefixcheck: %s: before request %q: evicted prefix of %d tokens is not a whole number of pages (%d)", r.flags.Input, q.ID, len(keys), P)
		}
		ev, err := r.cache.Remove(e.Namespace, keys)
		if err != nil {
			return nil, fmt.Errorf("prefixcheck: %s: before request %q: %w", r.flags.Input, q.ID, err)
		}
		if len(ev) == 0 && !r.evictedAlready(e.Namespace, keys) {
			r.rep.Summary.UnknownEvictions++
			r.note("before request %q the engine evicted page %s (tokens [%d, %d)), which the correct cache did not hold", q.ID, e.PageID, len(keys)-P, len(keys))
		}
		r.markEvicted(ev, stEvictedRecorded, idx)
	}

	info := reqInfo{id: q.ID, ns: q.Namespace, n: len(q.Tokens)}
	res := &Result{Index: idx, ID: q.ID, Namespace: q.Namespace, Tokens: len(q.Tokens), Status: StatusAgree}
	if q.Hit != nil {
		res.Recorded = &HitInfo{Tokens: q.Hit.Tokens, Source: q.Hit.Source}
	}
	if len(q.Tokens) == 0 && (q.Unknown != "" || q.Hit != nil && q.Hit.Tokens > 0) {
		res.Status, res.Detail = StatusUnchecked, q.Unknown
		info.unknown = true
		if res.Detail == "" {
			res.Detail = "the request's tokens are not recorded"
		}
		r.reqs = append(r.reqs, info)
		r.byID[q.ID] = idx
		r.rep.add(res)
		return res, nil
	}
	keys := r.fold(q.Tokens, q.Extra)
	withNS, without := chains(q.Namespace, keys, P)
	info.chains, info.tokens = withNS, q.Tokens
	if len(keys) > 0 && &keys[0] != &q.Tokens[0] {
		info.keys = keys
	}
	r.reqs = append(r.reqs, info)
	r.byID[q.ID] = idx

	// The correct cache's hit.
	m := r.cache.MatchPrefixNS(q.Namespace, keys, true)
	res.Truth = r.hitInfo(m, len(keys))
	if q.Unknown != "" {
		// Not judged (e.g. its source is not in the input), but its tokens
		// are known: the engine cached them, so the correct cache does too.
		res.Status, res.Detail = StatusUnchecked, q.Unknown
	} else {
		r.judge(q, res, keys, withNS, without, m)
	}

	// Cache the request: make room (the model's LRU), insert, release.
	aligned := len(keys) / P * P
	if r.cfg.Capacity > 0 && !r.flags.EvictionsRecorded {
		if over := r.cache.Usage().Tokens + aligned - m.Matched - r.cfg.Capacity; over > 0 {
			r.markEvicted(r.cache.Evict(over), stEvictedModel, idx)
		}
	}
	if cap(r.vals) < aligned {
		r.vals = make([]int64, aligned)
	}
	vals := r.vals[:aligned] // Insert copies what it keeps
	for i := range vals {
		vals[i] = val(idx, i)
	}
	// The snapshots the cache holds already are left out (snapsFrom).
	var snaps []kvcache.Snapshot
	for at := r.snapsFrom(m); at <= aligned; at += P {
		if (!r.cfg.ResumeAtEndOnly || at == aligned) && (at != m.Len || r.reinsertSnaps) {
			snaps = append(snaps, kvcache.Snapshot{At: at, StateFrom: r.cfg.Schedule.StateFrom(at)})
		}
	}
	existing, _ := r.cache.InsertNS(q.Namespace, keys[:aligned], vals, snaps)
	r.cache.Unlock(m.Node)
	for p := existing / P; p < aligned/P; p++ {
		r.hist[withNS[p]] = pageHist{req: int32(idx), state: stCached}
	}
	for p := range without {
		if _, ok := r.nsHist[without[p]]; !ok {
			r.nsHist[without[p]] = nsHist{req: int32(idx)}
		}
	}
	fl := min(len(keys), P)
	if r.firsts.Usage().Tokens+fl > r.flim {
		r.firsts.Evict(r.firsts.Usage().Tokens + fl - r.flim)
	}
	fv := make([]int64, fl)
	for i := range fv {
		fv[i] = val(idx, i)
	}
	r.firsts.InsertNS(q.Namespace, keys[:fl], fv, nil)
	r.writePages(q, res, withNS, idx)
	// Retention of token streams.
	if r.cfg.Retain > 0 {
		for ; r.oldest <= idx-r.cfg.Retain; r.oldest++ {
			r.reqs[r.oldest].tokens, r.reqs[r.oldest].keys = nil, nil
		}
	}
	r.rep.add(res)
	return res, nil
}

// snapsFrom is the first page end at which Add inserts a snapshot for a
// request matched as m; Add also leaves out the one at m.Len. InsertNS keeps,
// at a position, the snapshot that holds more state (the smaller StateFrom),
// and every snapshot this cache gets is Snapshot{at, Schedule.StateFrom(at)}
// (Add is its only source), so inserting one at a page end that holds one
// already is a no-op. Add leaves those out where they are provably held when
// it inserts:
//
//   - m.Len: MatchPrefix resumes only where a snapshot is kept;
//   - every page end below m.Len when the cache holds a snapshot at every page
//     end: as many snapshots as page ends (Usage: Tokens/P; a node's
//     snapshots sit at distinct page ends of its own tokens, so the count
//     reaches Tokens/P only when none is missing). Without ResumeAtEndOnly
//     this always holds (each insert brings a snapshot at every page end of
//     the request, the new node's included); should it not, Add starts at
//     the first page end as before.
//
// Both stay held until the insert: the match locked the nodes of [0, m.Len],
// so the capacity eviction cannot remove them, and a live node loses no
// snapshot (a split keeps each on the node that holds its position).
//
// Not provably held, so inserted as before: the page ends of (m.Len,
// m.Matched], which are not locked (the capacity eviction may remove them
// before the insert) and, m.Len having stopped short of m.Matched, may lack
// a snapshot — with ResumeAtEndOnly a request that ends inside an earlier
// request's tokens adds its resume point there: that insert is not
// redundant — and those beyond m.Matched (new nodes). With ResumeAtEndOnly Add inserts at
// the request's end only, left out when it is m.Len.
func (r *Runner) snapsFrom(m kvcache.Match) int {
	P := r.cfg.PageSize
	if m.Len == 0 || r.reinsertSnaps {
		return P
	}
	if u := r.cache.Usage(); u.Snapshots*P == u.Tokens {
		return m.Len
	}
	return P
}

// hitInfo describes the correct cache's match m of a request of n tokens.
func (r *Runner) hitInfo(m kvcache.Match, n int) *HitInfo {
	P := r.cfg.PageSize
	h := &HitInfo{Tokens: m.Len, Matched: m.Matched}
	if m.Refusal != nil {
		h.Refusal = m.Refusal.Reason
	}
	for p := 0; p < m.Len/P; p++ {
		src := r.reqs[valReq(m.Vals[p*P])].id
		if k := len(h.Pages); k > 0 && h.Pages[k-1].Source == src && h.Pages[k-1].To == p {
			h.Pages[k-1].To = p + 1
		} else {
			h.Pages = append(h.Pages, PageRun{Source: src, From: p, To: p + 1})
		}
	}
	if m.Len > 0 {
		h.Source = h.Pages[len(h.Pages)-1].Source
	}
	h.Resume = r.resume(m.Len)
	return h
}

func (r *Runner) resume(at int) *Resume {
	nd := r.cfg.Schedule.Needs(at)
	rs := &Resume{At: at, WindowFrom: nd.WindowFrom, StateFrom: nd.StateFrom, IndexKeys: nd.IndexKeys}
	for _, ratio := range r.cfg.Schedule.Ratios {
		if ratio == 4 {
			rs.Halo = at > 0
		}
	}
	return rs
}

// keysOf returns the radix keys of a retained request (nil when dropped).
func (ri *reqInfo) keysOf() []int32 {
	if ri.keys != nil {
		return ri.keys
	}
	return ri.tokens
}

// judge sets res's status and kind from the recorded hit and the correct
// cache's match m.
func (r *Runner) judge(q *Request, res *Result, keys []int32, withNS, without []uint64, m kvcache.Match) {
	P := r.cfg.PageSize
	T := m.Len
	if q.Hit == nil && !r.flags.HitsRecorded {
		res.Status, res.Detail = StatusUnchecked, "the input records no hit for this request"
		return
	}
	M := 0
	src := ""
	if q.Hit != nil {
		M, src = q.Hit.Tokens, q.Hit.Source
	}
	if M > len(keys) {
		res.Status = StatusUnchecked
		res.Detail = fmt.Sprintf("the engine reused %d tokens but only %d of the request's tokens are recorded", M, len(keys))
		return
	}
	diverge := func(kind, format string, args ...any) {
		res.Status, res.Kind, res.Detail = StatusDiverged, kind, fmt.Sprintf(format, args...)
	}
	if M > 0 && src != "" {
		si, ok := r.byID[src]
		switch {
		case !ok || si == res.Index:
			diverge(KindBeyondCache, "the engine reused %d tokens of request %q, which had not arrived before this request", M, src)
			return
		case r.reqs[si].ns != q.Namespace:
			diverge(KindNamespaceMix, "the engine reused %d tokens of request %q of namespace %q; this request is in namespace %q (prefixes of different namespaces never match)", M, src, r.reqs[si].ns, q.Namespace)
			return
		}
		s := &r.reqs[si]
		if s.unknown {
			res.Status = StatusUnchecked
			res.Detail = fmt.Sprintf("the engine reused %d tokens of request %q, whose tokens are not recorded", M, src)
			return
		}
		if sk := s.keysOf(); sk != nil || s.n == 0 {
			if l := lcp(keys[:M], sk); l < M {
				fd := &TokenDiff{Pos: l, Token: int64(q.Tokens[l]), SourceEnds: l >= len(sk)}
				if !fd.SourceEnds {
					fd.SourceToken = int64(s.tokens[l])
				}
				res.FirstDiff = fd
				if fd.SourceEnds {
					diverge(KindHitTooLong, "the engine reused %d tokens of request %q, which has only %d tokens", M, src, len(sk))
				} else if fd.Token == fd.SourceToken {
					diverge(KindHitTooLong, "the engine reused %d tokens of request %q; the two share %d: page %d's extra keys (multimodal input) differ", M, src, l, l/P)
				} else {
					diverge(KindHitTooLong, "the engine reused %d tokens of request %q; the two share only %d: token %d is %d here, %d there", M, src, l, l, fd.Token, fd.SourceToken)
				}
				return
			}
		} else {
			for p := 0; p < M/P && p < len(s.chains); p++ {
				if s.chains[p] != withNS[p] {
					diverge(KindHitTooLong, "the engine reused %d tokens of request %q; page %d (tokens [%d, %d)) differs (that request's tokens are no longer retained: compared by page hash)", M, src, p, p*P, (p+1)*P)
					return
				}
			}
			if M/P > len(s.chains) {
				diverge(KindHitTooLong, "the engine reused %d tokens of request %q, which has fewer whole pages (%d)", M, src, len(s.chains))
				return
			}
			if M%P != 0 {
				res.Detail = fmt.Sprintf("tokens [%d, %d) were not compared with request %q (no longer retained)", M/P*P, M, src)
			}
		}
	}
	// Page ids of the hit: each must hold this prefix's content.
	for p := 0; p < M/P && p < len(q.PageIDs); p++ {
		o, ok := r.owners[q.PageIDs[p]]
		if ok && o.chain != withNS[p] {
			diverge(KindOverwritten, "the engine served page %s for tokens [%d, %d), but that page holds request %q's tokens (written after the prefix was cached)", q.PageIDs[p], p*P, (p+1)*P, r.reqs[o.req].id)
			return
		}
	}
	switch {
	case M == T:
		r.missCause(q, res, keys, withNS, without, m, T)
		return
	case M < T:
		res.Kind, res.Cause = KindMissedHit, CauseNone
		res.Detail = fmt.Sprintf("the engine reused %d tokens; the correct cache held %d resumable tokens of this namespace (from request %q)", M, T, res.Truth.Source)
		if q.MissExplained != "" {
			res.Status = StatusWarn
			res.Detail += "; " + q.MissExplained
		} else if r.flags.EvictionsRecorded {
			res.Status = StatusDiverged
		} else {
			res.Status = StatusWarn
			res.Detail += "; the input records no evictions, so the engine may have evicted them"
		}
		return
	}
	// M > T: the engine reused more than the correct cache could serve.
	if M%P != 0 {
		diverge(KindBeyondCache, "the engine reused %d tokens, not a whole number of pages (%d): only whole pages are cached, the correct cache serves %d", M, P, T)
		return
	}
	if m.Matched >= M {
		mm := r.cache.MatchPrefixNS(q.Namespace, keys[:M], false)
		why := "not resumable"
		if mm.Refusal != nil {
			why = mm.Refusal.Reason
		}
		res.Recorded.Resume = r.resume(M)
		diverge(KindResumeBeyond, "the engine resumed at %d; tokens [0, %d) are cached but the state to resume there is not: %s (the correct cache resumes at %d)", M, M, why, T)
		return
	}
	k := m.Matched / P
	h, seen := r.hist[withNS[k]]
	switch {
	case seen && h.state == stEvictedRecorded:
		diverge(KindEvicted, "the engine reused %d tokens; page %d (tokens [%d, %d), cached by request %q) was evicted by the engine before request %q", M, k, k*P, (k+1)*P, r.reqs[h.req].id, r.reqs[h.before].id)
	case seen && h.state == stEvictedModel:
		res.Status, res.Kind = StatusWarn, KindEvicted
		res.Detail = fmt.Sprintf("the engine reused %d tokens; page %d (tokens [%d, %d), cached by request %q) was evicted from the correct cache (LRU, capacity %d tokens) before request %q; the input records no evictions, so the engine may hold more", M, k, k*P, (k+1)*P, r.reqs[h.req].id, r.cfg.Capacity, r.reqs[h.before].id)
	default:
		diverge(KindBeyondCache, "the engine reused %d tokens; no earlier request of this namespace cached page %d (tokens [%d, %d)): the correct cache serves %d", M, k, k*P, (k+1)*P, T)
	}
}

// missCause explains, for a request whose hit agrees with the correct
// cache's, tokens it shares with an earlier request but could not reuse.
func (r *Runner) missCause(q *Request, res *Result, keys []int32, withNS, without []uint64, m kvcache.Match, T int) {
	P := r.cfg.PageSize
	set := func(cause, format string, args ...any) {
		res.Kind, res.Cause, res.Detail = KindMissedHit, cause, fmt.Sprintf(format, args...)
	}
	if m.Matched > T {
		set(CauseResume, "tokens [%d, %d) are cached but not resumable: %s", T, m.Matched, res.Truth.Refusal)
		return
	}
	k := T / P
	if k < len(withNS) {
		if h, ok := r.hist[withNS[k]]; ok && h.state != stCached {
			how := "by the engine"
			if h.state == stEvictedModel {
				how = fmt.Sprintf("from the correct cache (LRU, capacity %d tokens)", r.cfg.Capacity)
			}
			set(CauseEviction, "page %d (tokens [%d, %d)) was cached by request %q and evicted %s before request %q", k, k*P, (k+1)*P, r.reqs[h.req].id, how, r.reqs[h.before].id)
			return
		}
		if h, ok := r.nsHist[without[k]]; ok && r.reqs[h.req].ns != q.Namespace {
			set(CauseNamespace, "page %d (tokens [%d, %d)) is shared with request %q of namespace %q (this request: %q); namespaces never share", k, k*P, (k+1)*P, r.reqs[h.req].id, r.reqs[h.req].ns, q.Namespace)
			return
		}
	}
	// Sub-page sharing: the shared tokens end inside page k.
	best, with := T, -1
	if T == 0 {
		fm := r.firsts.MatchPrefixNS(q.Namespace, keys[:min(len(keys), P)], false)
		if fm.Matched > 0 {
			best, with = fm.Matched, valReq(fm.LastMatched)
		}
	} else {
		for _, pr := range res.Truth.Pages[len(res.Truth.Pages)-1:] {
			si := r.byID[pr.Source]
			if sk := r.reqs[si].keysOf(); sk != nil {
				if l := lcp(keys, sk); l > best {
					best, with = l, si
				}
			}
		}
	}
	if with >= 0 && best > T {
		res.AlignmentLoss = best - T
		set(CauseAlignment, "shares %d tokens with request %q, but the page size is %d: only %d are reusable", best, r.reqs[with].id, P, T)
	}
}

// writePages records the content of the pages the request wrote.
func (r *Runner) writePages(q *Request, res *Result, withNS []uint64, idx int) {
	P := r.cfg.PageSize
	start := 0
	if q.Hit != nil {
		start = q.Hit.Tokens / P
	}
	for p := start; p < len(q.PageIDs) && p < len(withNS); p++ {
		id := q.PageIDs[p]
		if o, ok := r.owners[id]; ok && r.flags.ContentPageIDs && o.chain != withNS[p] {
			if h := r.hist[o.chain]; h.state == stCached && res.Status != StatusDiverged {
				res.Status, res.Kind = StatusDiverged, KindOverwritten
				res.Detail = fmt.Sprintf("page id %s (tokens [%d, %d)) is stored with this request's content while it still holds request %q's (one content address, two contents)", id, p*P, (p+1)*P, r.reqs[o.req].id)
			}
		}
		r.owners[id] = owner{chain: withNS[p], req: int32(idx)}
	}
}

var errNoRequests = errors.New("prefixcheck: the input has no requests")
