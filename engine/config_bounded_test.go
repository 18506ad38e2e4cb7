package engine

import (
	"strings"
	"testing"
)

// A config's unknown key and over-long number are echoed bounded.
func TestParseConfigJSONErrorBounded(t *testing.T) {
	for name, body := range map[string]string{
		"field":  `{"` + strings.Repeat("k", 1<<20) + `": 1}`,
		"number": `{"dim": ` + strings.Repeat("9", 1<<20) + `}`,
	} {
		_, err := ParseConfig([]byte(body))
		if err == nil || len(err.Error()) >= 1<<10 || !strings.HasPrefix(err.Error(), "engine: config: json: ") || !strings.Contains(err.Error(), "(1048576 bytes)") {
			msg := "<nil>"
			if err != nil {
				msg = err.Error()
			}
			t.Errorf("%s: error of %d bytes: %.300s", name, len(msg), msg)
		}
	}
}
