package prefixcheck

import "testing"

// Values printed by CPython 3.12 (python3 -c 'print(hash((1, 2, 3)))' ...).
func TestPyTupleHash(t *testing.T) {
	for _, c := range []struct {
		toks []int32
		want int64
	}{
		{nil, 5740354900026072187},
		{[]int32{1, 2, 3}, 529344067295497451},
		{[]int32{5}, -7813438383599366905},
		{[]int32{-1}, 8078679518589016365},
		{[]int32{7, 9}, 8527674585806224592},
		{[]int32{-2147483648, 2147483647, 0}, 2938679873423011792},
	} {
		if got := pyTupleHash(c.toks); got != c.want {
			t.Errorf("hash(tuple(%v)) = %d, want %d", c.toks, got, c.want)
		}
	}
}

func TestPyTupleHashPage16(t *testing.T) {
	toks := make([]int32, 16)
	for i := range toks {
		toks[i] = int32(100000 + i)
	}
	if got := pyTupleHash(toks); got != 1591063121876435633 {
		t.Fatalf("hash(tuple(range(100000, 100016))) = %d", got)
	}
}
