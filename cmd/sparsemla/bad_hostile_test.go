package main

// Hostile-input additions to the bad-input corpus: peak memory and time
// bounds per case, the inputs' bytes checked unchanged after every case, and
// the makers of the inputs too large or too special to commit (zip bombs,
// FIFOs, devices, links, hostile names).

import (
	"archive/zip"
	"bufio"
	"bytes"
	"compress/flate"
	"crypto/sha256"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"sparsemla/dump"
	"sparsemla/userfile"
)

// procStatusKB reads one "Field:   N kB" line of /proc/self/status (0 when
// the file or the field is missing: not linux).
func procStatusKB(field string) int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return n
		}
	}
	return 0
}

// peakMeter measures the peak resident memory a run adds: the heap is
// returned to the OS first, the kernel's high-water mark (VmHWM) is reset to
// the current RSS (writing 5 to /proc/self/clear_refs), and the run's peak
// is the high-water mark after it less the RSS before.
type peakMeter struct {
	base int64 // KiB
	ok   bool
}

func startPeak() peakMeter {
	debug.FreeOSMemory()
	err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0)
	return peakMeter{base: procStatusKB("VmRSS"), ok: err == nil}
}

// addedMB is the peak RSS the run added, in MiB (-1 when not measurable).
func (p peakMeter) addedMB() int64 {
	if !p.ok {
		return -1
	}
	return (procStatusKB("VmHWM") - p.base) >> 10
}

// snapshot hashes every regular file under each path (following symbolic
// links to files; a missing path hashes as missing), so that a case can
// check that a command changed no byte of its inputs.
func snapshot(paths ...string) map[string]string {
	out := map[string]string{}
	for _, root := range paths {
		if root == "" {
			continue
		}
		filepath.WalkDir(root, func(p string, de fs.DirEntry, err error) error {
			if err != nil {
				out[p] = "error: " + err.Error()
				return nil
			}
			if de.IsDir() {
				return nil
			}
			fi, err := os.Stat(p)
			if err != nil || !fi.Mode().IsRegular() {
				out[p] = "special"
				return nil
			}
			f, err := os.Open(p)
			if err != nil {
				out[p] = "unreadable"
				return nil
			}
			h := sha256.New()
			io.Copy(h, f)
			f.Close()
			out[p] = fmt.Sprintf("%x %d", h.Sum(nil), fi.Size())
			return nil
		})
	}
	return out
}

func snapshotDiff(before, after map[string]string) []string {
	var d []string
	for p, h := range before {
		if after[p] != h {
			d = append(d, p)
		}
	}
	return d
}

// ---- inputs made at test time: too large, too special or too hostile to commit ----

