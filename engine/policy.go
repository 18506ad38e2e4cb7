package engine

import (
	"fmt"
	"math"

	"sparsemla/attention"
	"sparsemla/quant"
)

// Numerics policies: the rounding points the reference follows. A policy is
// selected per model (Config.SetPolicy; package replay takes it from a
// dump's header dtype_policy["policy"] or an option) and changes the Compute
// and the Equation of the stages it names (Stages); every other stage is the
// official one.
const (
	// PolicyOfficial is model.py: the FP8 checkpoint (dtype "fp8", the
	// default) or a bf16 one (dtype "bf16", Config.BF16Checkpoint).
	PolicyOfficial = "official"
	// PolicyHFEager is transformers' DeepseekV4ForCausalLM run eagerly in
	// bf16 (modeling_deepseek_v4.py, as the tests of testdata/hf-v4-tiny
	// reproduce it from a GPU dump): the bf16 linears of a bf16 checkpoint,
	// and HFEagerStages.
	PolicyHFEager = "hf-eager"
)

// PolicyNames lists the policies SetPolicy accepts.
func PolicyNames() []string { return []string{PolicyOfficial, PolicyHFEager} }

// SetPolicy selects the numerics policy ("" is PolicyOfficial). hf-eager
// needs a bf16 checkpoint (HF runs bf16 weights).
func (c *Config) SetPolicy(name string) error {
	switch name {
	case "", PolicyOfficial:
		c.Policy = ""
	case PolicyHFEager:
		if c.V32() {
			return fmt.Errorf("engine: policy %s is transformers' DeepSeek-V4 path; a V3.2 model has the official model.py path only", name)
		}
		if !c.BF16Checkpoint() {
			return fmt.Errorf("engine: policy %s needs a bf16 checkpoint (dtype \"bf16\"), the config says dtype %q", name, c.DType)
		}
		c.Policy = name
	default:
		return fmt.Errorf("engine: unknown numerics policy %q (have %v)", name, PolicyNames())
	}
	return nil
}

// PolicyName is the selected policy's name.
func (c *Config) PolicyName() string {
	if c.Policy == "" {
		return PolicyOfficial
	}
	return c.Policy
}

// hfStage is one stage as HF's eager path computes it.
type hfStage struct {
	eq      string
	compute func(ctx *StepContext, in map[string]Tensor) (Tensor, error)
}

// HFEagerStages are the stages PolicyHFEager changes, each with HF's code:
//
//	cq, kv_normed, cmp_normed, icmp_normed  DeepseekV4RMSNorm: bf16(w · bf16(x·rsqrt(mean(x²)+eps)))
//	q_pe_prerope, q      DeepseekV4UnweightedRMSNorm: bf16(x · bf16(rsqrt(mean(f32(x)²)+eps)))
//	kv, cmp_row          no FQ8 (the cache keeps the roped bf16 rows)
//	iq_had, iq, icmp_had, icmp_row   no Hadamard, no FP4
//	cmp_a, cmp_b, icmp_a, icmp_b     bf16 nn.Linear on bf16 x (kv_proj / gate_proj)
//	cmp_pooled, icmp_pooled          bf16(Σ_e bf16(kv_e · bf16(softmax_e(score)))) (softmax fp32)
//	iw, index_qk, index_score        fp32: iw_raw·IH^-0.5, q·k, Σ_h ReLU(q·k)·ID^-0.5·iw (scorer)
//	o                    eager_attention_forward: bf16 logits bf16(bf16(q·k)·τ), the fp32
//	                     sink as a logit, max subtracted, fp32 softmax, bf16 probabilities, bf16 P·V
func HFEagerStages() map[string]string {
	m := map[string]string{}
	for name, s := range hfEager {
		m[name] = s.eq
	}
	return m
}

var hfEager map[string]hfStage

