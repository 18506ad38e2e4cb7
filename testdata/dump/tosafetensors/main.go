//go:build ignore

// tosafetensors rewrites any dump dump.Open reads as a directory in the
// official-v4-tiny safetensors layout, with the requests and prefix-cache
// hits in a sparsemla.json sidecar (dump/FORMAT.md): request "" in
// step_<P>.safetensors / prefill_state.safetensors, every other request R in
// R/step_<P>.safetensors / R/prefill_state.safetensors, tables in
// rope_tables.safetensors; config.json from the header's model args, the
// weights file copied. It shows that a foreign (non-native) dump carries
// what a native one does:
//
//	go run ./cmd/sparsemla fault --in testdata/official-v4-tiny --out /tmp/stale --fault stale-prefix@5,0
//	go run ./testdata/dump/tosafetensors/main.go -in /tmp/stale -out /tmp/stale-st
//	go run ./cmd/sparsemla replay /tmp/stale-st
package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"path/filepath"
	"sort"

	"sparsemla/dump"
)

var stDType = map[dump.DType]string{dump.F32: "F32", dump.F64: "F64", dump.BF16: "BF16", dump.F16: "F16",
	dump.E4M3: "F8_E4M3", dump.E5M2: "F8_E5M2", dump.E8M0: "F8_E8M0", dump.I8: "I8", dump.I16: "I16",
	dump.I32: "I32", dump.I64: "I64", dump.U8: "U8", dump.Bool: "BOOL", dump.U16: "U16", dump.U32: "U32", dump.U64: "U64"}

type file struct {
	names []string
	recs  map[string]dump.Record
}

func main() {
	in := flag.String("in", "", "input dump")
	out := flag.String("out", "", "output directory (must not exist)")
	flag.Parse()
	if *in == "" || *out == "" {
		log.Fatal("usage: -in DUMP -out DIR")
	}
	if _, err := os.Stat(*out); err == nil {
		log.Fatalf("%s exists", *out)
	}
	d, err := dump.Open(*in)
	if err != nil {
		log.Fatal(err)
	}
	defer d.Close()
	files := map[string]*file{}
	add := func(fn, name string, r dump.Record) {
		f := files[fn]
		if f == nil {
			f = &file{recs: map[string]dump.Record{}}
			files[fn] = f
		}
		if _, dup := f.recs[name]; dup {
			log.Fatalf("%s: %s twice", fn, name)
		}
		f.names = append(f.names, name)
		f.recs[name] = r
	}
	first := -1
	for _, e := range d.Entries {
		if e.Kind == dump.KindStage && e.Step >= 0 && (first < 0 || e.Step < first) {
			first = e.Step
		}
	}
	for i := range d.Entries {
		e := &d.Entries[i]
		r, err := d.Read(e)
		if err != nil {
			log.Fatal(err)
		}
		if _, ok := stDType[r.DType]; !ok {
			log.Fatalf("%s: dtype %s has no safetensors name", e.Key, r.DType)
		}
		name := e.Stage
		if e.Layer >= 0 {
			name = fmt.Sprintf("L%d.%s", e.Layer, e.Stage)
		}
		dir := ""
		if e.Request != "" {
			dir = e.Request + "/"
		}
		switch e.Kind {
		case dump.KindStage:
			add(fmt.Sprintf("%sstep_%d.safetensors", dir, e.Step), name, r)
		case dump.KindState:
			if e.Step != first-1 {
				log.Fatalf("%s: a state valid after step %d (the layout holds states after step %d only)", e.Key, e.Step, first-1)
			}
			add(dir+"prefill_state.safetensors", name, r)
		case dump.KindTable:
			add("rope_tables.safetensors", name, r)
		default:
			log.Fatalf("%s: kind %s is not in the official layout", e.Key, e.Kind)
		}
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		log.Fatal(err)
	}
	fns := make([]string, 0, len(files))
	for fn := range files {
		fns = append(fns, fn)
	}
	sort.Strings(fns)
	for _, fn := range fns {
		if err := writeST(filepath.Join(*out, fn), files[fn]); err != nil {
			log.Fatal(err)
		}
	}
	type hit struct {
		Request string `json:"request"`
		Source  string `json:"source"`
		Tokens  int    `json:"tokens"`
	}
	sc := struct {
		Version int   `json:"version"`
		Prefix  []hit `json:"prefix,omitempty"`
	}{Version: 1}
	for _, p := range d.Prefix {
		sc.Prefix = append(sc.Prefix, hit{p.Request, p.Source, p.Tokens})
	}
	b, _ := json.MarshalIndent(sc, "", "  ")
	must(os.WriteFile(filepath.Join(*out, dump.SidecarFile), append(b, '\n'), 0o644))
	must(os.WriteFile(filepath.Join(*out, "config.json"), []byte(d.Header.ModelArgs), 0o644))
	w := filepath.Join(filepath.Dir(*in), dump.WeightsFile)
	if fi, err := os.Stat(*in); err == nil && fi.IsDir() {
		w = filepath.Join(*in, dump.WeightsFile)
	}
	must(copyFile(w, filepath.Join(*out, dump.WeightsFile)))
	fmt.Printf("wrote %d safetensors files, %d prefix hits, into %s\n", len(fns), len(sc.Prefix), *out)
}

func writeST(path string, f *file) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	hdr := map[string]interface{}{}
	var data bytes.Buffer
	for _, n := range f.names {
		r := f.recs[n]
		off := data.Len()
		data.Write(r.Data)
		shape := r.Shape
		if shape == nil {
			shape = []int{}
		}
		hdr[n] = map[string]interface{}{"dtype": stDType[r.DType], "shape": shape, "data_offsets": []int{off, data.Len()}}
	}
	h, err := json.Marshal(hdr)
	if err != nil {
		return err
	}
	for len(h)%8 != 0 {
		h = append(h, ' ')
	}
	var out bytes.Buffer
	binary.Write(&out, binary.LittleEndian, uint64(len(h)))
	out.Write(h)
	out.Write(data.Bytes())
	return os.WriteFile(path, out.Bytes(), 0o644)
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func must(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
