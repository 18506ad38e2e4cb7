// Package dump reads and writes the tensors a GPU decode path dumps, so that a
// replay can compare them stage by stage with the CPU reference.
//
// # Overview
//
// Every tensor is a [Record]: a [Key] (request id, decode step = absolute
// position p, layer, canonical stage name), a [DType], a shape and raw
// little-endian bytes. Records come from:
//
//   - safetensors files ([OpenSafetensors]): own reader, lazy per-tensor reads
//     with ReadAt, header checked against the file size.
//
// Decoding to numbers goes through the quant package ([Record.Float32],
// [Record.Int64]); dump never imports engine (engine imports dump).
//
// # Shapes and axis order
//
// Shapes are PyTorch order, row-major, innermost axis last, with the batch and
// sequence dims of size 1 removed (as in the official-v4-tiny golden dumps).
// FP4 holds two E2M1 codes per byte, the even element in the low nibble.
//
// # Invariants
//
// Anything read from outside (files, headers, name maps) is validated before
// use: a header's sizes are checked against the file size before anything is
// allocated, element counts are checked for overflow, and every error names
// the file, the record and the byte offset. Readers never panic on bad input.
//
// # Precision
//
// Decoding is exact: bf16, f16, e4m3, e5m2, e8m0 and fp4 values are all exact
// fp32 values. Only f64 records are rounded (to nearest fp32) by Float32.
package dump