func init() {
	hfEager = map[string]hfStage{
		"cq":           {"cq = HFRMSNorm(q_a, q_norm) = bf16(w · bf16(q_a·rsqrt(mean(q_a²)+eps)))", hfNorm("q_a", "cq")},
		"kv_normed":    {"kv_normed = HFRMSNorm(kv_raw, kv_norm)", hfNorm("kv_raw", "kv_normed")},
		"q_pe_prerope": {"q_pe_prerope = HFHeadNorm(q_b)[:, nope:] = bf16(q_b · bf16(rsqrt(mean(f32(q_b)²)+eps)))", hfQPePrerope},
		"q":            {"q = [HFHeadNorm(q_b)[:, :nope] | RoPE(q_pe_prerope, p)]", hfQ},
		"kv":           {"kv = kv_roped  (HF: no FQ8)", hfCopy("kv_roped", 0)},
		"iq_had":       {"iq_had = iq_roped  (HF: no Hadamard)", hfCopy("iq_roped", 1)},
		"iq":           {"iq = iq_had  (HF: no FP4)", hfCopy("iq_had", 1)},
		"iw":           {"iw = f32(iw_raw) · f32(H_I^-0.5)  (fp32)", hfIw},
		"index_qk":     {"index_qk[h][j] = f32(iq[h]) · f32(icache[j])  (fp32)", hfIndexQK},
		"index_score":  {"index_score[j] = Σ_h f32(ReLU(index_qk[h][j]) · 128^-0.5) · iw[h]  (fp32)", hfIndexScore},
		"o":            {"o = HFEagerAttn(q, kv_cache[topk_idxs], attn_sink): bf16 logits, sink logit, max subtracted, bf16 P", hfO},
	}
	for _, p := range []string{"cmp_", "icmp_"} {
		idx := p == "icmp_"
		hfEager[p+"a"] = hfStage{p + "a = bf16(Wkv · x)  (HF: bf16 nn.Linear)", hfProject(idx, true)}
		hfEager[p+"b"] = hfStage{p + "b = bf16(Wgate · x)  (HF: bf16 nn.Linear)", hfProject(idx, false)}
		hfEager[p+"pooled"] = hfStage{p + "pooled = bf16(Σ_e bf16(kv · bf16(softmax_e(score))))", hfPooled(idx, p)}
		hfEager[p+"normed"] = hfStage{p + "normed = HFRMSNorm(" + p + "pooled, compressor.norm)", hfCmpNormed(idx, p)}
	}
	hfEager["cmp_row"] = hfStage{"cmp_row = cmp_roped  (HF: no FQ8)", hfCopy("cmp_roped", 0)}
	hfEager["icmp_had"] = hfStage{"icmp_had = icmp_roped  (HF: no Hadamard)", hfCopy("icmp_roped", 0)}
	hfEager["icmp_row"] = hfStage{"icmp_row = icmp_had  (HF: no FP4)", hfCopy("icmp_had", 0)}
}

// applyPolicy replaces the stages the config's policy changes.
func applyPolicy(cfg *Config, defs []StageDef) {
	if cfg.Policy != PolicyHFEager {
		return
	}
	for i := range defs {
		if s, ok := hfEager[defs[i].Name]; ok {
			defs[i].Equation, defs[i].Compute = s.eq, s.compute
		}
	}
}

// HFRMSNorm is DeepseekV4RMSNorm.forward on a bf16 x with a bf16 weight:
// `hidden_states * torch.rsqrt(variance + eps)` in fp32, then
// `self.weight * hidden_states.to(input_dtype)`: y = bf16(w · bf16(x·rs)).
func HFRMSNorm(y, x, w []float32, eps float32) {
	var ss float32
	for _, v := range x {
		ss += float32(v * v)
	}
	rs := float32(1 / math.Sqrt(float64(ss/float32(len(x))+eps)))
	for i, v := range x {
		y[i] = quant.BF16Round(w[i] * quant.BF16Round(v*rs))
	}
}

// HFHeadNorm is DeepseekV4UnweightedRMSNorm per head of q [heads][d], in
// place: `x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) +
// self.eps).to(x.dtype)`: one bf16 rounding of the factor, one of the product.
func HFHeadNorm(q []float32, d int, eps float32) {
	for h := 0; h < len(q)/d; h++ {
		qh := q[h*d : (h+1)*d]
		var ss float32
		for _, v := range qh {
			ss += float32(v * v)
		}
		rho := quant.BF16Round(float32(1 / math.Sqrt(float64(ss/float32(d)+eps))))
		for i, v := range qh {
			qh[i] = quant.BF16Round(v * rho)
		}
	}
}

func hfNorm(from, to string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		w := ctx.W.QNorm
		if to == "kv_normed" {
			w = ctx.W.KVNorm
		}
		x, err := inF(in, from, len(w))
		if err != nil {
			return Tensor{}, err
		}
		y := make([]float32, len(x))
		HFRMSNorm(y, x, w, float32(ctx.Cfg.NormEps))
		return bf16T(y, len(y)), nil
	}
}

func hfQPePrerope(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	return qPePreropeWith(ctx, in, HFHeadNorm)
}

