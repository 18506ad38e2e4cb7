package htmlreport

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"html/template"
	"image/color"
	"io"
	"math"
	"sort"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/palette/moreland"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"

	"sparsemla/replay"
)

// severityGrid is the heatmap data: worst stage severity per (layer, step).
type severityGrid struct {
	steps  []int64
	layers []int
	v      [][]float64 // [layer][step]
}

func (g severityGrid) Dims() (c, r int)   { return len(g.steps), len(g.layers) }
func (g severityGrid) Z(c, r int) float64 { return g.v[r][c] }
func (g severityGrid) X(c int) float64    { return float64(c) }
func (g severityGrid) Y(r int) float64    { return float64(r) }

func grid(r *replay.Report) severityGrid {
	g := severityGrid{steps: r.Steps, layers: r.Layers}
	si := map[int64]int{}
	for i, s := range r.Steps {
		si[s] = i
	}
	li := map[int]int{}
	for i, l := range r.Layers {
		li[l] = i
	}
	g.v = make([][]float64, len(r.Layers))
	for i := range g.v {
		g.v[i] = make([]float64, len(r.Steps))
	}
	for _, s := range r.Results {
		a, ok1 := li[s.Layer]
		b, ok2 := si[s.Step]
		if ok1 && ok2 {
			g.v[a][b] = math.Max(g.v[a][b], s.Severity)
		}
	}
	return g
}

// indexTicks labels grid columns/rows with their step or layer numbers.
type indexTicks []string

func (t indexTicks) Ticks(min, max float64) []plot.Tick {
	var out []plot.Tick
	step := 1
	if len(t) > 16 {
		step = (len(t) + 15) / 16
	}
	for i := 0; i < len(t); i += step {
		out = append(out, plot.Tick{Value: float64(i), Label: t[i]})
	}
	return out
}

// plotPNG switches the inline images from SVG to PNG (tests render PNGs to
// look at them).
var plotPNG = false

func svgDataURI(p *plot.Plot, w, h vg.Length) (template.URL, error) {
	var buf bytes.Buffer
	mime := "image/svg+xml"
	if plotPNG {
		c := vgimg.PngCanvas{Canvas: vgimg.New(w, h)}
		p.Draw(draw.New(c))
		if _, err := c.WriteTo(&buf); err != nil {
			return "", err
		}
		mime = "image/png"
	} else {
		c := vgsvg.New(w, h)
		p.Draw(draw.New(c))
		if _, err := c.WriteTo(&buf); err != nil {
			return "", err
		}
	}
	return template.URL("data:" + mime + ";base64," + base64.StdEncoding.EncodeToString(buf.Bytes())), nil
}

// heatmapPlot draws the worst severity per (layer, step).
func heatmapPlot(r *replay.Report) (template.URL, error) {
	g := grid(r)
	if len(g.steps) == 0 || len(g.layers) == 0 {
		return "", nil
	}
	pal := moreland.SmoothBlueRed()
	pal.SetMin(0)
	pal.SetMax(2)
	hm := plotter.NewHeatMap(g, pal.Palette(64))
	hm.Min, hm.Max = 0, 2
	p := plot.New()
	p.Title.Text = "worst stage severity (0 identical, 1 = tolerance, 2 = far out)"
	p.X.Label.Text = "decode step"
	p.Y.Label.Text = "layer"
	var xs, ys indexTicks
	for _, s := range g.steps {
		xs = append(xs, fmt.Sprint(s))
	}
	for _, l := range g.layers {
		ys = append(ys, fmt.Sprint(l))
	}
	p.X.Tick.Marker = xs
	p.Y.Tick.Marker = ys
	p.Add(hm)
	return svgDataURI(p, 16*vg.Centimeter, 9*vg.Centimeter)
}

