package prefixcheck_test

import (
	"os"

	"sparsemla/kvcache"
	"sparsemla/prefixcheck"
)

// A two-request run: B claims to reuse 8 tokens of A, but the two share only
// the first page.
func Example() {
	tok := func(s string) []int32 {
		out := make([]int32, len(s))
		for i, c := range s {
			out[i] = int32(c)
		}
		return out
	}
	tr := &prefixcheck.Trace{Input: "example", Format: "memory", HitsRecorded: true, Requests: []prefixcheck.Request{
		{ID: "A", Tokens: tok("abcdefgh")},
		{ID: "B", Tokens: tok("abcdxyzw"), Hit: &prefixcheck.Hit{Tokens: 8, Source: "A"}},
	}}
	rep, err := prefixcheck.Run(tr, prefixcheck.Config{PageSize: 4, Schedule: kvcache.Schedule{Window: 4, Ratios: []int{0, 4}}})
	if err != nil {
		panic(err)
	}
	rep.WriteText(os.Stdout)
	// Output:
	// prefix example (memory): diverged: 2 requests: 1 agree, 0 warn, 1 diverged, 0 unchecked
	//   correct cache: page 4, window 4, ratios [0 4], capacity unbounded; hits recorded
	//   reused tokens: engine 8, correct cache 4
	//   diverged: request "B" (#1): hit-too-long: the engine reused 8 tokens of request "A"; the two share only 4: token 4 is 120 here, 101 there
	//       correct cache: tokens 0..3 from "A" (pages [0, 1) of "A"), resume at 4: window rows [0, 4), compressor state from 0 (with the ratio-4 halo)
	//       engine:        tokens 0..7 from "A"
	// first divergence: request "B" (#1): hit-too-long: the engine reused 8 tokens of request "A"; the two share only 4: token 4 is 120 here, 101 there
}
