package attribute

import (
	"errors"

	"sparsemla/attention"
	"sparsemla/engine"
	"sparsemla/indexer"
)

// V3.2 hypotheses: the numerics of the DeepSeek-V3.2-Exp demo code as first
// published (2305c7e, 2025-09-30), which the current official code
// (8631a81, "fix indexer rope", 2025-11-17; the reference) replaced. A GPU
// engine ported from the first version reproduces one of these bit for bit.
// They run on V3.2 models only (the stage names iq_roped and iw_raw exist in
// V4 too).

var errNotV32 = errors.New("a V3.2 hypothesis; the model is not V3.2")

func init() {
	for _, s := range []struct{ stage, from, what string }{
		{"iq_roped", "iq_b", "indexer query"}, {"ik_roped", "ik_normed", "indexer key"},
	} {
		add(s.stage, Hypothesis{Name: "v32-indexer-rope-interleaved",
			Desc: "RoPE of the " + s.what + " on interleaved pairs (2i, 2i+1), the V3.2-Exp demo code before its 2025-11-17 fix (the current code pairs (i, i+32))",
			run: func(c *Call) (engine.Tensor, error) {
				if !c.Ctx.Cfg.V32() {
					return engine.Tensor{}, errNotV32
				}
				v, err := inF(c, s.from)
				if err != nil {
					return engine.Tensor{}, err
				}
				x := append([]float32(nil), v...)
				indexer.V32RopeFirstInterleaved(x, c.Ctx.Pos, c.Ctx.Rope)
				return like(c, x)
			}})
	}
	add("iw_raw", Hypothesis{Name: "v32-weights-proj-bf16",
		Desc: "weights_proj as a bf16 linear (bf16 out), the V3.2-Exp demo code before 8631a81 (now fp32 on x.float())",
		run: func(c *Call) (engine.Tensor, error) {
			if !c.Ctx.Cfg.V32() || c.Ctx.W.V32 == nil {
				return engine.Tensor{}, errNotV32
			}
			x, err := inF(c, "x")
			if err != nil {
				return engine.Tensor{}, err
			}
			y := make([]float32, c.Ctx.Cfg.IndexNHeads)
			attention.BF16Linear(y, x, c.Ctx.W.V32.IWeightsProj, len(y), c.Ctx.Cfg.Dim)
			return like(c, y)
		}})
	add("kv_fq8", Hypothesis{Name: "v32-latent-bf16",
		Desc: "the latent cached in bf16 without the FP8 round trip, the V3.2-Exp demo code before 8631a81",
		run: func(c *Call) (engine.Tensor, error) {
			if !c.Ctx.Cfg.V32() {
				return engine.Tensor{}, errNotV32
			}
			return copyIn(c, "kv_normed")
		}})
	add("o_latent", Hypothesis{Name: "v32-fp32-scores",
		Desc: "fp32 decode scores and fp32 softmax (P rounded to bf16 after it), the V3.2-Exp demo code before 8631a81 (now bf16 einsums)",
		run: func(c *Call) (engine.Tensor, error) {
			cfg := c.Ctx.Cfg
			if !cfg.V32() {
				return engine.Tensor{}, errNotV32
			}
			qa, err := inF(c, "q_absorbed")
			if err != nil {
				return engine.Tensor{}, err
			}
			qp, err := inF(c, "q_pe")
			if err != nil {
				return engine.Tensor{}, err
			}
			kv, err := inF(c, "latent_cache")
			if err != nil {
				return engine.Tensor{}, err
			}
			sel, ok := c.get("index_topk")
			if !ok || sel.Kind.IsFloat() {
				return engine.Tensor{}, errors.New("needs the integer index_topk")
			}
			H, kc, r := cfg.NHeads, cfg.KVLoraRank, cfg.QKRopeHeadDim
			o := make([]float32, H*kc)
			if err := attention.V32SparseMLAF32(o, qa, qp, kv, H, kc, r, len(kv)/(kc+r), sel.I, cfg.V32SoftmaxScale()); err != nil {
				return engine.Tensor{}, err
			}
			return like(c, o)
		}})
}
