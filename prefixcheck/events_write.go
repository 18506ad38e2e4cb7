package prefixcheck

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"

	"github.com/vmihailenco/msgpack/v5"
)

// Event stream encodings EncodeEvents writes.
const (
	// EncodingMap is vLLM's current wire form (kv_events.py without
	// array_like): batches and events are maps, events tagged by "type".
	EncodingMap = "map"
	// EncodingArray is SGLang's (and older vLLM's) array_like form:
	// [ts, events] batches, [tag, fields...] events with the five
	// BlockStored fields and one BlockRemoved field of those versions; a
	// BlockStored with a cache salt or session id is SGLang's
	// BlockStoredWithMetadata (PR #30827): medium and the metadata map after
	// them.
	EncodingArray = "array"
)

type evWriter struct {
	buf bytes.Buffer
	e   *msgpack.Encoder
	err error
}

func (w *evWriter) do(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *evWriter) str(s string) { w.do(w.e.EncodeString(s)) }
func (w *evWriter) int(v int64)  { w.do(w.e.EncodeInt(v)) }
func (w *evWriter) nil_()        { w.do(w.e.EncodeNil()) }
func (w *evWriter) arr(n int)    { w.do(w.e.EncodeArrayLen(n)) }
func (w *evWriter) mapLen(n int) { w.do(w.e.EncodeMapLen(n)) }
func (w *evWriter) optStr(s string) {
	if s == "" {
		w.nil_()
	} else {
		w.str(s)
	}
}
func (w *evWriter) optInt(v *int64) {
	if v == nil {
		w.nil_()
	} else {
		w.int(*v)
	}
}

func (w *evWriter) hash(h BlockHash) {
	s := string(h)
	if strings.HasPrefix(s, "0x") {
		b, err := hex.DecodeString(s[2:])
		w.do(err)
		w.do(w.e.EncodeBytes(b))
		return
	}
	if strings.HasPrefix(s, "-") {
		v, err := strconv.ParseInt(s, 10, 64)
		w.do(err)
		w.int(v)
		return
	}
	u, err := strconv.ParseUint(s, 10, 64)
	w.do(err)
	w.do(w.e.EncodeUint(u))
}

func (w *evWriter) hashes(hs []BlockHash) {
	w.arr(len(hs))
	for _, h := range hs {
		w.hash(h)
	}
}

func (w *evWriter) tokens(t []int32) {
	w.arr(len(t))
	for _, v := range t {
		w.int(int64(v))
	}
}

func (w *evWriter) extra(keys []string) {
	w.arr(len(keys))
	for _, k := range keys {
		if k == "" {
			w.nil_()
		} else {
			_, err := w.buf.WriteString(k) // already msgpack
			w.do(err)
		}
	}
}

func (w *evWriter) mapEvent(ev *Event) {
	switch ev.Type {
	case "BlockStored":
		n := 8
		if ev.ExtraKeys != nil {
			n++
		}
		if ev.GroupIdx != nil {
			n++
		}
		if ev.SpecKind != "" {
			n++
		}
		if ev.CacheSalt != nil {
			n++
		}
		if ev.SessionID != "" {
			n++
		}
		if ev.Component != "" {
			n++
		}
		w.mapLen(n)
		w.str("type")
		w.str(ev.Type)
		w.str("block_hashes")
		w.hashes(ev.BlockHashes)
		w.str("parent_block_hash")
		if ev.Parent == "" {
			w.nil_()
		} else {
			w.hash(ev.Parent)
		}
		w.str("token_ids")
		w.tokens(ev.TokenIDs)
		w.str("block_size")
		w.int(int64(ev.BlockSize))
		w.str("lora_id")
		w.optInt(ev.LoraID)
		w.str("medium")
		w.optStr(ev.Medium)
		w.str("lora_name")
		w.optStr(ev.LoraName)
		if ev.ExtraKeys != nil {
			w.str("extra_keys")
			w.extra(ev.ExtraKeys)
		}
		if ev.GroupIdx != nil {
			w.str("group_idx")
			w.int(*ev.GroupIdx)
		}
		if ev.SpecKind != "" {
			w.str("kv_cache_spec_kind")
			w.str(ev.SpecKind)
		}
		if ev.CacheSalt != nil {
			w.str("cache_salt")
			w.str(*ev.CacheSalt)
		}
		if ev.SessionID != "" {
			w.str("session_id")
			w.str(ev.SessionID)
		}
		if ev.Component != "" {
			w.str("component_type")
			w.str(ev.Component)
		}
	case "BlockRemoved":
		n := 3
		if ev.GroupIdx != nil {
			n++
		}
		if ev.Component != "" {
			n++
		}
		w.mapLen(n)
		w.str("type")
		w.str(ev.Type)
		w.str("block_hashes")
		w.hashes(ev.BlockHashes)
		w.str("medium")
		w.optStr(ev.Medium)
		if ev.GroupIdx != nil {
			w.str("group_idx")
			w.int(*ev.GroupIdx)
		}
		if ev.Component != "" {
			w.str("component_type")
			w.str(ev.Component)
		}
	case "AllBlocksCleared":
		w.mapLen(1)
		w.str("type")
		w.str(ev.Type)
	default:
		w.do(fmt.Errorf("prefixcheck: cannot encode event type %q", ev.Type))
	}
}