// stagePlot draws one stage's metric over the steps, one line per layer.
func stagePlot(r *replay.Report, stage string) (template.URL, string, error) {
	metric := "severity"
	val := func(s replay.StageResult) float64 { return s.Severity }
	for _, s := range r.Results {
		if s.Stage == stage && s.Metrics != nil {
			switch s.Tol {
			case string(replay.TolULP):
				metric = "max bf16 ulps"
				val = func(s replay.StageResult) float64 {
					if s.Metrics == nil {
						return math.NaN()
					}
					return float64(s.Metrics.MaxULP)
				}
			case string(replay.TolClose):
				metric = "cos_diff"
				val = func(s replay.StageResult) float64 {
					if s.Metrics == nil {
						return math.NaN()
					}
					return s.Metrics.CosDiff
				}
			case string(replay.TolExact):
				metric = "values differing"
				val = func(s replay.StageResult) float64 {
					if s.Metrics == nil {
						return math.NaN()
					}
					return float64(s.Metrics.Mismatch)
				}
			}
			break
		}
	}
	p := plot.New()
	p.Title.Text = stage
	p.X.Label.Text = "decode step"
	p.Y.Label.Text = metric
	lines := map[int]plotter.XYs{}
	for _, s := range r.Results {
		if s.Stage != stage || (s.Status != replay.StatusPass && s.Status != replay.StatusFail && s.Status != replay.StatusTie) {
			continue
		}
		v := val(s)
		if math.IsNaN(v) {
			continue
		}
		lines[s.Layer] = append(lines[s.Layer], plotter.XY{X: float64(s.Step), Y: v})
	}
	if len(lines) == 0 {
		return "", metric, nil
	}
	var ls []int
	for l := range lines {
		ls = append(ls, l)
	}
	sort.Ints(ls)
	for i, l := range ls {
		ln, err := plotter.NewLine(lines[l])
		if err != nil {
			return "", metric, err
		}
		ln.Color = plotColor(i)
		ln.Width = vg.Points(1.5)
		p.Add(ln)
		p.Legend.Add(fmt.Sprintf("layer %d", l), ln)
	}
	p.Legend.Top = true
	u, err := svgDataURI(p, 10*vg.Centimeter, 6*vg.Centimeter)
	return u, metric, err
}

func plotColor(i int) color.Color {
	cols := []color.Color{
		color.RGBA{0x1f, 0x77, 0xb4, 0xff}, color.RGBA{0xd6, 0x27, 0x28, 0xff},
		color.RGBA{0x2c, 0xa0, 0x2c, 0xff}, color.RGBA{0xff, 0x7f, 0x0e, 0xff},
		color.RGBA{0x94, 0x67, 0xbd, 0xff}, color.RGBA{0x8c, 0x56, 0x4b, 0xff},
	}
	return cols[i%len(cols)]
}

const htmlTemplate = `<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>sparsemla report: {{.R.Dump}}</title>
<style>
body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
h1{font-size:1.4em} .verdict{font-size:1.2em;padding:.5em;border-radius:4px}
.agree{background:#e4f6e4} .diverged{background:#fbe3e3} .incomplete{background:#fff6d6}
table{border-collapse:collapse;font-size:.85em} td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}
.fail{background:#fbe3e3} .tie{background:#fff6d6} .plots img{margin:4px}
code{background:#f3f3f3;padding:1px 3px}
</style></head><body>
<h1>sparsemla {{.R.Command}}: {{.R.Dump}}</h1>{{if .R.Model}}
<p>model: <b>{{.R.Model}}</b> (detected from the dump's config)</p>{{end}}
<p>mode <b>{{.R.Mode}}</b>, {{.StepsXLayers}}, schema <code>{{.R.Schema}}</code>,
GPU RoPE table: {{.R.GPURope}}. Stages compared {{.R.Summary.Compared}}: {{.R.Summary.Pass}} pass,
{{.R.Summary.Tie}} tie, {{.R.Summary.Fail}} fail; {{.R.Summary.Missing}} not dumped, {{.R.Summary.Skipped}} skipped.</p>
{{if .R.First}}<div class="verdict diverged"><b>{{.R.First.Text}}</b>
{{if .R.First.Detail}}<ul>{{range .R.First.Detail}}<li>{{.}}</li>{{end}}</ul>{{end}}
{{if .R.First.Hint}}<p><i>hint:</i> {{.R.First.Hint}}</p>{{end}}
<p>inputs: {{range .R.First.Inputs}}<code>{{.Name}}</code> ({{.From}}, {{.Status}}) {{end}}</p></div>
{{else if .R.Incomplete}}<div class="verdict incomplete"><b>{{.R.VerdictLine}}</b></div>
{{else}}<div class="verdict agree"><b>{{.R.VerdictLine}}</b></div>{{end}}
{{if .R.TolOverrides}}<p>tolerances overridden (--tol-stage, --tol): {{range $i, $s := .R.TolOverrides}}{{if $i}}; {{end}}<code>{{$s}}</code>{{end}}{{if .R.TolUnused}}; {{range $i, $s := .R.TolUnused}}{{if $i}}, {{end}}<code>{{$s}}</code>{{end}}: no such stage compared here, so not applied{{end}}</p>{{end}}{{range .R.CoverageLines}}<p>{{.}}</p>{{end}}
{{if .Heat}}<h2>Error by layer x step</h2><img src="{{.Heat}}" alt="heatmap">
<p>Colour: the worst stage severity of the (step, layer): 0 (blue) bit-identical, below 1 within tolerance, 1 and above (red) out of tolerance.</p>{{end}}
<h2>Stages</h2>
<table><tr><th>stage</th><th>tol</th><th>compared</th><th>fail</th><th>tie</th><th>worst severity</th><th>at</th></tr>
{{range .Sums}}<tr{{if .Fail}} class="fail"{{else if .Tie}} class="tie"{{end}}><td>{{.Stage}}</td><td>{{.Tol}}</td><td>{{.Compared}}</td><td>{{.Fail}}</td><td>{{.Tie}}</td><td>{{printf "%.3g" .Worst}}</td><td>{{.WorstAt}}</td></tr>{{end}}
</table>
<h2>Per-stage metrics over the steps</h2>
{{if .Identical}}<p>Bit-identical at every step and layer: {{range $i, $s := .Identical}}{{if $i}}, {{end}}<code>{{$s}}</code>{{end}}.</p>{{end}}
<div class="plots">{{range .Plots}}<img src="{{.}}" alt="stage plot">{{end}}</div>
<h2>Out-of-tolerance and tied stages</h2>
<table><tr><th>step</th><th>layer</th><th>stage</th><th>status</th><th>tol</th><th>reason</th></tr>
{{range .Bad}}<tr class="{{.Status}}"><td>{{.Step}}</td><td>{{.Layer}}</td><td>{{.Stage}}</td><td>{{.Status}}</td><td>{{.Tol}}</td><td>{{.Reason}}</td></tr>{{end}}
</table>
</body></html>
`

