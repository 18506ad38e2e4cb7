package prodkernel

import (
	"encoding/json"
	"fmt"
	"path/filepath"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/userfile"
)

// Run is one harness output: kernels-TAG.safetensors (the kernel outputs) and
// kernels-TAG.json (what ran) of one golden dump.
type Run struct {
	Path string // the .safetensors file
	Info RunInfo
	st   *dump.Safetensors
	// patched records (Patch) replace the file's.
	patched map[string]dump.Record
}

// RunInfo is the part of kernels-TAG.json the replay reads.
type RunInfo struct {
	Dump    string                     `json:"dump"`
	Env     map[string]string          `json:"env"`
	Sources map[string]json.RawMessage `json:"sources"`
	Runs    map[string]KernelRun       `json:"runs"`
	Hashes  map[string]string          `json:"kernel_file_sha256"`
	// Cases: the synthetic FlashMLA run's calls (kernels-flashmla.json).
	Cases map[string]FlashCaseRun `json:"cases"`
}

// KernelRun says whether one kernel ran, and its error when it did not.
type KernelRun struct {
	OK      bool    `json:"ok"`
	Error   string  `json:"error"`
	Seconds float64 `json:"seconds"`
}

// Open reads dir/kernels-TAG.json and opens dir/kernels-TAG.safetensors.
func Open(dir, tag string) (*Run, error) {
	jp := filepath.Join(dir, "kernels-"+tag+".json")
	raw, err := userfile.ReadFile(jp, 16<<20) // a regular file of bounded size
	if err != nil {
		return nil, fmt.Errorf("prodkernel: %w", err)
	}
	r := &Run{Path: filepath.Join(dir, "kernels-"+tag+".safetensors")}
	if err := json.Unmarshal(raw, &r.Info); err != nil {
		return nil, fmt.Errorf("prodkernel: %s: %w", jp, err)
	}
	if r.st, err = dump.OpenSafetensors(r.Path); err != nil {
		return nil, fmt.Errorf("prodkernel: %w", err)
	}
	return r, nil
}

// Close closes the safetensors file.
func (r *Run) Close() error { return r.st.Close() }

// read returns a record, patched or from the file.
func (r *Run) read(name string) (dump.Record, error) {
	if rec, ok := r.patched[name]; ok {
		return rec, nil
	}
	rec, err := r.st.Read(name)
	if err != nil {
		return dump.Record{}, fmt.Errorf("prodkernel: %s: %w", r.Path, err)
	}
	return rec, nil
}

// Patch changes one tensor of the run in memory (fault injection): edit gets
// a copy of its raw little-endian bytes and changes them in place.
func (r *Run) Patch(name string, edit func(data []byte)) error {
	rec, err := r.read(name)
	if err != nil {
		return err
	}
	rec.Data = append([]byte(nil), rec.Data...)
	edit(rec.Data)
	if r.patched == nil {
		r.patched = map[string]dump.Record{}
	}
	r.patched[name] = rec
	return nil
}

// Has says whether the run holds a tensor (its file's, or one Join added).
func (r *Run) Has(name string) bool {
	if _, ok := r.patched[name]; ok {
		return true
	}
	return r.st.Has(name)
}

// Bytes returns a U8 tensor's bytes and shape.
func (r *Run) Bytes(name string) ([]byte, []int, error) {
	rec, err := r.read(name)
	if err != nil {
		return nil, nil, err
	}
	if rec.DType != dump.U8 {
		return nil, nil, fmt.Errorf("prodkernel: %s: %s is %v, want u8", r.Path, name, rec.DType)
	}
	return rec.Data, rec.Shape, nil
}

// Ints returns an integer tensor's values.
func (r *Run) Ints(name string) ([]int64, error) {
	rec, err := r.read(name)
	if err != nil {
		return nil, err
	}
	v, err := rec.Int64()
	if err != nil {
		return nil, fmt.Errorf("prodkernel: %s: %s: %w", r.Path, name, err)
	}
	return v, nil
}

// Floats returns a float tensor's values widened to float32, with its shape.
func (r *Run) Floats(name string) (engine.Tensor, error) {
	rec, err := r.read(name)
	if err != nil {
		return engine.Tensor{}, err
	}
	v, err := rec.Float32()
	if err != nil {
		return engine.Tensor{}, fmt.Errorf("prodkernel: %s: %s: %w", r.Path, name, err)
	}
	return engine.Tensor{Shape: rec.Shape, F: v}, nil
}
