package fault

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"

	"sparsemla/dump"
	"sparsemla/kvcache"
	"sparsemla/prefixcheck"
)

// Synthetic serving runs: requests whose prefix-cache decisions a correct
// engine (a kvcache.RadixCache with the run's page size, schedule and
// capacity) made, written as a KV-cache event stream or a native dump, and
// decision faults injected into them. A clean run checks to all-agree; a run
// with one fault checks to exactly that request diverging with that kind.

// Synthetic scenarios.
const (
	ScenarioSystemPrompts = "system-prompts" // a few shared system prompts (some under a LoRA adapter), unique user turns
	ScenarioBranching     = "branching"      // conversations that continue or branch from earlier requests
	ScenarioEviction      = "eviction"       // branching under a cache too small for the working set
)

// PrefixScenarios lists the synthetic scenarios.
var PrefixScenarios = []string{ScenarioSystemPrompts, ScenarioBranching, ScenarioEviction}

// PrefixOptions configures a synthetic run.
type PrefixOptions struct {
	Scenario string
	Requests int    // requests in the run (default 24)
	Seed     uint64 // token and shape choices
	PageSize int    // default 16
	Schedule kvcache.Schedule
	// Capacity is the engine's cache in tokens (LRU); 0: unbounded, except
	// the eviction scenario, where 0 means 6 requests' worth.
	Capacity int
	// NoNamespaces keeps every request in the default namespace (native
	// dumps cannot say a request's namespace).
	NoNamespaces bool
	// ResumeAtEndOnly: the engine keeps the compressor state only at the end
	// of each cached request, so it resumes only there (prefixcheck.Config's field).
	ResumeAtEndOnly bool
}

// PrefixRequest is one request of a synthetic run and the engine's decision.
type PrefixRequest struct {
	ID        string
	Namespace string
	Tokens    []int32
	Hit       int    // tokens reused
	Source    string // from this request
	// Evicted lists what the engine evicted before this request (LRU, to
	// make room for it after its lookup).
	Evicted []kvcache.Evicted
	// Fault is the decision fault this request carries ("" for none), with
	// what the stream writer needs to express it.
	Fault    string
	parentNS string                  // namespace of the parent block (namespace-mix)
	salt     string                  // block hash salt (missed-hit: same content, other hashes)
	hashOf   []prefixcheck.BlockHash // block hashes to use (overwritten-page)
}

// PrefixRun is a synthetic serving run.
type PrefixRun struct {
	Options  PrefixOptions
	Requests []PrefixRequest
}

func (o *PrefixOptions) defaults() error {
	if o.Requests == 0 {
		o.Requests = 24
	}
	if o.PageSize == 0 {
		o.PageSize = 16
	}
	if o.Schedule.Window == 0 && o.Schedule.Ratios == nil {
		o.Schedule = kvcache.Schedule{Window: 8, Ratios: []int{0, 4, 128}}
	}
	if o.Scenario == ScenarioEviction && o.Capacity == 0 {
		o.Capacity = 6 * 8 * o.PageSize
	}
	switch {
	case o.Requests < 2 || o.Requests > 1<<16:
		return fmt.Errorf("prefixcheck: synth: %d requests (2 to 65536)", o.Requests)
	case o.PageSize < 1 || o.PageSize > 1024:
		return fmt.Errorf("prefixcheck: synth: page size %d (1 to 1024)", o.PageSize)
	case o.Capacity < 0:
		return fmt.Errorf("prefixcheck: synth: capacity %d", o.Capacity)
	}
	for _, s := range PrefixScenarios {
		if s == o.Scenario {
			return nil
		}
	}
	return fmt.Errorf("prefixcheck: synth: unknown scenario %q (want %s)", o.Scenario, strings.Join(PrefixScenarios, ", "))
}

// prefixcheck.Config is the correct cache's configuration for checking the run.
func (s *PrefixRun) Config() prefixcheck.Config {
	return prefixcheck.Config{PageSize: s.Options.PageSize, Schedule: s.Options.Schedule, Capacity: s.Options.Capacity, ResumeAtEndOnly: s.Options.ResumeAtEndOnly}
}