// zeroBombNpz writes an .npz of `members` deflated members, each an npy
// header and mib MiB of zeros, without deflating them: a sync-flushed
// deflate block of 1 MiB of zeros is repeated (its back-references only see
// zeros). A 1 GiB member is about 1 MB on disk.
func zeroBombNpz(t *testing.T, path string, members, mib int) {
	t.Helper()
	dict := fmt.Sprintf("{'descr': '|u1', 'fortran_order': False, 'shape': (%d,), }", int64(mib)<<20)
	for (10+len(dict)+1)%64 != 0 {
		dict += " "
	}
	hdr := npyRaw(1, dict+"\n", nil)
	var comp, chunk bytes.Buffer
	hw, _ := flate.NewWriter(&comp, flate.BestCompression)
	hw.Write(hdr)
	hw.Flush()
	cw, _ := flate.NewWriter(&chunk, flate.BestCompression)
	zeros := make([]byte, 1<<20)
	cw.Write(zeros)
	cw.Flush()
	crc := crc32.ChecksumIEEE(hdr)
	for i := 0; i < mib; i++ {
		comp.Write(chunk.Bytes())
		crc = crc32.Update(crc, crc32.IEEETable, zeros)
	}
	comp.Write([]byte{0x03, 0x00}) // final empty fixed-Huffman block
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zw := zip.NewWriter(f)
	for m := 0; m < members; m++ {
		w, err := zw.CreateRaw(&zip.FileHeader{Name: fmt.Sprintf("L%d.q.npy", m), Method: zip.Deflate, CRC32: crc,
			CompressedSize64: uint64(comp.Len()), UncompressedSize64: uint64(len(hdr)) + uint64(mib)<<20})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write(comp.Bytes()); err != nil {
			t.Fatal(err)
		}
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
}

// fifo makes a named pipe at p (nobody ever writes it: opening it for
// reading the usual way blocks forever).
func fifo(t *testing.T, p string) {
	t.Helper()
	if err := syscall.Mkfifo(p, 0o644); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
}

func symlink(t *testing.T, target, p string) {
	t.Helper()
	if err := os.Symlink(target, p); err != nil {
		t.Fatal(err)
	}
}

// officialCopy links every file of testdata/official-v4-tiny into dir but
// config.json, which edit makes (or leaves out).
func officialCopy(t *testing.T, dir string, config func(p string)) string {
	t.Helper()
	src := filepath.Join("..", "..", "testdata", "official-v4-tiny")
	ents, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.Name() == "config.json" || e.IsDir() {
			continue
		}
		abs, _ := filepath.Abs(filepath.Join(src, e.Name()))
		symlink(t, abs, filepath.Join(dir, e.Name()))
	}
	config(filepath.Join(dir, "config.json"))
	return dir
}

