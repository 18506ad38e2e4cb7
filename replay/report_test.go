package replay

import (
	"slices"
	"testing"
)

// TestUnusedOverrides: an override whose stage no result compared is listed
// (once), the fallback never; lse goes with o.
func TestUnusedOverrides(t *testing.T) {
	res := []StageResult{{Stage: "o", Status: StatusPass}, {Stage: "u", Status: StatusMissing}, {Stage: "q_a", Status: StatusSkipped}, {Stage: "iw", Status: StatusTie}}
	got := unusedOverrides([]string{"o=exact", "u=exact", "*=ulp,max_ulp=2", "q_a=exact", "u=ulp,max_ulp=1", "iw=exact", "lse=exact", "kv=exact"}, res)
	if want := []string{"u", "q_a", "kv"}; !slices.Equal(got, want) {
		t.Fatalf("unused %v, want %v", got, want)
	}
	if got := unusedOverrides([]string{"lse=exact"}, res[1:]); !slices.Equal(got, []string{"lse"}) {
		t.Fatalf("lse without o compared: unused %v, want [lse]", got)
	}
}