func hfQ(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	return qWith(ctx, in, HFHeadNorm)
}

// hfCopy passes a stage's input through (a rounding HF does not do); heads > 0
// keeps the [heads][d] shape of the indexer query.
func hfCopy(from string, heads int) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		t, ok := in[from]
		if !ok || !t.Kind.IsFloat() || len(t.F) != t.Len() {
			return Tensor{}, fmt.Errorf("missing input %s", from)
		}
		if heads > 0 {
			ix := ctx.W.Indexer
			if len(t.F) != ix.NHeads*ix.HeadDim {
				return Tensor{}, fmt.Errorf("input %s has %d values, want %d", from, len(t.F), ix.NHeads*ix.HeadDim)
			}
			return bf16T(append([]float32(nil), t.F...), ix.NHeads, ix.HeadDim), nil
		}
		return bf16T(append([]float32(nil), t.F...), t.Shape...), nil
	}
}

func hfCompressor(ctx *StepContext, idx bool) *attention.Compressor {
	if idx {
		return ctx.W.Indexer.Compressor
	}
	return ctx.W.Compressor
}

func hfProject(idx, wantA bool) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		c := hfCompressor(ctx, idx)
		x, err := inF(in, "x", c.Dim)
		if err != nil {
			return Tensor{}, err
		}
		y := make([]float32, c.Width())
		if pkv, pgate := c.Panels(); pkv != nil {
			// a compact compressor (its weights as panels only):
			// Panels.Linear is BF16Linear's bits
			if wantA {
				pkv.Linear(y, x)
			} else {
				pgate.Linear(y, x)
			}
			return bf16T(y, len(y)), nil
		}
		w := c.Wgate
		if wantA {
			w = c.Wkv
		}
		attention.BF16Linear(y, x, w, c.Width(), c.Dim)
		return bf16T(y, len(y)), nil
	}
}

// hfPooled is HF's compressor pool, `(new_kv * new_gate.softmax(dim=2,
// dtype=torch.float32).to(new_kv.dtype)).sum(dim=2)`, over the entries the
// official state holds (HF's buffered tokens and overlap: the same values
// when cmp_a / cmp_b are HF's bf16 projections).
func hfPooled(idx bool, p string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		c := hfCompressor(ctx, idx)
		prev, err := prevCmpState(c, in, p)
		if err != nil {
			return Tensor{}, err
		}
		a, err := inF(in, p+"a", c.Width())
		if err != nil {
			return Tensor{}, err
		}
		b, err := inF(in, p+"b", c.Width())
		if err != nil {
			return Tensor{}, err
		}
		st := prev.Clone()
		c.Ingest(st, a, b, ctx.Pos)
		d, w, rows := c.HeadDim, c.Width(), c.StateRows()
		col := func(e int) int {
			if c.Coff() == 2 && e >= c.Ratio {
				return d
			}
			return 0
		}
		dst := make([]float32, d)
		e := make([]float32, rows)
		for ch := 0; ch < d; ch++ {
			m := float32(math.Inf(-1))
			for r := 0; r < rows; r++ {
				m = max(m, st.Score[r*w+col(r)+ch])
			}
			var sum float32
			for r := 0; r < rows; r++ {
				e[r] = float32(math.Exp(float64(st.Score[r*w+col(r)+ch] - m)))
				sum += e[r]
			}
			var acc float32
			for r := 0; r < rows; r++ {
				acc += quant.BF16Round(st.KV[r*w+col(r)+ch] * quant.BF16Round(e[r]/sum))
			}
			dst[ch] = quant.BF16Round(acc)
		}
		return bf16T(dst, d), nil
	}
}

func hfCmpNormed(idx bool, p string) func(*StepContext, map[string]Tensor) (Tensor, error) {
	return func(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
		c := hfCompressor(ctx, idx)
		x, err := inF(in, p+"pooled", c.HeadDim)
		if err != nil {
			return Tensor{}, err
		}
		y := make([]float32, c.HeadDim)
		HFRMSNorm(y, x, c.Norm, c.Eps)
		return bf16T(y, len(y)), nil
	}
}

func hfIw(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	ix := ctx.W.Indexer
	raw, err := inF(in, "iw_raw", ix.NHeads)
	if err != nil {
		return Tensor{}, err
	}
	s := float32(math.Pow(float64(ix.NHeads), -0.5))
	w := make([]float32, ix.NHeads)
	for i, v := range raw {
		w[i] = v * s
	}
	return FromF(KindF32, w, len(w)), nil
}

