package htmlreport

import "bytes"

// pageHead is how every page of this package begins (Write's and
// WritePrefix's templates): sparsemla's commands replace an existing output
// file only when it is theirs (userfile.OutputFile), and IsPage is how they
// tell a page they wrote.
const pageHead = "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>sparsemla "

// IsPage reports whether head, the first bytes of a file, is the start of a
// page written by Write or WritePrefix.
func IsPage(head []byte) bool { return bytes.HasPrefix(head, []byte(pageHead)) }
