package engine

import (
	"fmt"
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

// The same for a V3.2 ModelArgs JSON and a transformers deepseek_v32
// config.json: unknown keys (a megabyte one, or thousands) and numbers of a
// megabyte are echoed bounded.
func TestParseV32ConfigErrorsBounded(t *testing.T) {
	var b strings.Builder
	b.WriteString(`{"kv_lora_rank": 512`)
	for i := range 3000 {
		fmt.Fprintf(&b, `, "k%s%d": 1`, strings.Repeat("x", 200), i)
	}
	many := b.String()
	for name, body := range map[string]string{
		"V3.2 number":        `{"kv_lora_rank": 512, "dim": ` + strings.Repeat("9", 1<<20) + `}`,
		"V3.2 unknown key":   `{"kv_lora_rank": 512, "` + strings.Repeat("k", 1<<20) + `": 1}`,
		"V3.2 many keys":     many + `}`,
		"deepseek_v32 field": `{"model_type": "deepseek_v32", "hidden_size": ` + strings.Repeat("9", 1<<20) + `}`,
	} {
		_, err := ParseConfig([]byte(body))
		if err == nil || len(err.Error()) >= 2<<10 || !strings.HasPrefix(err.Error(), "engine: ") {
			msg := "<nil>"
			if err != nil {
				msg = err.Error()
			}
			t.Errorf("%s: error of %d bytes: %.300s", name, len(msg), msg)
		}
	}
}
