package htmlreport

import (
	"bytes"
	"context"
	"html"
	"strings"
	"testing"

	"sparsemla/fault"
	"sparsemla/replay"
)

// TestWritePage: the page of a diverged replay is self-contained (inline SVG,
// nothing loaded from elsewhere), carries the verdict and the first
// divergence, and is the same bytes when written twice.
func TestWritePage(t *testing.T) {
	f := fault.Fault{Kind: fault.WrongLSE, Step: 8, Layer: 1}
	s, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 4, Seed: 11, Fault: &f})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if rep.First == nil {
		t.Fatal("the faulty synthetic dump agrees")
	}
	var a, b bytes.Buffer
	if err := Write(&a, rep); err != nil {
		t.Fatal(err)
	}
	if err := Write(&b, rep); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Error("two writes of one report differ")
	}
	if !IsPage(a.Bytes()) {
		t.Error("IsPage does not know the page") // report --html could not replace its own page
	}
	page := a.String()
	for _, want := range []string{"<!DOCTYPE html>", "data:image/svg", "Error by layer x step", html.EscapeString(rep.First.Text)} {
		if !strings.Contains(page, want) {
			t.Errorf("page lacks %q", want)
		}
	}
	for _, bad := range []string{`src="http`, `href="http`, "<script src"} {
		if strings.Contains(page, bad) {
			t.Errorf("page is not self-contained: %q", bad)
		}
	}
}

// TestWritePageNamesModel: a report of another model family (Report.Model,
// e.g. DeepSeek-V4.1) names it on the page; a V4 report names none.
func TestWritePageNamesModel(t *testing.T) {
	s, err := fault.Synthesize(fault.SynthOptions{Prefill: 6, Steps: 1, Seed: 11})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := replay.Run(context.Background(), s.Model(), s.Src, replay.Options{})
	if err != nil {
		t.Fatal(err)
	}
	var a bytes.Buffer
	if err := Write(&a, rep); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(a.String(), "model: <b>") {
		t.Error("a V4 page names a model")
	}
	rep.Model = replay.V41ModelName
	a.Reset()
	if err := Write(&a, rep); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(a.String(), "model: <b>DeepSeek-V4.1</b>") {
		t.Error("the page does not name DeepSeek-V4.1")
	}
}
