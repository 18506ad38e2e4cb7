package main

import (
	"bytes"
	"strings"

	"sparsemla/dump"
	"sparsemla/htmlreport"
	"sparsemla/userfile"
)

// The rule of every output (README "Outputs"): sparsemla never replaces what
// it did not write. An output that exists is replaced only when it is one of
// sparsemla's: a directory holding its userfile.Marker list of exactly what
// it holds (synth --out, fault --out, demo --keep), an HTML page it wrote
// (report --html, prefix --html), a prefix-cache run synth --prefix wrote as
// a native dump. Anything else is refused (exit 2) with the path and what to
// do; --force (report, prefix, synth --prefix) replaces a regular file that
// is not an input. A directory, a FIFO or device, an input or a link to one
// is never replaced.

// forceUsage documents --force.
const forceUsage = "replace the output file even if sparsemla cannot tell it wrote it (never a directory or an input)"

// htmlOutput is the rule of an HTML page (report --html, prefix --html).
func htmlOutput(force bool) userfile.OutputFile {
	return userfile.OutputFile{Own: htmlreport.IsPage, What: "an HTML page sparsemla wrote", Force: force}
}

// prefixRunOutput is the rule of synth --prefix --out: its native dumps say
// who wrote them (the header's producer); its KV-event streams cannot.
func prefixRunOutput(force bool) userfile.OutputFile {
	return userfile.OutputFile{Own: isPrefixRun, Force: force,
		What: "a run synth --prefix wrote (a native dump naming it as producer; a KV-event stream carries no mark of its writer)"}
}

// prefixRunProducer begins the header producer ("engine") of the native
// dumps synth --prefix writes.
const prefixRunProducer = "sparsemla synth --prefix "

// isPrefixRun reports whether head begins a native dump written by synth
// --prefix.
func isPrefixRun(head []byte) bool {
	if !bytes.HasPrefix(head, []byte(dump.Magic)) {
		return false
	}
	sr, err := dump.NewStreamReader(bytes.NewReader(head), "")
	return err == nil && strings.HasPrefix(sr.Header.Producer["engine"], prefixRunProducer)
}