func hfIndexQK(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	ix := ctx.W.Indexer
	iq, err := inF(in, "iq", ix.NHeads*ix.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	ic, tc, err := inRows(in, "icache", ix.HeadDim)
	if err != nil {
		return Tensor{}, err
	}
	hd := ix.HeadDim
	qk := make([]float32, ix.NHeads*tc)
	for h := 0; h < ix.NHeads; h++ {
		for j := 0; j < tc; j++ {
			var s float32
			for k := 0; k < hd; k++ {
				s += float32(iq[h*hd+k] * ic[j*hd+k])
			}
			qk[h*tc+j] = s
		}
	}
	return FromF(KindF32, qk, ix.NHeads, tc), nil
}

func hfIndexScore(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	ix := ctx.W.Indexer
	t, ok := in["index_qk"]
	if !ok || !t.Kind.IsFloat() || len(t.Shape) != 2 || t.Shape[0] != ix.NHeads || len(t.F) != t.Len() {
		return Tensor{}, fmt.Errorf("input index_qk missing or not [%d, Tc] floats", ix.NHeads)
	}
	w, err := inF(in, "iw", ix.NHeads)
	if err != nil {
		return Tensor{}, err
	}
	tc := t.Shape[1]
	scale := float32(math.Pow(float64(ix.HeadDim), -0.5))
	score := make([]float32, tc)
	for j := 0; j < tc; j++ {
		var s float32
		for h := 0; h < ix.NHeads; h++ {
			s += float32(float32(max(t.F[h*tc+j], 0)*scale) * w[h])
		}
		score[j] = s
	}
	return FromF(KindF32, score, tc), nil
}

// HFEagerAttn is eager_attention_forward for one decode query, head by head:
// logits bf16(bf16(q·k_j)·τ) over the rows idx selects (-1: none), the head's
// fp32 sink appended as a logit, the row max subtracted, an fp32 softmax,
// probabilities rounded to bf16, o = bf16(Σ_j p_j·v_j) (K = V).
func HFEagerAttn(o, q, kv []float32, d int, idx []int32, sink []float32, scale float32) {
	H := len(q) / d
	var rows []int
	for _, j := range idx {
		if j >= 0 {
			rows = append(rows, int(j))
		}
	}
	logit := make([]float32, len(rows)+1)
	for h := 0; h < H; h++ {
		qh := q[h*d : (h+1)*d]
		for n, j := range rows {
			var s float32
			for k, v := range qh {
				s += float32(v * kv[j*d+k])
			}
			logit[n] = quant.BF16Round(quant.BF16Round(s) * scale)
		}
		logit[len(rows)] = sink[h]
		m := logit[0]
		for _, v := range logit {
			m = max(m, v)
		}
		var sum float32
		for n, v := range logit {
			logit[n] = float32(math.Exp(float64(v - m)))
			sum += logit[n]
		}
		for c := 0; c < d; c++ {
			var acc float32
			for n, j := range rows {
				acc += float32(quant.BF16Round(logit[n]/sum) * kv[j*d+c])
			}
			o[h*d+c] = quant.BF16Round(acc)
		}
	}
}

func hfO(ctx *StepContext, in map[string]Tensor) (Tensor, error) {
	q, kv, idx, err := attnInputs(ctx, in)
	if err != nil {
		return Tensor{}, err
	}
	H, D := ctx.Cfg.NHeads, ctx.Cfg.HeadDim
	o := make([]float32, H*D)
	HFEagerAttn(o, q, kv, D, idx, ctx.W.AttnSink, ctx.Cfg.SoftmaxScale())
	return bf16T(o, H, D), nil
}

// PolicyDiff lists, for layer l at step p, the stages whose computation under
// cfg's checkpoint dtype and policy differs from the official FP8 checkpoint's:
// one "stage: official equation → this equation" line each, in stage order.
func PolicyDiff(cfg *Config, l int, p int64) []string {
	off := *cfg
	off.DType, off.Policy = "fp8", ""
	base := map[string]string{}
	for _, d := range Stages(&off, l, p) {
		base[d.Name] = d.Equation
	}
	var out []string
	for _, d := range Stages(cfg, l, p) {
		if b, ok := base[d.Name]; ok && b != d.Equation {
			out = append(out, fmt.Sprintf("%s: %s  →  %s", d.Name, b, d.Equation))
		}
	}
	return out
}
