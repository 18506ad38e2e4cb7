package attribute

import (
	"fmt"
	"slices"
	"strings"

	"sparsemla/attention"
	"sparsemla/engine"
)

// ---- RoPE ----

// ropeHypotheses runs the stage with each known wrong RoPE table (built
// only over the positions a decode step reads), and with the NeoX pairing.
func ropeHypotheses(stage string) []Hypothesis {
	var out []Hypothesis
	// The table hypotheses depend on the layer; they are built at run time
	// under one name per kind of table.
	for _, kind := range ropeKinds {
		out = append(out, Hypothesis{Name: "rope-table: " + kind.name, Desc: "RoPE with a wrong table: " + kind.name,
			run: func(c *Call) (engine.Tensor, error) {
				h, ok := ropeTableHypothesis(c, kind)
				if !ok {
					return engine.Tensor{}, fmt.Errorf("no %q table differs from the reference's for this layer", kind.name)
				}
				T := int(c.Ctx.Pos) + 2
				return withCtx(c, func(ctx *engine.StepContext) error {
					ctx.Rope = attention.NewRopeTableFreqs(h.Freqs, T, h.Name)
					return nil
				})
			}})
	}
	out = append(out, Hypothesis{Name: "rope-neox", Desc: "RoPE pairs (i, i+32) (rotate_half, GPT-NeoX) instead of interleaved (2i, 2i+1)",
		run: func(c *Call) (engine.Tensor, error) { return ropeNeoX(c, stage) }})
	return out
}

// ropeKinds name the tables of attention.RopeHypotheses tried at a RoPE
// stage: exact names, or name prefixes (prefix true) for the entries whose
// name carries the config's own value.
var ropeKinds = func() []ropeKind {
	k := []ropeKind{{"bf16 inv_freq", false}, {"no YaRN", false}, {"linear interpolation", true}}
	for _, f := range []string{"4", "8", "16", "32", "40"} {
		k = append(k, ropeKind{"YaRN with rope_factor " + f, false})
	}
	for _, L := range []string{"4096", "8192", "32768", "65536", "163840"} {
		k = append(k, ropeKind{"YaRN with original_seq_len " + L, false})
	}
	return append(k, ropeKind{"YaRN applied", true}, ropeKind{"base", true})
}()

type ropeKind struct {
	name   string
	prefix bool
}

// ropeTableHypothesis is the hypothesis of the layer's list named kind.
func ropeTableHypothesis(c *Call, kind ropeKind) (attention.RopeHypothesis, bool) {
	cfg := c.Ctx.Cfg
	p := cfg.RopeParams(c.Ctx.Layer)
	other := cfg.RopeTheta
	if cfg.Ratio(c.Ctx.Layer) == 0 {
		other = cfg.CompressRopeTheta
	}
	yarn := attention.RopeParams{Base: cfg.CompressRopeTheta, OriginalSeqLen: cfg.OriginalSeqLen, Factor: cfg.RopeFactor, BetaFast: cfg.BetaFast, BetaSlow: cfg.BetaSlow}
	for _, h := range attention.RopeHypotheses(p, other, yarn) {
		if h.Name == kind.name || (kind.prefix && strings.HasPrefix(h.Name, kind.name)) {
			return h, true
		}
	}
	return attention.RopeHypothesis{}, false
}

func ropePosition(stage string, off int64) Hypothesis {
	return Hypothesis{Name: fmt.Sprintf("rope-position p%+d", off), Desc: fmt.Sprintf("RoPE at position p%+d instead of p", off),
		run: func(c *Call) (engine.Tensor, error) {
			return withCtx(c, func(ctx *engine.StepContext) error {
				ctx.Pos += off
				if ctx.Pos < 0 || ctx.Pos >= int64(ctx.Rope.T) {
					return fmt.Errorf("position %d outside the RoPE table", ctx.Pos)
				}
				return nil
			})
		}}
}

// ropeNeoX recomputes the stage's rotation with the NeoX pairing.
func ropeNeoX(c *Call, stage string) (engine.Tensor, error) {
	cfg, ctx := c.Ctx.Cfg, c.Ctx
	rot := func(v []float32, d int, pos int64, inverse bool) {
		for h := 0; h < len(v)/d; h++ {
			ctx.Rope.ApplyRopeHalf(v[h*d+d-attention.RopeDims:(h+1)*d], pos, inverse)
		}
	}
	switch stage {
	case "kv_roped":
		v, err := inF(c, "kv_normed")
		if err != nil {
			return engine.Tensor{}, err
		}
		y := slices.Clone(v)
		rot(y, cfg.HeadDim, ctx.Pos, false)
		return like(c, y)
	case "iq_roped":
		v, err := inF(c, "iq_b")
		if err != nil {
			return engine.Tensor{}, err
		}
		y := slices.Clone(v)
		rot(y, cfg.IndexHeadDim, ctx.Pos, false)
		return like(c, y)
	case "o_inv":
		v, err := inF(c, "o")
		if err != nil {
			return engine.Tensor{}, err
		}
		y := slices.Clone(v)
		rot(y, cfg.HeadDim, ctx.Pos, true)
		return like(c, y)
	case "q":
		// The nope part is the reference's (from the stage itself); only the
		// rotation of q_pe_prerope changes.
		pe, err := inF(c, "q_pe_prerope")
		if err != nil {
			return engine.Tensor{}, err
		}
		y := slices.Clone(c.Ref.F)
		H, D, rd := cfg.NHeads, cfg.HeadDim, cfg.RopeHeadDim
		for h := 0; h < H; h++ {
			dst := y[h*D+D-rd : (h+1)*D]
			copy(dst, pe[h*rd:(h+1)*rd])
			ctx.Rope.ApplyRopeHalf(dst, ctx.Pos, false)
		}
		return like(c, y)
	case "cmp_roped", "icmp_roped":
		p := strings.TrimSuffix(stage, "roped")
		cm := compressor(c, p == "icmp_")
		v, err := inF(c, p+"normed")
		if err != nil || cm == nil {
			return engine.Tensor{}, fmt.Errorf("needs %snormed and the compressor", p)
		}
		y := slices.Clone(v)
		j := int64(attention.EmittedRow(ctx.Pos, cm.Ratio))
		ctx.Rope.ApplyRopeHalf(y[len(y)-attention.RopeDims:], j*int64(cm.Ratio), false)
		return like(c, y)
	}
	return engine.Tensor{}, fmt.Errorf("no NeoX form for stage %s", stage)
}

func cmpRopePos(p string, idx bool, what string, pos func(j, r, p int64) int64) Hypothesis {
	return Hypothesis{Name: "rope-row-position: " + strings.Fields(what)[1], Desc: "the compressed row rotated at " + what,
		run: func(c *Call) (engine.Tensor, error) {
			cm := compressor(c, idx)
			if cm == nil {
				return engine.Tensor{}, fmt.Errorf("no compressor in this layer")
			}
			v, err := inF(c, p+"normed")
			if err != nil {
				return engine.Tensor{}, err
			}
			r := int64(cm.Ratio)
			j := int64(attention.EmittedRow(c.Ctx.Pos, cm.Ratio))
			at := pos(j, r, c.Ctx.Pos)
			if at < 0 || at >= int64(c.Ctx.Rope.T) {
				return engine.Tensor{}, fmt.Errorf("position %d outside the RoPE table", at)
			}
			y := slices.Clone(v)
			c.Ctx.Rope.ApplyRope(y[len(y)-attention.RopeDims:], at, false)
			return like(c, y)
		}}
}