func (w *evWriter) arrayEvent(ev *Event) {
	switch ev.Type {
	case "BlockStored":
		meta := ev.CacheSalt != nil || ev.SessionID != ""
		comp := ev.Component != ""
		switch {
		case comp && meta:
			w.arr(9)
		case comp:
			w.arr(8)
		case meta:
			w.arr(8)
		default:
			w.arr(6)
		}
		w.str(ev.Type)
		w.hashes(ev.BlockHashes)
		if ev.Parent == "" {
			w.nil_()
		} else {
			w.hash(ev.Parent)
		}
		w.tokens(ev.TokenIDs)
		w.int(int64(ev.BlockSize))
		w.optInt(ev.LoraID)
		if comp || meta {
			w.optStr(ev.Medium)
		}
		if comp {
			// SGLang's BlockStoredWithComponentType(AndMetadata).
			w.str(ev.Component)
		}
		if meta {
			n := 0
			if ev.CacheSalt != nil {
				n++
			}
			if ev.SessionID != "" {
				n++
			}
			w.mapLen(n)
			if ev.CacheSalt != nil {
				w.str("cache_salt")
				w.str(*ev.CacheSalt)
			}
			if ev.SessionID != "" {
				w.str("session_id")
				w.str(ev.SessionID)
			}
		}
		if ev.LoraName != "" || ev.ExtraKeys != nil || (ev.Medium != "" && !meta && !comp) || ev.GroupIdx != nil || ev.SpecKind != "" || (comp && ev.LoraID != nil) {
			w.do(fmt.Errorf("prefixcheck: the array encoding has no lora_name, extra_keys, group_idx or kv_cache_spec_kind, a medium only with a cache salt, session id or component, and no lora_id with a component"))
		}
	case "BlockRemoved":
		if ev.Component != "" {
			// SGLang's BlockRemovedWithComponentType.
			w.arr(4)
			w.str(ev.Type)
			w.hashes(ev.BlockHashes)
			w.optStr(ev.Medium)
			w.str(ev.Component)
			break
		}
		w.arr(2)
		w.str(ev.Type)
		w.hashes(ev.BlockHashes)
	case "AllBlocksCleared":
		w.arr(1)
		w.str(ev.Type)
	default:
		w.do(fmt.Errorf("prefixcheck: cannot encode event type %q", ev.Type))
	}
}

// EncodeEvents writes batches as a stream of EventBatch payloads in the given
// encoding (EncodingMap: batches carry data_parallel_rank, 0 when nil).
func EncodeEvents(batches []EventBatch, encoding string) ([]byte, error) {
	w := &evWriter{}
	w.e = msgpack.NewEncoder(&w.buf)
	for i := range batches {
		b := &batches[i]
		switch encoding {
		case EncodingMap:
			w.mapLen(3)
			w.str("ts")
			w.do(w.e.EncodeFloat64(b.TS))
			w.str("events")
			w.arr(len(b.Events))
			for j := range b.Events {
				w.mapEvent(&b.Events[j])
			}
			w.str("data_parallel_rank")
			if b.DPRank == nil {
				w.int(0)
			} else {
				w.int(*b.DPRank)
			}
		case EncodingArray:
			w.arr(2)
			w.do(w.e.EncodeFloat64(b.TS))
			w.arr(len(b.Events))
			for j := range b.Events {
				w.arrayEvent(&b.Events[j])
			}
		default:
			return nil, fmt.Errorf("prefixcheck: unknown event encoding %q (want %s or %s)", encoding, EncodingMap, EncodingArray)
		}
	}
	if w.err != nil {
		return nil, w.err
	}
	return w.buf.Bytes(), nil
}
