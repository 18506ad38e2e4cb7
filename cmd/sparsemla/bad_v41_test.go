package main

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"sparsemla/dump"
)

// Bad-input makers over a native DeepSeek-V4.1 dump (synth --config
// v41-tiny --format native-pages, steps 6 … 7): the caches as V4.1 KV pages
// only, so a page byte is the GPU's cache.

var (
	badV41Once sync.Once
	badV41Dir  string
	badV41Err  string
)

// badV41Base writes (once per test binary) the clean native V4.1 dump.
func badV41Base(t *testing.T) string {
	t.Helper()
	badV41Once.Do(func() {
		dir, err := os.MkdirTemp("", "sparsemla-bad-v41")
		if err != nil {
			badV41Err = err.Error()
			return
		}
		badV41Dir = filepath.Join(dir, "v41")
		if code, _, e := rpRun("synth", "--config", "v41-tiny", "--format", "native-pages", "--out", badV41Dir, "--steps", "2", "--seed", "3"); code != exitOK {
			badV41Err = e
		}
	})
	if badV41Err != "" {
		t.Fatal("synth v41 base: " + badV41Err)
	}
	return badV41Dir
}

func v41Page(r *dump.Record, step, layer int, stage string) bool {
	return r.Kind == dump.KindPage && r.Step == step && r.Layer == layer && r.Stage == stage
}

var v41BadMakers = map[string]func(t *testing.T, base, dir, file string) string{
	"v41-clean": func(t *testing.T, _, dir, _ string) string { return derive(t, badV41Base(t), dir, nil, nil) },
	// An older window row's UE8M0 scale byte 0xFF (NaN) in the page of step 7.
	"v41-page-nan-scale": func(t *testing.T, _, dir, _ string) string {
		return derive(t, badV41Base(t), dir, nil, func(r *dump.Record) bool {
			if v41Page(r, 7, 3, "window/0") {
				r.Data = append([]byte(nil), r.Data...)
				r.Data[2*528+512+4] = 0xff
			}
			return true
		})
	},
	// A compressed-row page in V4's page layout.
	"v41-page-layout": func(t *testing.T, _, dir, _ string) string {
		return derive(t, badV41Base(t), dir, nil, func(r *dump.Record) bool {
			if v41Page(r, 6, 2, "ckv/0") {
				r.Page.Layout = "v4-model1"
			}
			return true
		})
	},
	// A window page whose block table misses the block it is in.
	"v41-page-block-table": func(t *testing.T, _, dir, _ string) string {
		return derive(t, badV41Base(t), dir, nil, func(r *dump.Record) bool {
			if r.Kind == dump.KindPage && r.Step == 6 && r.Layer == 0 && strings.HasPrefix(r.Stage, "window/") {
				r.Page.BlockTable = []int{9, 1}
			}
			return true
		})
	},
	// The shared index-key slot named at a layer that owns no keys.
	"v41-index-k-at": func(t *testing.T, _, dir, _ string) string {
		return derive(t, badV41Base(t), dir, nil, func(r *dump.Record) bool {
			if r.Kind == dump.KindState && r.Stage == "index_k_at" {
				r.Data = []byte{3, 0, 0, 0}
			}
			return true
		})
	},
	// Layer 5's start-state index keys left out.
	"v41-no-icache-state": func(t *testing.T, _, dir, _ string) string {
		return derive(t, badV41Base(t), dir, nil, func(r *dump.Record) bool {
			return !(r.Kind == dump.KindState && r.Layer == 5 && r.Stage == "icache")
		})
	},
	// The header names transformers' eager policy.
	"v41-hf-eager": func(t *testing.T, _, dir, _ string) string {
		return derive(t, badV41Base(t), dir, func(h *dump.Header) { h.DTypePolicy["policy"] = "hf-eager" }, nil)
	},
}

func init() {
	for k, v := range v41BadMakers {
		if _, dup := badMakers[k]; dup {
			panic("bad_v41_test: duplicate maker " + k)
		}
		badMakers[k] = v
	}
}
