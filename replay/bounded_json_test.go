package replay

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A tolerance file's unknown field and over-long number are echoed
// bounded, and the error still names the file.
func TestToleranceFileJSONErrorBounded(t *testing.T) {
	dir := t.TempDir()
	for name, body := range map[string]string{
		"field.json":  `{"` + strings.Repeat("f", 1<<20) + `": 1}`,
		"number.json": `{"fallback": {"mode": "ulp", "max_ulp": ` + strings.Repeat("9", 1<<20) + `}}`,
	} {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		err := DefaultTolerance().LoadToleranceFile(p)
		if err == nil || len(err.Error()) >= 1<<10 || !strings.Contains(err.Error(), "tolerance file "+p+": json: ") || !strings.Contains(err.Error(), "(1048576 bytes)") {
			t.Errorf("%s: error of %d bytes: %.300s", name, len(errText(err)), errText(err))
		}
	}
}

func errText(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}