// Write writes a self-contained HTML page of the replay report r: the verdict and diagnosis, a
// heatmap of the worst stage severity by layer x step, one plot per stage of
// its metric over the steps, and the table of failing and tied stages. Images
// are inline SVG data URIs, so the file needs nothing else.
func Write(w io.Writer, r *replay.Report) error {
	heat, err := heatmapPlot(r)
	if err != nil {
		return err
	}
	sums := stageSummaries(r)
	var plots []template.URL
	var identical []string
	for _, ss := range sums {
		if ss.Worst == 0 {
			identical = append(identical, ss.Stage)
			continue
		}
		if !ss.hasMetrics {
			continue
		}
		u, _, err := stagePlot(r, ss.Stage)
		if err != nil {
			return err
		}
		if u != "" {
			plots = append(plots, u)
		}
	}
	var bad []replay.StageResult
	for _, s := range r.Results {
		if s.Status == replay.StatusFail || s.Status == replay.StatusTie {
			bad = append(bad, s)
			if len(bad) >= 200 {
				break
			}
		}
	}
	t := template.Must(template.New("report").Parse(htmlTemplate))
	return t.Execute(w, struct {
		R         *replay.Report
		Heat      template.URL
		Plots     []template.URL
		Bad       []replay.StageResult
		Sums      []stageSummary
		Identical []string
		// StepsXLayers: "4 steps x 4 layers", "1 step x 4 layers".
		StepsXLayers string
	}{r, heat, plots, bad, sums, identical, replay.StepsXLayers(len(r.Steps), len(r.Layers))})
}

// stageSummary is one row of the report's per-stage table.
type stageSummary struct {
	Stage      string
	Tol        string
	Compared   int
	Fail, Tie  int
	Worst      float64 // largest severity
	WorstAt    string  // "step P layer L"
	hasMetrics bool
}

// stageSummaries lists the stages in first-seen (replay) order, worst first.
func stageSummaries(r *replay.Report) []stageSummary {
	idx := map[string]int{}
	var out []stageSummary
	for _, s := range r.Results {
		if s.Status != replay.StatusPass && s.Status != replay.StatusFail && s.Status != replay.StatusTie {
			continue
		}
		i, ok := idx[s.Stage]
		if !ok {
			i = len(out)
			idx[s.Stage] = i
			out = append(out, stageSummary{Stage: s.Stage, Tol: s.Tol})
		}
		ss := &out[i]
		ss.Compared++
		ss.hasMetrics = ss.hasMetrics || s.Metrics != nil
		switch s.Status {
		case replay.StatusFail:
			ss.Fail++
		case replay.StatusTie:
			ss.Tie++
		}
		if s.Severity > ss.Worst || ss.WorstAt == "" {
			if s.Severity > ss.Worst {
				ss.Worst = s.Severity
			}
			ss.WorstAt = fmt.Sprintf("step %d layer %d", s.Step, s.Layer)
		}
	}
	sort.SliceStable(out, func(a, b int) bool { return out[a].Worst > out[b].Worst })
	return out
}
