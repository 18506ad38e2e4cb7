package replay_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/fault"
)

// BenchmarkReplayBigDump writes a native dump of SPARSEMLA_BENCH_DUMP_GB GiB
// (e.g. 20) and replays it with the sparsemla command (local mode, the
// default), on the prepared path (the default) and with --reference,
// reporting the replay's time per step and peak resident set size: a replay must
// stream the dump (memory bounded by the records of the units in flight, not
// by the file). The dump is a real one: V4-Flash layer 2 (CSA) from a
// 65,536-token synthetic state, every stage of consecutive decode steps
// computed by the reference chain (RunStep on the prepared weights, which is
// bit-identical), ~23 MiB per step (kv_cache alone 16.5 MiB), written as it is
// produced. It needs the disk space (the temp dir, or SPARSEMLA_BENCH_DUMP_DIR)
// and some minutes:
//
//	SPARSEMLA_BENCH_DUMP_GB=20 go test ./replay -run '^$' -bench ReplayBigDump -benchtime 1x -timeout 90m
func BenchmarkReplayBigDump(b *testing.B) {
	gb, _ := strconv.ParseFloat(os.Getenv("SPARSEMLA_BENCH_DUMP_GB"), 64)
	if gb <= 0 {
		b.Skip("set SPARSEMLA_BENCH_DUMP_GB (e.g. 20) to write and replay a dump of that size")
	}
	dir := os.Getenv("SPARSEMLA_BENCH_DUMP_DIR")
	if dir == "" {
		dir = b.TempDir()
	}
	bin := filepath.Join(dir, "sparsemla")
	if out, err := exec.Command("go", "build", "-o", bin, "sparsemla/cmd/sparsemla").CombinedOutput(); err != nil {
		b.Fatalf("building the command: %v\n%s", err, out)
	}
	steps, size, maxRec := writeBigDump(b, dir, int64(gb*(1<<30)))
	// the command's default (prepared fast kernels on compact weights) and
	// --reference (the plain loops); the reports must agree but for "kernels"
	outs := map[string][]byte{}
	for _, kernels := range []string{engine.KernelsPrepared, engine.KernelsReference} {
		b.Run("kernels="+kernels, func(b *testing.B) {
			for b.Loop() {
				args := []string{"replay", "--json", dir}
				if kernels == engine.KernelsReference {
					args = append(args, "--reference")
				}
				cmd := exec.Command(bin, args...)
				var stdout bytes.Buffer
				cmd.Stdout, cmd.Stderr = &stdout, nil
				t0 := time.Now()
				if err := cmd.Start(); err != nil {
					b.Fatal(err)
				}
				hwm := watchHWM(cmd.Process.Pid)
				err := cmd.Wait()
				el := time.Since(t0)
				peak := <-hwm
				out := stdout.Bytes()
				if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 1 {
					err = nil // 1 = diverged: a verdict, not a failure to replay
				}
				if err != nil {
					b.Fatalf("replay: %v", err)
				}
				var rep struct {
					Kernels string            `json:"kernels"`
					Stages  []json.RawMessage `json:"stages"`
				}
				if err := json.Unmarshal(out, &rep); err != nil || rep.Kernels != kernels {
					b.Fatalf("replay: kernels %q (want %s), %v", rep.Kernels, kernels, err)
				}
				outs[kernels] = bytes.Replace(out, []byte(`"kernels": "`+kernels+`"`), nil, 1)
				b.ReportMetric(float64(peak)/(1<<10), "peak-RSS-MiB")
				b.ReportMetric(float64(size)/(1<<30), "dump-GiB")
				b.ReportMetric(float64(maxRec)/(1<<20), "largest-record-MiB")
				b.ReportMetric(float64(steps), "steps")
				b.ReportMetric(el.Seconds()/float64(steps), "s/step")
				b.ReportMetric(float64(size)/el.Seconds()/(1<<20), "MiB/s")
			}
		})
	}
	if a, r := outs[engine.KernelsPrepared], outs[engine.KernelsReference]; a != nil && r != nil && !bytes.Equal(a, r) {
		b.Fatalf("the prepared and the reference replays' reports differ (apart from kernels)")
	}
}

