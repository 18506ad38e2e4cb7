package prefixcheck

// Decoding of what SGLang adds to the vLLM-compatible events: the cache salt
// and session metadata (PR #30827, #37482) and the KV-component forms (see
// the format in events.go).

import (
	"fmt"

	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"sparsemla/userfile"
)

// salt reads a cache_salt (nil: none). A salt given twice (a map event's
// field and its metadata) must be the same.
func (e *evReader) salt(ev *Event, what string) error {
	if null, err := e.isNil(); null || err != nil {
		return err
	}
	at := e.off()
	s, err := e.str(what)
	if err != nil {
		return err
	}
	if ev.CacheSalt != nil && *ev.CacheSalt != s {
		return e.errf(at, "%s: %s, but cache_salt %s given before", what, userfile.Quote(s), userfile.Quote(*ev.CacheSalt))
	}
	ev.CacheSalt = &s
	return nil
}

// metadata reads SGLang's BlockStoredMetadata map: cache_salt and session_id
// (strings or nil); other keys are skipped.
func (e *evReader) metadata(ev *Event, what string) error {
	n, err := e.mapLen(what)
	if err != nil {
		return err
	}
	seen := map[string]bool{}
	for i := 0; i < n; i++ {
		at := e.off()
		k, err := e.str(what + " key")
		if err != nil {
			return err
		}
		if seen[k] {
			return e.errf(at, "%s: key %s twice", what, userfile.Quote(k))
		}
		seen[k] = true
		switch k {
		case "cache_salt":
			err = e.salt(ev, what+".cache_salt")
		case "session_id":
			ev.SessionID, err = e.str(what + ".session_id")
		default:
			err = e.skip(what+"."+userfile.Clip(k), 0)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// componentTypes reads the component_types list of sgl-project/sglang PR
// #32514 (open): the components one BlockStored's blocks hold at its medium
// ("full", "swa", "mamba"; nil: not reported). The event is one per block
// whatever its components, and a removal is the whole block's, so the list
// selects nothing: it is checked (strings, bounded) and dropped.
func (e *evReader) componentTypes(what string) error {
	n, err := e.arrayLen(what)
	if err != nil || n < 0 {
		return err
	}
	for i := 0; i < n; i++ {
		if _, err := e.str(fmt.Sprintf("%s[%d]", what, i)); err != nil {
			return err
		}
	}
	return nil
}

// componentTags are SGLang's component event classes under their own
// names, should they be tagged so (msgspec's tag=True default) rather than
// as their base classes: same fields, component_type after medium.
var componentTags = map[string]string{
	"BlockStoredWithComponentType":            "BlockStored",
	"BlockStoredWithComponentTypeAndMetadata": "BlockStored",
	"BlockRemovedWithComponentType":           "BlockRemoved",
}

// isMapCode says whether c starts a msgpack map.
func isMapCode(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

// isArrayCode says whether c starts a msgpack array.
func isArrayCode(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

// isStrCode says whether c starts a msgpack string.
func isStrCode(c byte) bool { return msgpcode.IsString(c) }
