package main

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestNoNumericImports holds the CLI to its job (doc.go): it parses flags,
// opens files through the library and prints, so none of its non-test files
// imports a numeric package; what it needs of them goes through replay,
// fault, prefixcheck or engine.
func TestNoNumericImports(t *testing.T) {
	forbidden := map[string]bool{"sparsemla/attention": true, "sparsemla/indexer": true, "sparsemla/kvcache": true, "sparsemla/quant": true}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		pf, err := parser.ParseFile(token.NewFileSet(), f, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		checked++
		for _, im := range pf.Imports {
			p, _ := strconv.Unquote(im.Path.Value)
			if forbidden[p] {
				t.Errorf("%s imports %s: cmd/sparsemla only parses flags, opens files through the library and prints", f, p)
			}
		}
	}
	if checked == 0 {
		t.Fatal("no non-test files found")
	}
}
