package replay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"testing"

	"sparsemla/dump"
	"sparsemla/engine"
	"sparsemla/replay"
)

// testdata/hf-v4-tiny: transformers 5.17's DeepseekV4ForCausalLM on an H200,
// captured eagerly (hf_eager) and decoding under CUDA-graph replay
// (hf_graph), with its bf16 weights (ckpt_l01, save_pretrained names). Both
// replay against the official reference on the bf16 checkpoint (policy
// official forced: their header names hf-eager): the same
// report, and every stage that diverges is one where HF's code computes
// something else than model.py — each reproduced element for element from
// the dump by HF's own code in package dump's tests:
//
//	rope_table    cos/sin rounded to bf16 (DeepseekV4RotaryEmbedding: cos.to(x.dtype); TestHFDumpRopeTables)
//	q_pe_prerope  DeepseekV4UnweightedRMSNorm rounds the rsqrt factor once (TestHFDumpAgainstOfficialStages)
//	kv_cache      no FQ8 of the window K nor of the compressed row (TestHFDumpAgainstOfficialStages)
//	cmp_a, cmp_b, icmp_a, icmp_b  bf16 nn.Linear on bf16 x, model.py's compressor projects fp32 x in fp32 (same test)
//	o_inv         HF's eager attention: bf16 logits and probabilities, sink as a logit, row max subtracted (TestHFDumpAttentionIsHFs)
func TestReplayHFDumps(t *testing.T) {
	run := func(dir, policy string) *replay.Report {
		d, err := dump.Open("../testdata/hf-v4-tiny/" + dir)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		src, err := replay.NewDumpSource(d, "")
		if err != nil {
			t.Fatal(err)
		}
		m, err := replay.LoadModelWith(d, src, replay.LoadOptions{Weights: "../testdata/hf-v4-tiny/ckpt_l01", Prepared: true, Policy: policy})
		if err != nil {
			t.Fatal(err)
		}
		rep, err := replay.Run(context.Background(), m, src, replay.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return rep
	}
	eager, graph := run("hf_eager", engine.PolicyOfficial), run("hf_graph", engine.PolicyOfficial)
	if eager.Kernels != "reference" {
		t.Errorf("kernels %q: a bf16 checkpoint runs the reference loops", eager.Kernels)
	}
	eb, _ := json.Marshal(eager.Results)
	gb, _ := json.Marshal(graph.Results)
	eb = []byte(strings.ReplaceAll(string(eb), "hf_eager", "DUMP"))
	gb = []byte(strings.ReplaceAll(string(gb), "hf_graph", "DUMP"))
	if string(eb) != string(gb) || eager.Summary != graph.Summary || eager.Verdict != graph.Verdict {
		t.Errorf("the CUDA-graph dump replays differently: eager %s %+v, graph %s %+v", eager.Verdict, eager.Summary, graph.Verdict, graph.Summary)
	}
	if eager.StepsReplayed != 4 || fmt.Sprint(eager.Layers) != "[0 1]" || eager.Summary.Pass < 70 {
		t.Errorf("replayed %d steps of layers %v: %+v", eager.StepsReplayed, eager.Layers, eager.Summary)
	}
	explained := map[string]bool{"rope_table": true, "q_pe_prerope": true, "kv_cache": true, "cmp_a": true, "cmp_b": true, "icmp_a": true, "icmp_b": true, "o_inv": true}
	failed := map[string]bool{}
	for _, r := range eager.Results {
		if r.Status != replay.StatusFail {
			continue
		}
		key := fmt.Sprintf("L%d %s", r.Layer, r.Stage)
		failed[key] = true
		if !explained[r.Stage] {
			t.Errorf("step %d %s diverged (%s): not one of HF's known differences", r.Step, key, r.Reason)
		}
	}
	var got []string
	for k := range failed {
		got = append(got, k)
	}
	sort.Strings(got)
	want := "L0 kv_cache,L0 o_inv,L0 q_pe_prerope,L0 rope_table,L1 cmp_a,L1 cmp_b,L1 icmp_a,L1 icmp_b,L1 kv_cache,L1 o_inv,L1 rope_table"
	if strings.Join(got, ",") != want {
		t.Errorf("diverged stages %v, want %s", got, want)
	}
	// first: HF's RoPE table, the config's with cos/sin rounded to bf16
	if f := eager.First; eager.Verdict != "diverged" || f == nil || f.Step != 2 || f.Layer != 0 || f.Stage != "rope_table" || !strings.Contains(f.Why, "rounded to bf16") {
		t.Errorf("verdict %s, first divergence %+v", eager.Verdict, f)
	}
}

// Under their header's policy, hf-eager (transformers' eager bf16 path), the
// HF dumps agree on every compared stage: HF's head norm and RMSNorm, no FQ8
// in the cache, the bf16 compressor projections, HF's eager attention (o_inv
// from the reference's o). Not compared here, as the dumps lack their
// inputs or values: the compressor pooling from a state (HF keeps no
// official state: skipped), the indexer's iw / index_qk / index_score (not
// hooked), and index_topk only with Tc <= 1.
func TestReplayHFDumpsHFEagerPolicy(t *testing.T) {
	for _, dir := range []string{"hf_eager", "hf_graph"} {
		d, err := dump.Open("../testdata/hf-v4-tiny/" + dir)
		if err != nil {
			t.Fatal(err)
		}
		src, err := replay.NewDumpSource(d, "")
		if err != nil {
			t.Fatal(err)
		}
		m, err := replay.LoadModelWith(d, src, replay.LoadOptions{Weights: "../testdata/hf-v4-tiny/ckpt_l01"})
		if err != nil {
			t.Fatal(err)
		}
		rep, err := replay.Run(context.Background(), m, src, replay.Options{})
		d.Close()
		if err != nil {
			t.Fatal(err)
		}
		if rep.Policy != engine.PolicyHFEager || rep.Verdict == "diverged" || rep.Summary.Fail != 0 || rep.Summary.Pass != 111 {
			t.Errorf("%s: policy %q, %s %+v", dir, rep.Policy, rep.Verdict, rep.Summary)
		}
		pass := map[string]bool{}
		for _, r := range rep.Results {
			if r.Status == replay.StatusPass {
				pass[r.Stage] = true
			}
			// HF's compressor projections are bf16: judged in bf16 ulps, not
			// by the fp32 GEMM tolerance
			if (r.Stage == "cmp_a" || r.Stage == "icmp_b") && r.Tol != "ulp" {
				t.Errorf("%s: %s judged by %q", dir, r.Stage, r.Tol)
			}
		}
		// the stages where the official policy diverged now pass
		for _, s := range []string{"rope_table", "q_pe_prerope", "kv_cache", "cmp_a", "cmp_b", "icmp_a", "icmp_b", "o_inv"} {
			if !pass[s] {
				t.Errorf("%s: %s does not pass under hf-eager", dir, s)
			}
		}
	}
	// the policy needs a bf16 checkpoint: the official FP8 dump refuses it
	d, err := dump.Open("../testdata/official-v4-tiny")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	src, err := replay.NewDumpSource(d, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := replay.LoadModelWith(d, src, replay.LoadOptions{Policy: engine.PolicyHFEager}); err == nil || !strings.Contains(err.Error(), "bf16 checkpoint") {
		t.Errorf("hf-eager on the FP8 dump: %v", err)
	}
}
