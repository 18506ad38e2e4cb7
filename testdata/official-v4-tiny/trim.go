//go:build ignore

// trim.go makes this directory from the full official-v4-tiny GPU dumps:
//
//	go run ./testdata/official-v4-tiny/trim.go -src /work/shared/golden/official-v4-tiny -dst testdata/official-v4-tiny
//
// It keeps every tensor of every step and every parameter (see README.md) and
// stores weights losslessly in smaller dtypes where the values allow it; it
// fails if any conversion would change a value.
package main

import (
	"bytes"
	"encoding/binary"
	"flag"
	"fmt"
	"log"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"sparsemla/dump"
	"sparsemla/quant"
)

var (
	src = flag.String("src", "/work/shared/golden/official-v4-tiny", "full golden directory")
	dst = flag.String("dst", "testdata/official-v4-tiny", "output directory")
)

func main() {
	flag.Parse()
	log.SetFlags(0)
	for _, f := range []string{"config.json"} {
		b, err := os.ReadFile(filepath.Join(*src, f))
		check(err)
		check(os.WriteFile(filepath.Join(*dst, f), b, 0o644))
	}
	copyFile("rope_tables.safetensors", nil)
	copyFile("prefill_state.safetensors", nil)
	for P := 2; P <= 7; P++ {
		copyFile(fmt.Sprintf("step_%d.safetensors", P), nil)
	}
	copyFile("weights.safetensors", shrinkWeight)
}

// copyFile rewrites one safetensors file with every tensor and its metadata,
// passing each record through conv (when non-nil).
func copyFile(name string, conv func(*dump.Record) string) {
	in, err := dump.OpenSafetensors(filepath.Join(*src, name))
	check(err)
	defer in.Close()
	var recs []dump.Record
	meta := map[string]string{}
	names := in.Names()
	sort.Strings(names)
	for _, n := range names {
		r, err := in.Read(n)
		check(err)
		if m, ok := in.Metadata[n]; ok {
			meta[n] = m
		}
		if conv != nil {
			if note := conv(&r); note != "" {
				meta[r.Name] = note
			}
		}
		recs = append(recs, r)
	}
	recs = append(recs, pending...)
	pending = nil
	for k, v := range in.Metadata {
		if _, set := meta[k]; !set {
			meta[k] = v // file-level keys (a conversion note wins over a tensor's own)
		}
	}
	var buf bytes.Buffer
	check(dump.WriteSafetensors(&buf, recs, meta))
	check(os.WriteFile(filepath.Join(*dst, name), buf.Bytes(), 0o644))
	log.Printf("%s: %d tensors, %d bytes", name, len(recs), buf.Len())
}

// shrinkWeight stores fp32 tensors whose values are all bf16 as BF16 (the form
// the real checkpoint has), and the bf16 wo_a (FP8 dequantised by the golden's
// convert step) back as FP8 E4M3 codes + UE8M0 128×128 block scales (the form
// the real checkpoint has). Both are checked lossless.
func shrinkWeight(r *dump.Record) string {
	switch {
	case r.DType == dump.F32:
		v, err := r.Float32()
		check(err)
		for _, x := range v {
			if quant.BF16Round(x) != x && !(x != x) {
				return "" // keep fp32
			}
		}
		out := make([]byte, 2*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint16(out[2*i:], quant.BF16Bits(x))
		}
		r.DType, r.Data = dump.BF16, out
		return "fp32 in the original dump, every value bf16: stored BF16 (lossless)"
	case r.DType == dump.BF16 && strings.HasSuffix(r.Name, ".attn.wo_a.weight"):
		v, err := r.Float32()
		check(err)
		rows, cols := r.Shape[0], r.Shape[1]
		codes, scales := requantize(v, rows, cols)
		r.DType, r.Data = dump.E4M3, codes
		pending = append(pending, dump.Record{Name: strings.TrimSuffix(r.Name, ".weight") + ".scale", DType: dump.U8,
			Shape: []int{(rows + 127) / 128, (cols + 127) / 128}, Data: scales})
		return "bf16 in the original dump (FP8 dequantised): stored as FP8 codes + .scale (lossless)"
	}
	return ""
}

// pending holds records created by conversions (wo_a.scale); copyFile appends
// them after the file's own records.
var pending []dump.Record

// requantize finds, per 128×128 block, a power-of-two scale under which every
// value is an exact E4M3 code, and returns the codes and UE8M0 bytes.
func requantize(v []float32, rows, cols int) ([]byte, []byte) {
	br, bc := (rows+127)/128, (cols+127)/128
	codes := make([]byte, rows*cols)
	scales := make([]byte, br*bc)
	for bi := 0; bi < br; bi++ {
		for bj := 0; bj < bc; bj++ {
			found := false
			for e := -30; e <= 20 && !found; e++ {
				s := float32(math.Ldexp(1, e))
				ok := true
				for n := bi * 128; n < min(rows, bi*128+128) && ok; n++ {
					for k := bj * 128; k < min(cols, bj*128+128); k++ {
						x := v[n*cols+k]
						c := quant.EncodeE4M3(x / s)
						if quant.DecodeE4M3(c)*s != x {
							ok = false
							break
						}
						codes[n*cols+k] = c
					}
				}
				if ok {
					scales[bi*bc+bj] = byte(e + 127)
					found = true
				}
			}
			if !found {
				log.Fatalf("block (%d,%d) has no lossless FP8 form", bi, bj)
			}
		}
	}
	return codes, scales
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
