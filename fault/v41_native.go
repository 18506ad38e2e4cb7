package fault

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/replay"
	"sparsemla/userfile"
)

// V41SynthPageBlock is the page size (entries) of the KV pages a native V4.1
// synthetic dump holds: 64, the engines' SWA page size (as SynthPageBlock).
const V41SynthPageBlock = 64

// WriteNative writes the run into dir as a native dump (config.json,
// weights.safetensors, dump.smd: replay.WriteV41Native) with the caches of
// every step also as V4.1 KV pages; pagesOnly leaves the cache tensors out
// (the replay then decodes the pages).
func (s *V41Synth) WriteNative(dir string, pagesOnly bool) error {
	prod := map[string]string{"engine": "sparsemla synth", "seed": fmt.Sprint(s.Seed)}
	var user map[string]string
	if s.Fault != nil {
		user = map[string]string{"injected_fault": s.Fault.String()}
	}
	opt := replay.V41NativeOptions{Request: SynthRequest, Producer: prod, User: user, PageBlock: V41SynthPageBlock, PagesOnly: pagesOnly}
	if err := replay.WriteV41Native(dir, s.Model, s.Pre, s.Steps, s.IndexKAt, opt); err != nil {
		return fmt.Errorf("synth: %w", err)
	}
	return nil
}

// writeFaultedV41Native writes the faulted copy of a native V4.1 dump (fault
// --in): out/dump.smd holds every record of the input's .smd files, the
// stage records of step p named in changed ("L<l>.<stage>") replaced by
// their faulty values, and the header notes the fault; config.json beside
// the input and the weights the dump was read with (weights: beside it, or
// the ones given) are copied. Neither V4.1 fault kind reaches a cache, so the
// KV pages are copied unchanged.
func writeFaultedV41Native(in, out, weights string, p int64, changed map[string]engine.Tensor, f Fault) (string, error) {
	d, err := dump.Open(in)
	if err != nil {
		return "", err
	}
	defer d.Close()
	if d.Format != "native" {
		return "", fmt.Errorf("fault --in %s: a %s DeepSeek-V4.1 dump read through a name map: the faulted copy is written for native (.smd) or official-layout V4.1 dumps only", in, d.Format)
	}
	g, err := userfile.NewGuard(in)
	if err != nil {
		return "", err
	}
	od, err := g.CreateDir(out)
	if err != nil {
		return "", err
	}
	defer od.Abort()
	dir := in
	if fi, err := os.Stat(in); err == nil && !fi.IsDir() {
		dir = filepath.Dir(in)
	}
	if src := filepath.Join(dir, "config.json"); isRegular(src) {
		if err := od.WriteFile("config.json", 0o644, func(w io.Writer) error { return copyFile(w, src) }); err != nil {
			return "", err
		}
	}
	if err := copyWeightsInto(od, weights); err != nil {
		return "", err
	}
	h := d.Header
	h.User = map[string]string{}
	for k, v := range d.Header.User {
		h.User[k] = v
	}
	h.User["injected_fault"] = f.String()
	err = od.WriteFile("dump.smd", 0o644, func(w io.Writer) error {
		dw, err := dump.NewWriter(w, h)
		if err != nil {
			return err
		}
		for i := range d.Entries {
			e := &d.Entries[i]
			rec, err := d.Read(e)
			if err != nil {
				dw.Close()
				return err
			}
			if e.Kind == dump.KindStage && int64(e.Step) == p && e.Layer >= 0 {
				if t, ok := changed[fmt.Sprintf("L%d.%s", e.Layer, e.Stage)]; ok {
					rec = engine.TensorRecord(t, e.Key, e.Kind)
					rec.Name = e.Name
				}
			}
			if err := dw.Write(&rec); err != nil {
				dw.Close()
				return err
			}
		}
		for _, ph := range d.Prefix {
			if err := dw.WritePrefix(ph); err != nil {
				dw.Close()
				return err
			}
		}
		return dw.Close()
	})
	if err != nil {
		return "", err
	}
	if err := od.Commit(); err != nil {
		return "", err
	}
	return od.Final(), nil
}

// copyWeightsInto copies the weights file a dump was read with into the
// faulted copy as weights.safetensors, so that replay finds them beside it
// with no flags ("" copies nothing).
func copyWeightsInto(od *userfile.Dir, weights string) error {
	if weights == "" {
		return nil
	}
	return od.WriteFile(dump.WeightsFile, 0o644, func(w io.Writer) error { return copyFile(w, weights) })
}

// isRegular reports whether path is a regular file.
func isRegular(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular()
}
