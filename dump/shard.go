package dump

import (
	"bytes"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"

	"sparsemla/userfile"
)

// ShardInfo marks a record as tensor-parallel rank Rank's shard (of Size)
// of a canonical tensor, split along dimension Dim of the record's shape
// (FORMAT.md "Tensor-parallel shards").
type ShardInfo struct {
	Rank int `msgpack:"rank"`
	Size int `msgpack:"size"`
	Dim  int `msgpack:"dim"`
}

// WriteShard writes r as shard s of its key (a TP rank's part).
func (w *Writer) WriteShard(r *Record, s ShardInfo) error {
	if s.Size < 1 || s.Rank < 0 || s.Rank >= s.Size || s.Dim < 0 || s.Dim >= len(r.Shape) {
		return fmt.Errorf("dump: record %s: bad shard %+v of shape %s", r.label(), s, userfile.Dims(r.Shape))
	}
	if err := r.Check(); err != nil {
		return fmt.Errorf("dump: record %s: %w", r.label(), err)
	}
	id := entryID{r.Key, r.Kind}
	if w.seen[id] {
		return fmt.Errorf("dump: duplicate record %s (%s)", clipKey(r.Key), r.Kind)
	}
	w.seen[id] = true
	w.records++
	// shards of one key come from different files; a file holds one rank
	return w.frame(&frameMeta{
		T: frameTensor, Request: r.Request, Step: r.Step, Layer: r.Layer, Stage: r.Stage,
		Kind: r.Kind.String(), Name: r.Name, DType: r.DType.String(), Shape: r.Shape,
		NBytes: int64(len(r.Data)), Page: r.Page, Shard: &s,
	}, r.Data)
}

// noteTPRank remembers the tp_rank a native file's header names.
func (d *Dump) noteTPRank(path string, h Header) {
	s, ok := h.Producer["tp_rank"]
	if !ok {
		return
	}
	r, err := strconv.Atoi(s)
	if err != nil || r < 0 {
		return
	}
	if d.tp == nil {
		d.tp = map[string]int{}
	}
	d.tp[path] = r
}

// mergeShards merges the shards of each (key, kind) into one entry (parts in
// rank order, shape summed along the shard dimension), and drops the copies
// of a replicated record that higher TP ranks wrote after checking that
// they are bit-identical to the lowest rank's.
func (d *Dump) mergeShards() error {
	type group struct{ idx []int }
	groups := map[entryID]*group{}
	var order []entryID
	need := false
	for i := range d.Entries {
		e := &d.Entries[i]
		id := entryID{e.Key, e.Kind}
		g, ok := groups[id]
		if !ok {
			g = &group{}
			groups[id] = g
			order = append(order, id)
		} else {
			need = true
		}
		if e.Shard != nil {
			need = true
		}
		g.idx = append(g.idx, i)
	}
	if !need {
		return nil
	}
	out := make([]Entry, 0, len(order))
	for _, id := range order {
		g := groups[id]
		first := d.Entries[g.idx[0]]
		if first.Shard == nil || first.Shard.Size == 1 && len(g.idx) == 1 {
			if len(g.idx) == 1 {
				first.Shard = nil
				out = append(out, first)
				continue
			}
			if err := d.dedupReplicated(g.idx); err != nil {
				return err
			}
			out = append(out, d.Entries[g.idx[0]])
			continue
		}
		m, err := d.mergeGroup(g.idx)
		if err != nil {
			return err
		}
		out = append(out, m)
	}
	d.Entries = out
	return nil
}

// dedupReplicated checks that repeated whole records come from different TP
// ranks and are bit-identical; idx[0] is kept (sorted to the lowest rank).
func (d *Dump) dedupReplicated(idx []int) error {
	rank := func(i int) (int, bool) { r, ok := d.tp[d.Entries[i].File]; return r, ok }
	sort.SliceStable(idx, func(a, b int) bool { ra, _ := rank(idx[a]); rb, _ := rank(idx[b]); return ra < rb })
	e0 := &d.Entries[idx[0]]
	r0, ok0 := rank(idx[0])
	base, err := d.Read(e0)
	if err != nil {
		return err
	}
	seen := map[int]bool{r0: true}
	for _, i := range idx[1:] {
		e := &d.Entries[i]
		r, ok := rank(i)
		if !ok || !ok0 || seen[r] || e.Shard != nil {
			return fmt.Errorf("dump: %s: record %d (%s) at offset %d: duplicate of %s record %d (%s %s)", e.File, e.Record, userfile.Clip(e.Name), e.Offset, e0.File, e0.Record, clipKey(e.Key), e.Kind)
		}
		seen[r] = true
		rec, err := d.Read(e)
		if err != nil {
			return err
		}
		if rec.DType != base.DType || !slices.Equal(rec.Shape, base.Shape) || !bytes.Equal(rec.Data, base.Data) {
			return fmt.Errorf("dump: %s %s: replicated record differs between TP rank %d (%s) and rank %d (%s)", clipKey(e.Key), e.Kind, r0, e0.File, r, e.File)
		}
	}
	return nil
}