// copyBase copies the base dump's files (real copies, not links) into dir.
func copyBase(t *testing.T, base, dir string) string {
	t.Helper()
	for _, f := range []string{"config.json", "weights.safetensors", "dump.smd"} {
		b, err := os.ReadFile(filepath.Join(base, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// hostileMakers are the inputs of the hostile-input cases (issue 17): too
// large to commit (zip bombs), special files, links, hostile names, and the
// directories the output tests write into.
var hostileMakers = map[string]func(t *testing.T, base, dir, file string) string{
	// A 1 GiB deflated member of about 1 MB, and 200 members of 64 MiB
	// (13 MB): indexed by their npy headers only; their data is refused by
	// the inflation-ratio limit, never inflated.
	"npz-bomb-1g": func(t *testing.T, _, dir, _ string) string {
		p := filepath.Join(dir, "bomb_1g.npz")
		zeroBombNpz(t, p, 1, 1024)
		return p
	},
	"npz-bomb-200x64m": func(t *testing.T, _, dir, _ string) string {
		p := filepath.Join(dir, "bomb_200x64m.npz")
		zeroBombNpz(t, p, 200, 64)
		return p
	},
	// FIFOs and devices where files are read.
	"fifo": func(t *testing.T, _, dir, _ string) string {
		p := filepath.Join(dir, "pipe.smd")
		fifo(t, p)
		return p
	},
	"fifo-in-dump-dir": func(t *testing.T, base, dir, _ string) string {
		derive(t, base, dir, nil, nil)
		fifo(t, filepath.Join(dir, "more.smd"))
		return dir
	},
	"fifo-weights": func(t *testing.T, base, dir, _ string) string {
		derive(t, base, dir, nil, nil)
		os.Remove(filepath.Join(dir, "weights.safetensors"))
		fifo(t, filepath.Join(dir, "weights.safetensors"))
		return dir
	},
	"dev-zero": func(t *testing.T, _, dir, _ string) string {
		p := filepath.Join(dir, "zero.json")
		symlink(t, "/dev/zero", p)
		return p
	},
	"official-config-dev-zero": func(t *testing.T, _, dir, _ string) string {
		return officialCopy(t, dir, func(p string) { symlink(t, "/dev/zero", p) })
	},
	"official-config-fifo": func(t *testing.T, _, dir, _ string) string {
		return officialCopy(t, dir, func(p string) { fifo(t, p) })
	},
	"official-config-dir": func(t *testing.T, _, dir, _ string) string {
		return officialCopy(t, dir, func(p string) { os.Mkdir(p, 0o755) })
	},
	// A dump directory with a symbolic-link loop among its files.
	"symlink-loop": func(t *testing.T, base, dir, _ string) string {
		derive(t, base, dir, nil, nil)
		symlink(t, filepath.Join(dir, "b.smd"), filepath.Join(dir, "a.smd"))
		symlink(t, filepath.Join(dir, "a.smd"), filepath.Join(dir, "b.smd"))
		return dir
	},
	// A broken dump whose file name holds a newline, a forged command line
	// and terminal escape codes: the error must stay one escaped line.
	"hostile-name": func(t *testing.T, _, dir, _ string) string {
		p := filepath.Join(dir, "x\nsparsemla replay: agree\x1b[32m.smd")
		if err := os.WriteFile(p, []byte("SPMLDUNP"), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	},
	// Outputs: a real copy of the base dump (the input whose bytes must not
	// change); a directory of symbolic / hard links to the base dump's files
	// (what cp -as and cp -al leave); a directory holding only a link to the
	// base's weights; a directory of the user's.
	"copy": func(t *testing.T, base, dir, _ string) string { return copyBase(t, base, dir) },
	"links-symbolic": func(t *testing.T, base, dir, _ string) string {
		for _, f := range []string{"config.json", "weights.safetensors", "dump.smd"} {
			symlink(t, filepath.Join(base, f), filepath.Join(dir, f))
		}
		return dir
	},
	"links-hard": func(t *testing.T, base, dir, _ string) string {
		for _, f := range []string{"config.json", "weights.safetensors", "dump.smd"} {
			if err := os.Link(filepath.Join(base, f), filepath.Join(dir, f)); err != nil {
				t.Skipf("hard link: %v", err)
			}
		}
		return dir
	},
	"weights-link-only": func(t *testing.T, base, dir, _ string) string {
		symlink(t, filepath.Join(base, "weights.safetensors"), filepath.Join(dir, "weights.safetensors"))
		return dir
	},
	"user-dir": func(t *testing.T, _, dir, _ string) string {
		if err := os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("mine"), 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	},
	// A dumped record whose step is 2^63-1 (the config check used to print
	// "at most -2305843009213693952 rows").
	"step-max-int": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, nil, func(r *dump.Record) bool {
			if r.Kind == dump.KindStage && r.Request == "B" && r.Step == 8 && r.Layer == 1 && r.Stage == "x" {
				r.Step = math.MaxInt64
			}
			return true
		})
	},
	// A tolerance file with a negative bound.
	"tol-negative": func(t *testing.T, _, dir, _ string) string {
		p := filepath.Join(dir, "tol.json")
		if err := os.WriteFile(p, []byte(`{"stages": {"o": {"mode": "close", "abs": -1, "rel": 0.01, "cos": 1e-5}}}`), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	},
	// A config with three problems: one error line naming all three.
	"config-three-errors": func(t *testing.T, base, dir, _ string) string {
		return derive(t, base, dir, func(h *dump.Header) {
			editModelArgs("n_heads", 0)(h)
			editModelArgs("q_lora_rank", -1)(h)
			editModelArgs("rope_head_dim", 0)(h)
		}, nil)
	},
}

func init() {
	for k, v := range hostileMakers {
		if _, dup := badMakers[k]; dup {
			panic("bad_hostile_test: duplicate maker " + k)
		}
		badMakers[k] = v
	}
}

// ---- committed: msgpack claims ----

// mpStr is a msgpack fixstr.
func mpStr(s string) []byte { return append([]byte{0xa0 | byte(len(s))}, s...) }

// rawMeta frames raw msgpack meta bytes (rawFrame encodes Go values; these
// claims cannot be encoded from Go values).
func rawMeta(meta []byte) []byte {
	var l [4]byte
	l[0], l[1], l[2], l[3] = byte(len(meta)), byte(len(meta)>>8), byte(len(meta)>>16), byte(len(meta)>>24)
	return append(l[:], meta...)
}

// claimCorpus are the committed files whose frame meta claims lengths its
// bytes do not back (vmihailenco/msgpack v5.4.1 would allocate the claim).
func claimCorpus() map[string][]byte {
	cat := func(bs ...[]byte) []byte { return bytes.Join(bs, nil) }
	arr4G := []byte{0xdd, 0xff, 0xff, 0xff, 0xff}
	map4G := []byte{0xdf, 0xff, 0xff, 0xff, 0xff}
	str4G := []byte{0xdb, 0xff, 0xff, 0xff, 0xff}
	hdr := func(field string, v []byte) []byte {
		return rawFile(1, rawMeta(cat([]byte{0x82}, mpStr("t"), mpStr("header"), mpStr("header"), []byte{0x81}, mpStr(field), v)))
	}
	okHeader := rawMeta(cat([]byte{0x82}, mpStr("t"), mpStr("header"), mpStr("header"), []byte{0x80}))
	deep := cat([]byte{0x81}, mpStr("t"), bytes.Repeat([]byte{0x91}, 1000), []byte{0x00})
	return map[string][]byte{
		"claim_compress_ratios_4g.smd": hdr("compress_ratios", arr4G),
		"claim_dtype_policy_4g.smd":    hdr("dtype_policy", map4G),
		"claim_model_args_4g.smd":      hdr("model_args", str4G),
		"claim_shape_4g.smd":           rawFile(1, okHeader, rawMeta(cat([]byte{0x82}, mpStr("t"), mpStr("tensor"), mpStr("shape"), arr4G))),
		"claim_block_table_4g.smd": rawFile(1, okHeader, rawMeta(cat([]byte{0x82}, mpStr("t"), mpStr("tensor"), mpStr("page"),
			[]byte{0x81}, mpStr("block_table"), arr4G))),
		"meta_nested_deep.smd": rawFile(1, rawMeta(deep)),
	}
}

// TestFullDiskLeavesNothing: when the disk fills up (userfile's writers fail
// with ENOSPC after 4 KiB or 1 MiB), report, synth and fault fail with one line
// saying so, and leave neither a partial file nor a temporary behind; an
// earlier output at the same path is left as it was.
func TestFullDiskLeavesNothing(t *testing.T) {
	base := badBase(t)
	dir := t.TempDir()
	html := filepath.Join(dir, "report.html")
	earlier := "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>sparsemla report: earlier" // its own: replaceable
	if err := os.WriteFile(html, []byte(earlier), 0o644); err != nil {
		t.Fatal(err)
	}
	before := snapshot(base)
	for _, c := range []struct {
		args  []string
		after int64 // bytes written before the disk is full
	}{
		{[]string{"report", base, "--html", html}, 4096},
		{[]string{"synth", "--out", filepath.Join(dir, "synth"), "--steps", "2"}, 1 << 20},
		{[]string{"fault", base, "--out", filepath.Join(dir, "faulted"), "--fault", "wrong-lse@7,2"}, 1 << 20},
	} {
		args := c.args
		restore := userfile.FailWritesAfter(c.after)
		code, out, e := rpRun(args...)
		restore()
		if code != exitError || !strings.Contains(e, "no space left on device") || strings.Count(strings.TrimRight(e, "\n"), "\n") != 0 {
			t.Errorf("%v: exit %d, stderr %q, want 2 and one line saying the disk is full\n%s", args, code, e, clip(out))
		}
		ents, _ := os.ReadDir(dir)
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		if len(names) != 1 || names[0] != "report.html" {
			t.Errorf("%v: left %v in the output directory", args, names)
		}
	}
	if b, _ := os.ReadFile(html); string(b) != earlier {
		t.Errorf("the earlier report was changed: %q", b)
	}
	if d := snapshotDiff(before, snapshot(base)); len(d) > 0 {
		t.Errorf("inputs changed: %v", d)
	}
}
