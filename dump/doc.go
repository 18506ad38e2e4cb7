// Package dump reads and writes the tensors a GPU decode path dumps, so that a
// replay can compare them stage by stage with the CPU reference.
//
// # Overview
//
// Every tensor is a [Record]: a [Key] (request id, decode step = absolute
// position p, layer (-1 = global), canonical stage name), a [Kind] (stage,
// replay start state, GPU table, KV page, weight), a [DType], a shape and
// raw little-endian bytes. [Stages] lists the canonical stage names of one
// V4 decode step with their dtypes and symbolic shapes (FORMAT.md has the
// same table).
//
// Sources, all yielding the same keyed index ([Dump], from [Open],
// [OpenMapped] or [OpenReaderAt]):
//
//   - the native format (FORMAT.md): magic + version, a msgpack header frame
//     (ModelArgs JSON, layer schedule, dtype policy, producer, user
//     metadata), then one frame per record. [Writer] writes it, the Python
//     package in capture/ writes it from PyTorch hooks, [StreamReader] reads
//     it from any io.Reader, [Open] indexes a file or a directory of *.smd,
//     [OpenReaderAt] one file held in memory (the same reader, checks and
//     errors);
//   - safetensors files or directories ([OpenSafetensors]: own reader, lazy
//     per-tensor ReadAt, header validated against the file size);
//   - .npy files and .npz archives ([ParseNpyHeader]; bf16/fp8 saved as their
//     bits plus a name-map dtype override);
//   - Hugging Face checkpoints ([OpenCheckpoint]: index.json + shards, only
//     requested tensors read, official and HF names: transformers' DeepSeek-V4
//     module names and save_pretrained names map to model.py's, [OfficialName]);
//     an HF config.json becomes ModelArgs ([ModelArgsFromHF]);
//   - torch.save .pt files (gopickle under a strict allow-list of globals;
//     claimed lengths checked before decoding), SGLang dumper directories and
//     its older per-pass tensor dumps (built-in maps sglang,
//     sglang-tensor-dump), official-layout windows without a prefill state
//     (official-v4-window).
//
// Foreign dumps carry their request ids and prefix-cache hits in a
// sparsemla.json sidecar or in safetensors __metadata__ keys ([Sidecar]);
// tensor-parallel shard records (native) are merged on read ([ShardInfo]).
//
// Foreign tensor names become keys through a [NameMap] (JSON regexps with
// named captures for request, step, layer, stage); built-in maps are embedded
// from maps/*.json, and official-v4-tiny is detected automatically.
//
// Decoding goes through the quant package ([Record.Float32],
// [Record.Int64], [Record.Stats]); dump never imports engine (engine imports
// dump).
//
// # Shapes and axis order
//
// Shapes are PyTorch order, row-major, innermost axis last, with the batch and
// sequence dims of size 1 removed (as in the official-v4-tiny golden dumps).
// FP4 holds two E2M1 codes per byte, the even element in the low nibble; its
// shape counts elements.
//
// # Invariants
//
// A (key, kind) pair occurs at most once in a dump; readers reject
// duplicates. State records are keyed by the step they are valid after.
// Anything read from outside (files, headers, name maps) is validated before
// use: claimed lengths are checked against the bytes left in the file before
// anything is allocated (a stream of unknown size grows its buffer only as
// data arrives), element counts are checked for overflow and against the
// byte count, and every error names the file, the record and the byte
// offset. A frame's msgpack meta is walked before it is decoded, so that
// every array, map and string length it claims is backed by bytes that are
// there (msgcheck.go: vmihailenco/msgpack v5.4.1 would allocate a slice of
// the claimed length). A deflated .npz member is indexed by inflating its
// npy header only; reading it inflates exactly its data, refusing more than
// NpzMaxRatio:1 above NpzRatioFree bytes. Files are opened through package
// userfile: regular files only (a FIFO, device or socket is refused at
// once), name maps and config.json capped, open errors said in words.
// Readers never panic on bad input (fuzz targets: FuzzNative,
// FuzzSafetensorsHeader, FuzzNpyHeader, FuzzNameMap, FuzzNpz,
// FuzzCheckpointIndex, FuzzMsgpackCheck).
//
// Memory: the index holds only metadata; [Dump.Read] reads one record with
// one ReadAt, so reading a many-GB dump needs the largest record, not the
// file (BenchmarkNativeBig measures it).
//
// # Precision
//
// Decoding is exact: bf16, f16, e4m3, e5m2, e8m0 and fp4 values are all exact
// fp32 values. Only f64 records are rounded (to nearest fp32) by Float32.
package dump