// writeBigDump writes config.json, weights.safetensors (layer 2 only) and
// dump.smd into dir: the start state of layer 2 after position P0−1 and every
// stage of steps P0, P0+1, … until the dump holds at least target bytes. It
// returns the number of steps, the dump size and the largest record.
func writeBigDump(b *testing.B, dir string, target int64) (steps int, size, maxRec int64) {
	cfg, _ := engine.Preset("flash")
	cfg.MaxSeqLen = 1 << 20
	const layer = 2
	const p0 = 65536 + 1
	w := engine.RandomLayerWeights(cfg, layer, 5)
	cfgJSON, err := json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, fault.SynthConfigFile), cfgJSON, 0o644); err != nil {
		b.Fatal(err)
	}
	wf, err := os.Create(filepath.Join(dir, fault.SynthWeightsFile))
	if err != nil {
		b.Fatal(err)
	}
	if err := dump.WriteSafetensors(wf, engine.LayerWeightRecords(cfg, w), map[string]string{"producer": "sparsemla BenchmarkReplayBigDump"}); err != nil {
		b.Fatal(err)
	}
	wf.Close()
	maxSteps := int(target/(20<<20)) + 2
	rope := engine.LayerRope(cfg, layer, p0+maxSteps+1)
	st := engine.SyntheticState(cfg, w, rope, p0, 5)
	engine.PrepareLayer(cfg, w) // the reference chain on the fast kernels: the same bits, faster
	dw, err := dump.Create(filepath.Join(dir, fault.SynthDumpFile), dump.Header{ModelArgs: string(cfgJSON),
		CompressRatios: cfg.CompressRatios, Producer: map[string]string{"engine": "sparsemla BenchmarkReplayBigDump"}})
	if err != nil {
		b.Fatal(err)
	}
	put := func(t engine.Tensor, step int, stage string, kind dump.Kind) {
		rec := engine.TensorRecord(t, dump.Key{Request: fault.SynthRequest, Step: step, Layer: layer, Stage: stage}, kind)
		if err := dw.Write(&rec); err != nil {
			b.Fatal(err)
		}
		size += int64(len(rec.Data))
		maxRec = max(maxRec, int64(len(rec.Data)))
	}
	for name, t := range st.StateTensors() {
		put(t, p0-1, name, dump.KindState)
	}
	t0 := time.Now()
	for p := int64(p0); size < target; p++ {
		ctx := &engine.StepContext{Cfg: cfg, Layer: layer, Pos: p, W: w, Rope: rope}
		x := engine.SyntheticInput(cfg, p, 5)
		out, next, err := engine.RunStep(ctx, x, st)
		if err != nil {
			b.Fatal(err)
		}
		put(x, int(p), "x", dump.KindStage)
		for _, name := range slices.Sorted(maps.Keys(out)) {
			put(out[name], int(p), name, dump.KindStage)
		}
		st = next
		steps++
		if steps%50 == 0 {
			b.Logf("dump: %d steps, %.1f GiB, %.0f s", steps, float64(size)/(1<<30), time.Since(t0).Seconds())
		}
	}
	if err := dw.Close(); err != nil {
		b.Fatal(err)
	}
	w.Fast = nil
	runtime.GC()
	fmt.Fprintf(os.Stderr, "wrote %d steps, %.2f GiB, largest record %.1f MiB in %.0f s\n", steps, float64(size)/(1<<30), float64(maxRec)/(1<<20), time.Since(t0).Seconds())
	return steps, size, maxRec
}

// watchHWM polls the VmHWM (peak resident set, KiB) of process pid every
// 10 ms until it exits and sends the last value read. getrusage's maxrss of a
// child is no use here: Go starts children with vfork, and the kernel carries
// the parent's high-water mark (this benchmark's, the larger) into the child
// at exec.
func watchHWM(pid int) <-chan int64 {
	ch := make(chan int64, 1)
	go func() {
		var last int64
		for {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
			if err != nil {
				break
			}
			i := strings.Index(string(b), "VmHWM:")
			if i < 0 {
				break
			}
			f := strings.Fields(string(b[i+len("VmHWM:"):]))
			if len(f) == 0 {
				break
			}
			v, err := strconv.ParseInt(f[0], 10, 64)
			if err != nil {
				break
			}
			if v < last && last > 0 { // a zombie reports 0: keep the last live value
				break
			}
			last = v
			time.Sleep(10 * time.Millisecond)
		}
		ch <- last
	}()
	return ch
}