// Synth generates a run with a correct engine's decisions.
func SynthPrefix(opt PrefixOptions) (*PrefixRun, error) {
	if err := opt.defaults(); err != nil {
		return nil, err
	}
	P := opt.PageSize
	rng := rand.New(rand.NewPCG(opt.Seed, 0x5eed))
	fresh := func(n int) []int32 {
		t := make([]int32, n)
		for i := range t {
			t[i] = int32(rng.IntN(50000))
		}
		return t
	}
	// System prompts of 2-4 pages and a part of a page.
	var prompts [][]int32
	for i := 0; i < 4; i++ {
		prompts = append(prompts, fresh((2+rng.IntN(3))*P+rng.IntN(P)))
	}
	run := &PrefixRun{Options: opt}
	var tokens [][]int32
	var nss []string
	for i := 0; i < opt.Requests; i++ {
		ns := ""
		var t []int32
		if opt.Scenario == ScenarioSystemPrompts || len(tokens) == 0 || rng.IntN(4) == 0 {
			k := rng.IntN(len(prompts))
			t = append(append(t, prompts[k]...), fresh(P/2+rng.IntN(3*P))...)
			if !opt.NoNamespaces && k == 0 && rng.IntN(2) == 0 {
				ns = "lora:adapter-a"
			}
		} else {
			j := rng.IntN(len(tokens))
			ns = nss[j]
			cut := len(tokens[j])
			if rng.IntN(2) == 0 {
				cut = rng.IntN(len(tokens[j]) + 1)
			}
			t = append(append(t, tokens[j][:cut]...), fresh(P/2+rng.IntN(2*P))...)
		}
		tokens, nss = append(tokens, t), append(nss, ns)
		run.Requests = append(run.Requests, PrefixRequest{ID: "req" + strconv.Itoa(i), Namespace: ns, Tokens: t})
	}
	run.decide()
	return run, nil
}

// decide runs the correct engine over the requests in order and records its
// hits and evictions (injected requests take part like the others).
func (s *PrefixRun) decide() { s.runEngine(len(s.Requests), true) }

// engine runs the correct engine over the first n requests (skipping injected
// ones) and returns its cache; record stores the decisions in the requests.
func (s *PrefixRun) runEngine(n int, record bool) *kvcache.RadixCache {
	P := s.Options.PageSize
	c := kvcache.NewRadixCache(P, s.Options.Schedule, kvcache.Sizes{})
	for i := 0; i < n; i++ {
		q := &s.Requests[i]
		if q.Fault != "" {
			continue // its decision is the fault's
		}
		if !record {
			q = &PrefixRequest{ID: q.ID, Namespace: q.Namespace, Tokens: q.Tokens}
		}
		m := c.MatchPrefixNS(q.Namespace, q.Tokens, true)
		q.Hit, q.Source, q.Evicted = m.Len, "", nil
		if m.Len > 0 {
			q.Source = s.Requests[prefixValReq(m.Vals[m.Len-1])].ID
		}
		aligned := len(q.Tokens) / P * P
		if s.Options.Capacity > 0 {
			if over := c.Usage().Tokens + aligned - m.Matched - s.Options.Capacity; over > 0 {
				q.Evicted = c.Evict(over)
			}
		}
		vals := make([]int64, aligned)
		for j := range vals {
			vals[j] = prefixVal(i, j)
		}
		var snaps []kvcache.Snapshot
		for at := P; at <= aligned; at += P {
			if !s.Options.ResumeAtEndOnly || at == aligned {
				snaps = append(snaps, kvcache.Snapshot{At: at, StateFrom: s.Options.Schedule.StateFrom(at)})
			}
		}
		c.InsertNS(q.Namespace, q.Tokens[:aligned], vals, snaps)
		c.Unlock(m.Node)
	}
	return c
}

// blockHash is the synthetic engine's content hash of the page ending at
// end: namespace, salt and every token before end (an int hash below 2^63).
func blockHash(ns, salt string, tokens []int32) prefixcheck.BlockHash {
	const off, prime = 14695981039346656037, 1099511628211
	h := uint64(off)
	for _, s := range []string{ns, "\xff", salt, "\xff"} {
		for i := 0; i < len(s); i++ {
			h = (h ^ uint64(s[i])) * prime
		}
	}
	var b [4]byte
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(b[:], uint32(t))
		for _, x := range b {
			h = (h ^ uint64(x)) * prime
		}
	}
	return prefixcheck.BlockHash(strconv.FormatUint(h>>1, 10))
}

