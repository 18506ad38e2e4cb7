package prefixcheck

import (
	"strings"
	"testing"
)

// An event's keys and type are strings of up to 64 KiB: the decoder's
// errors quote them bounded (64 bytes and the length) and still name the
// byte.
func TestEventsErrorsBounded(t *testing.T) {
	long := strings.Repeat("k", 60000)
	for name, c := range map[string]struct {
		data []byte
		want string
	}{
		"key twice": {mapBatchWith(func(x *evEnc) {
			x.must(x.e.EncodeMapLen(3))
			x.must(x.e.EncodeString("type"))
			x.must(x.e.EncodeString("BlockRemoved"))
			for range 2 {
				x.must(x.e.EncodeString(long))
				x.must(x.e.EncodeNil())
			}
		}), `event: key "kkk`},
		"field before the tag": {mapBatchWith(func(x *evEnc) {
			x.must(x.e.EncodeMapLen(1))
			x.must(x.e.EncodeString(long))
			x.must(x.e.EncodeNil())
		}), `event: field "kkk`},
		"unknown type": {mapBatchWith(func(x *evEnc) {
			x.must(x.e.EncodeMapLen(1))
			x.must(x.e.EncodeString("type"))
			x.must(x.e.EncodeString(long))
		}), `unknown event type "kkk`},
	} {
		_, err := DecodeEvents(c.data, "x")
		if err == nil || len(err.Error()) > 1<<10 || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "(60000 bytes)") || !strings.Contains(err.Error(), "byte ") {
			msg := "<nil>"
			if err != nil {
				msg = err.Error()
			}
			t.Errorf("%s: error of %d bytes: %.200s", name, len(msg), msg)
		}
	}
}
