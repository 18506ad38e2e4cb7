package fault

import (
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"

	"sparsemla/prefixcheck"
)

// Written forms of a synthetic run.
const (
	FormEvents = "events" // a vLLM KV-cache event stream (map encoding)
	FormNative = "native" // a native dump (tok records, prefix frames)
)

// PrefixFaultForms says in which written form each injectable decision fault can
// be expressed: a native dump has the request's own tokens (so a hit longer
// than the shared prefix, or not page aligned, shows) but no namespaces,
// evictions or page ids; an event stream has those but not the request's
// tokens outside the stored blocks. resume-beyond-cache needs a run with
// ResumeAtEndOnly (the state is kept only at request ends).
var PrefixFaultForms = map[string]string{
	prefixcheck.KindHitTooLong:   FormNative,
	prefixcheck.KindResumeBeyond: FormNative,
	prefixcheck.KindBeyondCache:  FormNative,
	prefixcheck.KindNamespaceMix: FormEvents,
	prefixcheck.KindMissedHit:    FormEvents,
	prefixcheck.KindEvicted:      FormEvents,
	prefixcheck.KindOverwritten:  FormEvents,
}

// FaultKinds lists the injectable kinds, sorted.
func PrefixFaultKinds() []string {
	var out []string
	for k := range PrefixFaultForms {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Inject inserts one extra request carrying decision fault kind into the
// run, at arrival position at or the first later one where the fault can be
// built without touching what later requests reuse (so exactly that request
// diverges). It returns the request's id ("fault-<kind>", then
// "fault-<kind>-2", ... for more of one kind).
func (s *PrefixRun) Inject(kind string, at int) (string, error) {
	if _, ok := PrefixFaultForms[kind]; !ok {
		return "", fmt.Errorf("prefixcheck: unknown fault kind %q (want %s)", kind, strings.Join(PrefixFaultKinds(), ", "))
	}
	if at < 1 || at > len(s.Requests) {
		return "", fmt.Errorf("prefixcheck: fault position %d: want 1 to %d", at, len(s.Requests))
	}
	for pos := at; pos <= len(s.Requests); pos++ {
		q, ok := s.buildFault(kind, pos)
		if !ok {
			continue
		}
		q.ID, q.Fault = "fault-"+kind, kind
		for n := 2; s.hasID(q.ID); n++ {
			q.ID = fmt.Sprintf("fault-%s-%d", kind, n)
		}
		s.Requests = append(s.Requests[:pos], append([]PrefixRequest{q}, s.Requests[pos:]...)...)
		return q.ID, nil
	}
	return "", fmt.Errorf("prefixcheck: no place at or after request %d of this run to inject %s (try another seed or scenario)", at, kind)
}

func (s *PrefixRun) hasID(id string) bool {
	for _, q := range s.Requests {
		if q.ID == id {
			return true
		}
	}
	return false
}

// usedLater reports whether a request from pos on has the page ending at
// len(prefix) of namespace ns (same tokens), or the engine later evicts it or
// a page below it.
func (s *PrefixRun) usedLater(pos int, ns string, prefix []int32) bool {
	h := blockHash(ns, "", prefix)
	for _, q := range s.Requests[pos:] {
		if q.Namespace == ns && len(q.Tokens) >= len(prefix) && blockHash(q.Namespace, "", q.Tokens[:len(prefix)]) == h {
			return true
		}
		for _, e := range q.Evicted {
			if e.Namespace == ns && len(e.Prefix) >= len(prefix) && blockHash(ns, "", e.Prefix[:len(prefix)]) == h {
				return true
			}
		}
	}
	return false
}

func (s *PrefixRun) freshPage(rng *rand.Rand, avoid int32) []int32 {
	t := make([]int32, s.Options.PageSize)
	for i := range t {
		t[i] = int32(50000 + rng.IntN(50000)) // never a generated token
	}
	if t[0] == avoid {
		t[0]++
	}
	return t
}

// buildFault builds the faulty request for position pos, if one fits.
func (s *PrefixRun) buildFault(kind string, pos int) (PrefixRequest, bool) {
	P := s.Options.PageSize
	rng := rand.New(rand.NewPCG(s.Options.Seed, uint64(pos)))
	c := s.runEngine(pos, false)
	for si := pos - 1; si >= 0; si-- {
		src := &s.Requests[si]
		if src.Fault != "" {
			continue
		}
		m := c.MatchPrefixNS(src.Namespace, src.Tokens, false)
		switch kind {
		case prefixcheck.KindHitTooLong:
			// Reuse one page more than the shared prefix.
			if src.Namespace != "" || m.Len < 2*P || len(src.Tokens) < m.Len {
				continue
			}
			L := m.Len - P
			toks := append(append([]int32(nil), src.Tokens[:L]...), s.freshPage(rng, src.Tokens[L])...)
			return PrefixRequest{Tokens: toks, Hit: L + P, Source: src.ID}, true
		case prefixcheck.KindBeyondCache:
			// Reuse one token past the last cached page.
			if src.Namespace != "" || m.Len < P || len(src.Tokens) <= m.Len {
				continue
			}
			toks := append(append([]int32(nil), src.Tokens[:m.Len+1]...), s.freshPage(rng, -1)...)
			return PrefixRequest{Tokens: toks, Hit: m.Len + 1, Source: src.ID}, true
		case prefixcheck.KindResumeBeyond:
			// Resume at a cached page boundary where no state was kept.
			if !s.Options.ResumeAtEndOnly || src.Namespace != "" {
				continue
			}
			L := m.Matched - P
			for ; L >= P; L -= P {
				if mm := c.MatchPrefixNS("", src.Tokens[:L], false); mm.Matched == L && mm.Len < L {
					break
				}
			}
			if L < P {
				continue
			}
			toks := append(append([]int32(nil), src.Tokens[:L]...), s.freshPage(rng, src.Tokens[L])...)
			return PrefixRequest{Tokens: toks, Hit: L, Source: src.ID}, true
		case prefixcheck.KindNamespaceMix:
			// Build, under another LoRA adapter, on a cached page of the default namespace.
			if src.Namespace != "" || m.Len < P {
				continue
			}
			toks := append(append([]int32(nil), src.Tokens[:m.Len]...), s.freshPage(rng, -1)...)
			return PrefixRequest{Namespace: "lora:fault", Tokens: toks, Hit: m.Len, Source: src.ID, parentNS: src.Namespace}, true
		case prefixcheck.KindMissedHit:
			// Recompute cached pages under other hashes.
			if m.Len < P {
				continue
			}
			return PrefixRequest{Namespace: src.Namespace, Tokens: append([]int32(nil), src.Tokens[:m.Len]...), salt: "recomputed"}, true
		case prefixcheck.KindOverwritten:
			// Store another page under a cached page's hash, one no later request uses.
			if m.Len < P || s.usedLater(pos, src.Namespace, src.Tokens[:m.Len]) {
				continue
			}
			toks := s.freshPage(rng, -1)
			return PrefixRequest{Tokens: toks, hashOf: []prefixcheck.BlockHash{blockHash(src.Namespace, "", src.Tokens[:m.Len])}}, true
		case prefixcheck.KindEvicted:
			// Build on a page the engine evicted earlier, whose pages no
			// later request uses (so the correct cache holding them again
			// afterwards changes nothing).
			aligned := len(src.Tokens) / P * P
			if m.Matched >= aligned || aligned == 0 {
				continue
			}
			end := aligned
			clean := true
			for e := m.Matched + P; e <= end; e += P {
				if s.usedLater(pos, src.Namespace, src.Tokens[:e]) {
					clean = false
					break
				}
			}
			if !clean {
				continue
			}
			toks := append(append([]int32(nil), src.Tokens[:end]...), s.freshPage(rng, -1)...)
			return PrefixRequest{Namespace: src.Namespace, Tokens: toks, Hit: end, Source: src.ID}, true
		}
	}
	return PrefixRequest{}, false
}
