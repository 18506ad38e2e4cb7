package replay

import (
	"fmt"
	"strings"
)

// StepList prints steps as ranges, e.g. "2..7" or "126..128, 254..256".
func StepList(s []int64) string {
	var parts []string
	for i := 0; i < len(s); {
		j := i
		for j+1 < len(s) && s[j+1] == s[j]+1 {
			j++
		}
		if i == j {
			parts = append(parts, fmt.Sprint(s[i]))
		} else {
			parts = append(parts, fmt.Sprintf("%d..%d", s[i], s[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ", ")
}
