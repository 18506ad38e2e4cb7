package replay_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/fault"
	"sparsemla/replay"
)

// openSynthDir writes s into a new directory and opens its dump.
func openSynthDir(t *testing.T, s *fault.Synth) (*dump.Dump, *replay.DumpSource) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "d")
	if err := s.Write(dir); err != nil {
		t.Fatal(err)
	}
	d, err := dump.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	src, err := replay.NewDumpSource(d, "")
	if err != nil {
		t.Fatal(err)
	}
	return d, src
}

func reportJSON(t *testing.T, m *engine.Model, src replay.Source, mode replay.Mode) string {
	t.Helper()
	rep, err := replay.Run(context.Background(), m, src, replay.Options{Mode: mode})
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	if err := rep.WriteJSON(&b); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// TestLoadModelFromReuses: a model loaded once (LoadModelWith) and given to
// LoadModelWith as From for other dumps of its config replays them exactly
// as a model loaded from each dump's own weights, any number of times: two
// runs on one model give identical reports (clean and faulty dumps, local
// and propagated), and the shared weights are unchanged afterwards (equal
// to a fresh load). A dump of another config, or of a layer the model has
// no weights for, is an error.
func TestLoadModelFromReuses(t *testing.T) {
	clean, err := fault.Synthesize(fault.SynthOptions{Prefill: 7, Steps: 2, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	f := fault.Fault{Kind: fault.SplitKMerge, Step: 8, Layer: 1}
	faulty, err := fault.Synthesize(fault.SynthOptions{Prefill: 7, Steps: 2, Seed: 3, Fault: &f})
	if err != nil {
		t.Fatal(err)
	}
	d0, src0 := openSynthDir(t, clean)
	base, err := replay.LoadModelWith(d0, src0, replay.LoadOptions{Prepared: true})
	if err != nil {
		t.Fatal(err)
	}
	before := fingerprint(reflect.ValueOf(base))
	for _, s := range []*fault.Synth{clean, faulty} {
		d, src := openSynthDir(t, s)
		own, err := replay.LoadModelWith(d, src, replay.LoadOptions{Prepared: true})
		if err != nil {
			t.Fatal(err)
		}
		for _, mode := range []replay.Mode{replay.Local, replay.Propagated} {
			want := reportJSON(t, own, src, mode)
			for run := 0; run < 2; run++ {
				m, err := replay.LoadModelWith(d, src, replay.LoadOptions{From: base})
				if err != nil {
					t.Fatal(err)
				}
				if got := reportJSON(t, m, src, mode); got != want {
					t.Fatalf("%s %s run %d on the reused model: the report differs from the one on the dump's own weights", s.Src.Name(), mode, run)
				}
			}
			if s == faulty && !strings.Contains(want, `"verdict": "diverged"`) {
				t.Fatalf("the faulty dump does not diverge (%s)", mode)
			}
		}
	}
	if fingerprint(reflect.ValueOf(base)) != before {
		t.Fatal("the replays changed the reused model")
	}

	// Another config: refused.
	cfg := *clean.Cfg
	cfg.IndexTopK = 8
	other, err := fault.Synthesize(fault.SynthOptions{Cfg: &cfg, Prefill: 7, Steps: 1, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	d, src := openSynthDir(t, other)
	if _, err := replay.LoadModelWith(d, src, replay.LoadOptions{From: base}); err == nil || !strings.Contains(err.Error(), "config differs") {
		t.Fatalf("a dump of another config: err = %v", err)
	}
	// A model without the dump's layers: refused.
	partial := &engine.Model{Cfg: base.Cfg, Weights: map[int]*engine.LayerWeights{0: base.Weights[0]}}
	if _, err := replay.LoadModelWith(d0, src0, replay.LoadOptions{From: partial}); err == nil || !strings.Contains(err.Error(), "no weights for layer 1") {
		t.Fatalf("a model without layer 1: err = %v", err)
	}
}

// fingerprint is a SHA-256 of every value reachable from v (through
// pointers, slices, maps, structs; floats by their bits): map entries
// sorted by the fingerprints of key and value, so that a map keyed by
// pointers has the same fingerprint when the values it holds are the same.
func fingerprint(v reflect.Value) string {
	var b []byte
	var walk func(v reflect.Value)
	walk = func(v reflect.Value) {
		switch x := v; x.Kind() {
		case reflect.Pointer, reflect.Interface:
			if x.IsNil() {
				b = append(b, 'n')
				return
			}
			walk(x.Elem())
		case reflect.Struct:
			for i := 0; i < x.NumField(); i++ {
				walk(x.Field(i))
			}
		case reflect.Slice, reflect.Array:
			b = binary.LittleEndian.AppendUint64(b, uint64(x.Len()))
			if x.Kind() == reflect.Slice && x.CanInterface() {
				switch s := x.Interface().(type) {
				case []float32:
					for _, f := range s {
						b = binary.LittleEndian.AppendUint32(b, math.Float32bits(f))
					}
					return
				case []byte:
					b = append(b, s...)
					return
				}
			}
			for i := 0; i < x.Len(); i++ {
				walk(x.Index(i))
			}
		case reflect.Map:
			var kv []string
			for it := x.MapRange(); it.Next(); {
				kv = append(kv, fingerprint(it.Key())+"="+fingerprint(it.Value()))
			}
			sort.Strings(kv)
			b = append(b, strings.Join(kv, ",")...)
		case reflect.Float32, reflect.Float64:
			b = binary.LittleEndian.AppendUint64(b, math.Float64bits(x.Float()))
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
			b = binary.LittleEndian.AppendUint64(b, uint64(x.Int()))
		case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
			b = binary.LittleEndian.AppendUint64(b, x.Uint())
		case reflect.Bool:
			b = append(b, fmt.Sprint(x.Bool())...)
		case reflect.String:
			b = append(b, x.String()...)
		default: // func, chan, unsafe pointer: whether set
			b = append(b, fmt.Sprint(x.IsNil())...)
		}
	}
	walk(v)
	sum := sha256.Sum256(b)
	return string(sum[:])
}
