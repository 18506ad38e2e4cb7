package fault

import (
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/replay"
	"sparsemla/userfile"
)

// write writes the native dump of the faulted copy to path; the weight
// records of the input's weights file wpath are left out (the file is copied
// beside it). It returns the tensor records and page records rewritten.
func (pl *faultPlan) write(out io.Writer, path, wpath string) (records, pages int, err error) {
	h := pl.d.Header
	h.User = map[string]string{}
	for k, v := range pl.d.Header.User {
		h.User[k] = v
	}
	h.User["injected_fault"] = pl.f.String()
	h.User["faulted_from"] = pl.d.Path
	delete(h.User, "fault_not_recomputed") // an earlier fault's
	if n := pl.notes.list(); len(n) > 0 {
		h.User["fault_not_recomputed"] = strings.Join(n, "; ")
	}
	if h.ModelArgs != "" && len(h.CompressRatios) == 0 {
		h.CompressRatios = append([]int(nil), pl.cfg.CompressRatios...)
	}
	w, err := dump.NewWriter(out, h)
	if err != nil {
		return 0, 0, fmt.Errorf("fault: %s: %w", path, err)
	}
	fail := func(err error) (int, int, error) {
		w.Close()
		return 0, 0, fmt.Errorf("fault: %s: %w", path, err)
	}
	wfi, _ := os.Stat(wpath)
	var buf []byte
	for i := range pl.d.Entries {
		e := &pl.d.Entries[i]
		if e.Kind == dump.KindWeight && wfi != nil {
			if fi, err := os.Stat(e.File); err == nil && os.SameFile(fi, wfi) {
				continue
			}
		}
		rec, err := pl.d.ReadBuf(e, buf)
		if err != nil {
			return fail(err)
		}
		buf = rec.Data[:0]
		if e.Kind == dump.KindStage && e.Request == pl.src.Request {
			k := replay.StageKey{Step: int64(e.Step), Layer: e.Layer, Stage: e.Stage}
			if pl.drop[k] {
				continue
			}
			if t, ok := pl.patch[k]; ok {
				rec = engine.RecordLike(rec, t)
			}
		}
		if data, ok := pl.pages[i]; ok {
			rec.Data = data
			pages++
		}
		if err := w.Write(&rec); err != nil {
			return fail(err)
		}
		records++
	}
	if pl.donor != "" {
		rec := engine.TensorRecord(pl.donorCache, dump.Key{Request: pl.donor, Step: int(pl.f.Step), Layer: pl.layer, Stage: "kv_cache"}, dump.KindStage)
		if err := w.Write(&rec); err != nil {
			return fail(err)
		}
		records++
	}
	for _, hit := range pl.d.Prefix {
		if err := w.WritePrefix(hit); err != nil {
			return fail(err)
		}
	}
	if pl.donor != "" {
		if err := w.WritePrefix(dump.PrefixHit{Request: pl.src.Request, Source: pl.donor, Tokens: int(pl.f.Step)}); err != nil {
			return fail(err)
		}
	}
	if err := w.Close(); err != nil {
		return 0, 0, fmt.Errorf("fault: %s: %w", path, err)
	}
	return records, pages, nil
}

// bitIdentical reports whether two tensors hold the same shape and bit-identical
// values.
func bitIdentical(a, b engine.Tensor) bool {
	if a.Kind.IsFloat() != b.Kind.IsFloat() || !engine.SameShape(a.Shape, b.Shape) || len(a.F) != len(b.F) || len(a.I) != len(b.I) {
		return false
	}
	for i := range a.F {
		if math.Float32bits(a.F[i]) != math.Float32bits(b.F[i]) {
			return false
		}
	}
	for i := range a.I {
		if a.I[i] != b.I[i] {
			return false
		}
	}
	return true
}

// outputGuard holds the inputs of a faulted copy: the dump (file or
// directory), the directories of its files (a copy inside one would become
// part of the input, dump.Open reads sub-directories) and the weights file
// and its directory. The copy's directory must be new, empty or an earlier
// output of sparsemla (userfile.Guard.CreateDir), and is refused when it is,
// links to, holds or lies inside any of them (symbolic and hard links
// resolved: a directory of links to the input's files, as cp -as or cp -al
// leave, is refused).
func outputGuard(d *dump.Dump, wpath string) (*userfile.Guard, error) {
	ins := []string{d.Path, wpath, filepath.Dir(wpath)}
	seen := map[string]bool{}
	for _, e := range d.Entries {
		if dir := filepath.Dir(e.File); !seen[dir] {
			seen[dir] = true
			ins = append(ins, dir)
		}
	}
	g, err := userfile.NewGuard(ins...)
	if err != nil {
		return nil, fmt.Errorf("fault: %w", err)
	}
	return g, nil
}

// copyFile copies the regular file src to w.
func copyFile(w io.Writer, src string) error {
	in, _, err := userfile.Open(src)
	if err != nil {
		return fmt.Errorf("fault: %w", err)
	}
	defer in.Close()
	if _, err := io.Copy(w, in); err != nil {
		return fmt.Errorf("fault: copying %s: %w", src, err)
	}
	return nil
}

func containsStep(s []int64, p int64) bool {
	for _, v := range s {
		if v == p {
			return true
		}
	}
	return false
}

func containsInt(s []int, x int) bool {
	for _, v := range s {
		if v == x {
			return true
		}
	}
	return false
}
