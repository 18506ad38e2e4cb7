package dump

import (
	"archive/zip"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"

	"sparsemla/userfile"
)

// zipFormat tells a torch.save zip ("pt") from an .npz ("npz"); any other
// zip is "unknown" (an error: it must not read as an empty dump).
func zipFormat(f *os.File) string {
	fi, err := f.Stat()
	if err != nil {
		return "unknown"
	}
	zr, err := zip.NewReader(f, fi.Size())
	if err != nil {
		if strings.HasSuffix(strings.ToLower(f.Name()), ".npz") {
			return "npz" // let the npz reader report the damage
		}
		return "unknown"
	}
	if isTorchZip(zr) {
		return "pt"
	}
	for _, m := range zr.File {
		if strings.HasSuffix(m.Name, ".npy") {
			return "npz"
		}
	}
	if len(zr.File) == 0 && strings.HasSuffix(strings.ToLower(f.Name()), ".npz") {
		return "npz"
	}
	return "unknown"
}

// applyStepStage re-keys the records of a dump whose file rules capture a
// step counter (SGLang's dumper step, a forward-pass number) to absolute
// positions: the record of stage m.StepStage (SGLang's positions) of
// counter c holds the position of every record of c. A counter whose
// positions record holds more than one position (a prefill) or none is
// left out (listed as unmapped), so no record keeps a counter for a position.
func (d *Dump) applyStepStage() error {
	m := d.Map
	if m == nil || m.StepStage == "" {
		return nil
	}
	pos := map[int]int{}   // counter -> position
	multi := map[int]int{} // counter -> number of positions (prefill)
	for i := range d.Entries {
		e := &d.Entries[i]
		if e.Stage != m.StepStage || e.Step == NoStep || e.Kind != KindStage {
			continue
		}
		r, err := d.Read(e)
		if err != nil {
			return err
		}
		v, err := r.Int64()
		if err != nil {
			return fmt.Errorf("dump: %s: record %d (%s): step stage %s: %w", e.File, e.Record, userfile.Clip(e.Name), userfile.Clip(m.StepStage), err)
		}
		if len(v) != 1 {
			multi[e.Step] = len(v)
			continue
		}
		if v[0] < 0 || v[0] > math.MaxInt32 {
			return fmt.Errorf("dump: %s: record %d (%s): position %d", e.File, e.Record, userfile.Clip(e.Name), v[0])
		}
		if _, dup := pos[e.Step]; dup {
			return fmt.Errorf("dump: %s: record %d (%s): second %s record for step counter %d", e.File, e.Record, userfile.Clip(e.Name), userfile.Clip(m.StepStage), e.Step)
		}
		pos[e.Step] = int(v[0])
	}
	kept := d.Entries[:0]
	for _, e := range d.Entries {
		if e.Step != NoStep {
			p, ok := pos[e.Step]
			if !ok {
				why := "no " + m.StepStage + " record"
				if n := multi[e.Step]; n > 0 {
					why = fmt.Sprintf("%d positions (prefill)", n)
				}
				d.Unmapped = append(d.Unmapped, fmt.Sprintf("%s: %s (step counter %d: %s)", e.File, userfile.Clip(e.Name), e.Step, why))
				continue
			}
			e.Step = p
		}
		kept = append(kept, e)
	}
	d.Entries = kept
	return nil
}

