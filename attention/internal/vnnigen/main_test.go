package main

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// TestGeneratedFileUpToDate holds the attention package's
// index_vnni_amd64.s to the generator: the file must be generate's output,
// byte for byte (an edit of the file by hand, or of the generator without
// go generate, fails here).
func TestGeneratedFileUpToDate(t *testing.T) {
	name := filepath.Join("..", "..", outFile)
	have, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	want := generate()
	if bytes.Equal(have, want) {
		return
	}
	// The first line that differs, for the message.
	n := min(len(have), len(want))
	i := 0
	for i < n && have[i] == want[i] {
		i++
	}
	line := 1 + bytes.Count(have[:i], []byte("\n"))
	t.Errorf("%s is not the generator's output (first difference on line %d); run go generate ./attention", name, line)
}
