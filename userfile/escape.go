package userfile

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Escape returns s with every byte or rune that could change how a terminal
// shows a message escaped: ASCII and C1 control characters (\n, \t, \r and
// ESC as \n, \t, \r, \x1b), DEL, bytes that are not UTF-8 (\xNN) and the
// Unicode bidirectional overrides and isolates (\u202e, ...). Everything
// else, backslashes included, is kept as is, so ordinary names read the same.
func Escape(s string) string {
	i := 0
	for i < len(s) {
		r, n := utf8.DecodeRuneInString(s[i:])
		if needsEscape(r, n) {
			break
		}
		i += n
	}
	if i == len(s) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 8)
	b.WriteString(s[:i])
	for i < len(s) {
		r, n := utf8.DecodeRuneInString(s[i:])
		if !needsEscape(r, n) {
			b.WriteString(s[i : i+n])
			i += n
			continue
		}
		switch {
		case r == utf8.RuneError && n == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x80:
			fmt.Fprintf(&b, `\x%02x`, r)
		default:
			fmt.Fprintf(&b, `\u%04x`, r)
		}
		i += n
	}
	return b.String()
}

func needsEscape(r rune, n int) bool {
	switch {
	case r == utf8.RuneError && n == 1:
		return true
	case r < 0x20, r == 0x7f, r >= 0x80 && r <= 0x9f:
		return true
	case r >= 0x202a && r <= 0x202e, r >= 0x2066 && r <= 0x2069, r == 0x200e, r == 0x200f, r == 0x061c:
		return true
	}
	return false
}

// OneLine makes a message one line: it escapes what Escape escapes except
// the newlines that separate joined errors (errors.Join), which become "; ".
// Empty lines are dropped.
func OneLine(msg string) string {
	parts := strings.Split(strings.TrimRight(msg, "\n"), "\n")
	kept := parts[:0]
	for _, p := range parts {
		if strings.TrimSpace(p) != "" {
			kept = append(kept, Escape(p))
		}
	}
	return strings.Join(kept, "; ")
}

// maxQuoted bounds the bytes of an input string that Quote writes out.
const maxQuoted = 64

// Quote quotes a string taken from an input (a stage name, a pickle string)
// for an error message: whole (strconv.Quote) if it is at most 64 bytes,
// else its first 64 bytes and its length, so that one hostile 4 MiB name
// does not become a 4 MiB error line.
func Quote(s string) string {
	if len(s) <= maxQuoted {
		return strconv.Quote(s)
	}
	return fmt.Sprintf("%s… (%d bytes)", strconv.Quote(s[:maxQuoted]), len(s))
}

// Clip is Quote without the quotes, for a message that prints an input
// string with %s: the string itself if it is at most 64 bytes, else its
// first 64 bytes (cut back to a whole UTF-8 character) and its length.
// Control characters are left to Escape / OneLine, as with %s.
func Clip(s string) string {
	if len(s) <= maxQuoted {
		return s
	}
	cut := maxQuoted
	for cut > maxQuoted-utf8.UTFMax && cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return fmt.Sprintf("%s… (%d bytes)", s[:cut], len(s))
}

// maxDims bounds the dimensions of an input shape that Dims writes out.
const maxDims = 8

// Dims formats a shape (or any list of integers) taken from an input for
// an error message: as %v does ("[2 3 4]") if it has at most 8 values, else
// its first 8 and its length ("[1 1 1 1 1 1 1 1 …] (500000 dims)"), so that
// a header that claims half a million dimensions does not become a
// megabyte-long error line.
func Dims[T ~int | ~int8 | ~int16 | ~int32 | ~int64 | ~uint | ~uint8 | ~uint16 | ~uint32 | ~uint64](s []T) string {
	if len(s) <= maxDims {
		return fmt.Sprint(s)
	}
	var b strings.Builder
	b.WriteByte('[')
	for i, d := range s[:maxDims] {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprint(&b, d)
	}
	fmt.Fprintf(&b, " …] (%d dims)", len(s))
	return b.String()
}

// JSONError bounds an encoding/json error about an input: the decoder
// echoes a number it cannot store whole ("cannot unmarshal number 1111…")
// and an unknown field's name ("unknown field \"…\""), each as long as the
// input made it. A longer one is cut as Clip and Quote cut; anything else
// is returned as is. The result wraps err (errors.Is / As still see it).
func JSONError(err error) error {
	if err == nil {
		return nil
	}
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) && len(te.Value) > maxQuoted {
		c := *te
		kind, v, ok := strings.Cut(te.Value, " ") // "number 1111…"
		if !ok {
			kind, v = "", te.Value
		} else {
			kind += " "
		}
		c.Value = kind + Clip(v)
		return &boundedError{msg: strings.Replace(err.Error(), te.Error(), c.Error(), 1), err: err}
	}
	msg := err.Error()
	const unknown = `json: unknown field "`
	if i := strings.Index(msg, unknown); i >= 0 && strings.HasSuffix(msg, `"`) && len(msg)-i-len(unknown)-1 > maxQuoted {
		name := msg[i+len(unknown) : len(msg)-1]
		return &boundedError{msg: msg[:i] + "json: unknown field " + Quote(name), err: err}
	}
	return err
}

// boundedError is an error whose message was bounded, wrapping the original.
type boundedError struct {
	msg string
	err error
}

func (e *boundedError) Error() string { return e.msg }
func (e *boundedError) Unwrap() error { return e.err }