func loraName(ns string) string { return strings.TrimPrefix(ns, "lora:") }

// Events writes the run as vLLM would publish it: per request one batch with
// a BlockRemoved for every page the engine evicted before it (deepest pages
// first) and a BlockStored of its new whole pages (parent: the last reused
// page).
func (s *PrefixRun) Events() []prefixcheck.EventBatch {
	P := s.Options.PageSize
	var out []prefixcheck.EventBatch
	for i := range s.Requests {
		q := &s.Requests[i]
		b := prefixcheck.EventBatch{TS: float64(i)}
		for _, e := range q.Evicted {
			var hs []prefixcheck.BlockHash
			for end := len(e.Prefix); end > e.Start; end -= P {
				hs = append(hs, blockHash(e.Namespace, "", e.Prefix[:end]))
			}
			b.Events = append(b.Events, prefixcheck.Event{Type: "BlockRemoved", BlockHashes: hs, Medium: "GPU"})
		}
		aligned := len(q.Tokens) / P * P
		if q.Hit/P*P < aligned {
			ev := prefixcheck.Event{Type: "BlockStored", BlockSize: P, Medium: "GPU", TokenIDs: q.Tokens[q.Hit/P*P : aligned]}
			if q.Hit >= P {
				pns := q.Namespace
				if q.parentNS != "" || q.Fault == prefixcheck.KindNamespaceMix {
					pns = q.parentNS
				}
				ev.Parent = blockHash(pns, "", q.Tokens[:q.Hit/P*P])
			}
			for end := q.Hit/P*P + P; end <= aligned; end += P {
				ev.BlockHashes = append(ev.BlockHashes, blockHash(q.Namespace, q.salt, q.Tokens[:end]))
			}
			if q.hashOf != nil {
				ev.BlockHashes = q.hashOf
			}
			if q.Namespace != "" {
				ev.LoraName = loraName(q.Namespace)
			}
			b.Events = append(b.Events, ev)
		}
		out = append(out, b)
	}
	return out
}

// EventID is the id the checker gives request id in the run's event stream
// (Events): "b<batch>.e<event>" of its BlockStored event ("" when it stores
// no page).
func (s *PrefixRun) EventID(id string) string {
	for i, b := range s.Events() {
		if s.Requests[i].ID == id {
			if n := len(b.Events); n > 0 && b.Events[n-1].Type == "BlockStored" {
				return fmt.Sprintf("b%d.e%d", i, n-1)
			}
			return ""
		}
	}
	return ""
}

// WriteNative writes the run as a native dump: one tok record per position of
// every request and a prefix frame for every hit. It fails when the run has
// namespaces (a native dump cannot say them). Evictions are not recorded: a
// check with the run's capacity (prefixcheck.Config) replays the same LRU.
func (s *PrefixRun) WriteNative(path string, h dump.Header) error {
	for _, q := range s.Requests {
		if q.Namespace != "" {
			return fmt.Errorf("prefixcheck: synth: request %s is in namespace %q: a native dump cannot say so (use NoNamespaces or the event stream)", q.ID, q.Namespace)
		}
	}
	w, err := dump.Create(path, h)
	if err != nil {
		return err
	}
	data := make([]byte, 8)
	for _, q := range s.Requests {
		for p, tok := range q.Tokens {
			binary.LittleEndian.PutUint64(data, uint64(tok))
			rec := dump.Record{Key: dump.Key{Request: q.ID, Step: p, Layer: -1, Stage: "tok"}, Kind: dump.KindStage, DType: dump.I64, Shape: []int{1}, Data: data}
			if err := w.Write(&rec); err != nil {
				w.Abort() // nothing partial at path
				return err
			}
		}
		if q.Hit > 0 {
			if err := w.WritePrefix(dump.PrefixHit{Request: q.ID, Source: q.Source, Tokens: q.Hit}); err != nil {
				w.Abort() // nothing partial at path
				return err
			}
		}
	}
	return w.Close()
}

// prefixVal is the value the correct engine stores per token: its request and
// position, so a match names who cached what.
func prefixVal(req, pos int) int64 { return int64(req)<<32 | int64(pos) }
func prefixValReq(v int64) int     { return int(v >> 32) }
