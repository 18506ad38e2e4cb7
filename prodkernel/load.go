package prodkernel

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"sparsemla/dump"
	"sparsemla/engine"
)

// Run is one harness output: kernels-TAG.safetensors (the kernel outputs) and
// kernels-TAG.json (what ran) of one golden dump.
type Run struct {
	Path string // the .safetensors file
	Info RunInfo
	st   *dump.Safetensors
}

// RunInfo is the part of kernels-TAG.json the replay reads.
type RunInfo struct {
	Dump    string                     `json:"dump"`
	Env     map[string]string          `json:"env"`
	Sources map[string]json.RawMessage `json:"sources"`
	Runs    map[string]KernelRun       `json:"runs"`
	Hashes  map[string]string          `json:"kernel_file_sha256"`
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
	raw, err := os.ReadFile(jp)
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

// Has says whether the run holds a tensor.
func (r *Run) Has(name string) bool { return r.st.Has(name) }

// Bytes returns a U8 tensor's bytes and shape.
func (r *Run) Bytes(name string) ([]byte, []int, error) {
	rec, err := r.st.Read(name)
	if err != nil {
		return nil, nil, fmt.Errorf("prodkernel: %s: %w", r.Path, err)
	}
	if rec.DType != dump.U8 {
		return nil, nil, fmt.Errorf("prodkernel: %s: %s is %v, want u8", r.Path, name, rec.DType)
	}
	return rec.Data, rec.Shape, nil
}

// Ints returns an integer tensor's values.
func (r *Run) Ints(name string) ([]int64, error) {
	v, _, err := r.st.Int64(name)
	if err != nil {
		return nil, fmt.Errorf("prodkernel: %s: %s: %w", r.Path, name, err)
	}
	return v, nil
}

// Floats returns a float tensor's values widened to float32, with its shape.
func (r *Run) Floats(name string) (engine.Tensor, error) {
	v, shape, err := r.st.Float32(name)
	if err != nil {
		return engine.Tensor{}, fmt.Errorf("prodkernel: %s: %s: %w", r.Path, name, err)
	}
	return engine.Tensor{Shape: shape, F: v}, nil
}