// mergeGroup merges the shards idx of one key.
func (d *Dump) mergeGroup(idx []int) (Entry, error) {
	first := d.Entries[idx[0]]
	s0 := *first.Shard
	for _, i := range idx {
		e := d.Entries[i]
		if sh := e.Shard; sh != nil && (sh.Size < 1 || sh.Rank < 0 || sh.Rank >= sh.Size || sh.Dim < 0 || sh.Dim >= len(e.Shape)) {
			return Entry{}, fmt.Errorf("dump: %s: record %d (%s %s): invalid shard %+v of shape %s", e.File, e.Record, clipKey(e.Key), e.Kind, *sh, userfile.Dims(e.Shape))
		}
	}
	if s0.Size > len(idx) { // checked before allocating by the claimed size
		return Entry{}, fmt.Errorf("dump: %s %s: %d of %d TP shards present (have %s record %d)", clipKey(first.Key), first.Kind, len(idx), s0.Size, first.File, first.Record)
	}
	parts := make([]Entry, s0.Size)
	have := make([]bool, s0.Size)
	for _, i := range idx {
		e := d.Entries[i]
		if e.Shard == nil || e.Shard.Size != s0.Size || e.Shard.Dim != s0.Dim {
			return Entry{}, fmt.Errorf("dump: %s: record %d (%s %s): shard %+v does not match %s record %d's %+v", e.File, e.Record, clipKey(e.Key), e.Kind, e.Shard, first.File, first.Record, s0)
		}
		if have[e.Shard.Rank] {
			return Entry{}, fmt.Errorf("dump: %s: record %d (%s %s): second shard of rank %d", e.File, e.Record, clipKey(e.Key), e.Kind, e.Shard.Rank)
		}
		if e.DType != first.DType || len(e.Shape) != len(first.Shape) || s0.Dim >= len(e.Shape) {
			return Entry{}, fmt.Errorf("dump: %s: record %d (%s %s): shard dtype/shape %s %s vs %s %s", e.File, e.Record, clipKey(e.Key), e.Kind, e.DType, userfile.Dims(e.Shape), first.DType, userfile.Dims(first.Shape))
		}
		for k := range e.Shape {
			if k != s0.Dim && e.Shape[k] != first.Shape[k] {
				return Entry{}, fmt.Errorf("dump: %s: record %d (%s %s): shard shape %s vs %s outside dim %d", e.File, e.Record, clipKey(e.Key), e.Kind, userfile.Dims(e.Shape), userfile.Dims(first.Shape), s0.Dim)
			}
		}
		have[e.Shard.Rank] = true
		parts[e.Shard.Rank] = e
	}
	for r, ok := range have {
		if !ok {
			return Entry{}, fmt.Errorf("dump: %s %s: shard of TP rank %d of %d is missing (have %s record %d)", clipKey(first.Key), first.Kind, r, s0.Size, first.File, first.Record)
		}
	}
	m := parts[0]
	m.Shape = append([]int(nil), parts[0].Shape...)
	m.Shape[s0.Dim] = 0
	m.NBytes = 0
	for _, p := range parts {
		if p.Shape[s0.Dim] > math.MaxInt-m.Shape[s0.Dim] || p.NBytes > math.MaxInt64-m.NBytes {
			return Entry{}, fmt.Errorf("dump: %s: record %d (%s %s): shard shape %s: the %d TP shards' dimension %d overflows", p.File, p.Record, clipKey(p.Key), p.Kind, userfile.Dims(p.Shape), s0.Size, s0.Dim)
		}
		m.Shape[s0.Dim] += p.Shape[s0.Dim]
		m.NBytes += p.NBytes
	}
	// Each shard's shape holds its bytes; the merged shape must hold their
	// sum (the shards agree outside dim, so it does unless it overflows).
	if err := (&Record{DType: m.DType, Shape: m.Shape}).checkLen(m.NBytes); err != nil {
		return Entry{}, fmt.Errorf("dump: %s %s: merged shape of %d TP shards (have %s record %d): %w", clipKey(first.Key), first.Kind, s0.Size, first.File, first.Record, err)
	}
	m.parts = parts
	m.Offset = -1
	m.Shard = &s0
	return m, nil
}

// readMerged concatenates the shards of a merged entry along the shard dim.
func (d *Dump) readMerged(e *Entry, buf []byte) (Record, error) {
	r := Record{Key: e.Key, Kind: e.Kind, Name: e.Name, DType: e.DType, Shape: append([]int(nil), e.Shape...), Page: e.Page}
	if int64(cap(buf)) >= e.NBytes {
		r.Data = buf[:e.NBytes]
	} else {
		r.Data = make([]byte, e.NBytes)
	}
	if e.NBytes == 0 {
		// Nothing to copy. The shape may still be huge ([2^31, 2^31, 0]):
		// looping over its leading dimensions would never end.
		return r, nil
	}
	dim := e.Shard.Dim
	outer := 1 // rows to interleave: the product of the leading dimensions
	for _, s := range e.Shape[:dim] {
		if s < 0 || s > 0 && outer > math.MaxInt/s {
			return Record{}, fmt.Errorf("dump: %s %s: merged shape %s: leading dimensions overflow", clipKey(e.Key), e.Kind, userfile.Dims(e.Shape))
		}
		outer *= s
	}
	// bytes per outer index of each part
	rows := make([][]byte, len(e.parts))
	chunk := make([]int, len(e.parts))
	for i := range e.parts {
		p := &e.parts[i]
		rec, err := d.ReadBuf(p, nil)
		if err != nil {
			return Record{}, err
		}
		rows[i] = rec.Data
		if outer > 0 {
			chunk[i] = len(rec.Data) / outer
		}
	}
	o := 0
	for k := 0; k < outer; k++ {
		for i := range rows {
			o += copy(r.Data[o:], rows[i][k*chunk[i]:(k+1)*chunk[i]])
		}
	}
	return r, nil
}