// finishForeign completes a foreign dump's index: step counters become
// positions (NameMap.StepStage), the first step's states become the start
// state (NameMap.FirstStepState), and a dump with no mapped tensor is an
// error (it must never read as an empty dump that agrees with everything).
func (d *Dump) finishForeign(path, root string) error {
	if d.Map == nil {
		return nil
	}
	d.assignRequests(root)
	if d.Map.SqueezeLeading {
		for i := range d.Entries {
			s := d.Entries[i].Shape
			for len(s) > 1 && s[0] == 1 {
				s = s[1:]
			}
			d.Entries[i].Shape = s
		}
	}
	if err := d.applyStepStage(); err != nil {
		return err
	}
	for i := range d.Entries {
		e := &d.Entries[i]
		if e.view == nil {
			continue
		}
		s, err := viewShape(e.Shape, e.view)
		if err != nil {
			return fmt.Errorf("dump: %s: record %d (%s): name map %s shape %s: %w", e.File, e.Record, userfile.Clip(e.Name), userfile.Clip(d.Map.Name), userfile.Dims(e.view), err)
		}
		e.Shape, e.view = s, nil
	}
	if len(d.Map.FirstStepState) > 0 {
		first := -1
		for _, e := range d.Entries {
			if e.Kind == KindStage && e.Step != NoStep && (first < 0 || e.Step < first) {
				first = e.Step
			}
		}
		want := map[string]bool{}
		for _, s := range d.Map.FirstStepState {
			want[s] = true
		}
		// The first step cannot be replayed (nothing says the state before
		// it): its cache states become the start state, valid after it, and
		// its other records are left out (listed with the reason), so that
		// local and propagated replays both start at the second dumped step.
		kept := d.Entries[:0]
		ws := &WindowStart{Step: first}
		for _, e := range d.Entries {
			if e.Kind == KindStage && e.Step == first && first >= 0 {
				if want[e.Stage] {
					e.Kind = KindState
					kept = append(kept, e)
					ws.States++
				} else {
					d.Unmapped = append(d.Unmapped, fmt.Sprintf("%s: %s (step %d, the first of a window without a prefill state: only its cache states are used, as the start state)", e.File, userfile.Clip(e.Name), first))
					ws.LeftOut++
				}
				continue
			}
			kept = append(kept, e)
		}
		d.Entries = kept
		if first >= 0 {
			d.Window = ws
		}
	}
	if len(d.Entries) == 0 {
		msg := fmt.Sprintf("dump: %s: no tensor mapped to a key by name map %s", path, userfile.Clip(d.Map.Name))
		if len(d.Unmapped) > 0 {
			ex := d.Unmapped
			if len(ex) > 3 {
				ex = ex[:3]
			}
			msg += fmt.Sprintf(" (%d unmapped, e.g. %s)", len(d.Unmapped), strings.Join(ex, "; "))
		} else {
			msg += " (the files hold no tensors)"
		}
		if d.Detect != "" {
			msg += "; " + d.Detect
		}
		return errors.New(msg)
	}
	return nil
}

// detectReport says which built-in map was detected for dir, or for each
// built-in map with detect rules the first rule that failed.
func detectReport(dir string, chosen *NameMap) string {
	if chosen != nil {
		return "name map " + chosen.Name + " detected (" + strings.Join(chosen.Detect, ", ") + ")"
	}
	var parts []string
	for _, n := range BuiltinNameMaps() {
		m, err := BuiltinNameMap(n)
		if err != nil || len(m.Detect) == 0 {
			continue
		}
		for _, g := range m.Detect {
			hits, err := filepath.Glob(filepath.Join(dir, g))
			if err != nil || len(hits) == 0 {
				parts = append(parts, n+": no "+g)
				break
			}
		}
	}
	return "generic name map (no built-in map detected: " + strings.Join(parts, "; ") + ")"
}

// viewShape returns view with its -1 (at most one) inferred so that it holds
// as many elements as shape.
func viewShape(shape, view []int) ([]int, error) {
	n, err := NumElements(shape)
	if err != nil {
		return nil, err
	}
	out := append([]int(nil), view...)
	known, free := int64(1), -1
	for i, v := range out {
		switch {
		case v == -1 && free < 0:
			free = i
		case v <= 0:
			return nil, fmt.Errorf("dimension %d", v)
		default:
			known *= int64(v)
			if known > n {
				return nil, fmt.Errorf("needs more than the %d elements of %s", n, userfile.Dims(shape))
			}
		}
	}
	if free >= 0 {
		if n%known != 0 {
			return nil, fmt.Errorf("%d elements of %s do not divide into it", n, userfile.Dims(shape))
		}
		out[free] = int(n / known)
	} else if known != n {
		return nil, fmt.Errorf("holds %d elements, the tensor %s has %d", known, userfile.Dims(shape), n)
	}
	return out, nil
}
