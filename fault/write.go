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
)

// write writes the native dump of the faulted copy to path; the weight
// records of the input's weights file wpath are left out (the file is copied
// beside it). It returns the tensor records and page records rewritten.
func (pl *faultPlan) write(path, wpath string) (records, pages int, err error) {
	h := pl.d.Header
	h.User = map[string]string{}
	for k, v := range pl.d.Header.User {
		h.User[k] = v
	}
	h.User["injected_fault"] = pl.f.String()
	h.User["faulted_from"] = pl.d.Path
	if h.ModelArgs != "" && len(h.CompressRatios) == 0 {
		h.CompressRatios = append([]int(nil), pl.cfg.CompressRatios...)
	}
	w, err := dump.Create(path, h)
	if err != nil {
		return 0, 0, err
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
		if e.Kind == dump.KindStage && e.Request == pl.src.Request && e.Layer == pl.layer {
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

// checkOutDir checks that dir can receive a faulted copy: new, empty, or
// holding only the files of a faulted copy or synthetic dump (an earlier copy
// is replaced); not the directory of the input dump or its weights, nor one
// inside the input.
func checkOutDir(dir string, d *dump.Dump, wpath string) error {
	inputs := map[string]bool{filepath.Dir(wpath): true, d.Path: true}
	for _, e := range d.Entries {
		inputs[filepath.Dir(e.File)] = true
	}
	absOut, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("fault: %w", err)
	}
	for in := range inputs {
		// A copy inside the input's directory would become part of the
		// input dump (dump.Open reads sub-directories).
		if absIn, err := filepath.Abs(in); err == nil {
			if rel, err := filepath.Rel(absIn, absOut); err == nil && rel != "." && !strings.HasPrefix(rel, "..") {
				return fmt.Errorf("fault: output directory %s lies inside the input %s; write the copy elsewhere", dir, in)
			}
		}
	}
	if fi, err := os.Stat(dir); err == nil {
		if !fi.IsDir() {
			return fmt.Errorf("fault: output %s is not a directory", dir)
		}
		for in := range inputs {
			if ifi, err := os.Stat(in); err == nil && os.SameFile(fi, ifi) {
				return fmt.Errorf("fault: output directory %s holds the input dump or its weights; write the copy elsewhere", dir)
			}
		}
		ents, err := os.ReadDir(dir)
		if err != nil {
			return fmt.Errorf("fault: %w", err)
		}
		for _, e := range ents {
			switch e.Name() {
			case SynthConfigFile, SynthWeightsFile, SynthDumpFile:
			default:
				return fmt.Errorf("fault: output directory %s holds %s: want a new or empty directory (or an earlier copy to replace)", dir, e.Name())
			}
		}
	}
	return nil
}

// copyFile copies src to dst.
func copyFile(dst, src string) error {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("fault: %w", err)
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return fmt.Errorf("fault: %w", err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("fault: copying %s: %w", src, err)
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("fault: %w", err)
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
