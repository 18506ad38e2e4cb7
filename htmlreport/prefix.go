package htmlreport

import (
	"html/template"
	"io"

	"sparsemla/prefixcheck"
)

const prefixTemplate = `<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>sparsemla prefix: {{.R.Input}}</title>
<style>
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
h1{font-size:1.4em} .verdict{font-size:1.2em;padding:.5em;border-radius:4px}
.agree{background:#e4f6e4} .diverged{background:#fbe3e3} .warn{background:#fff6d6} .unchecked,.incomplete{background:#eee}
table{border-collapse:collapse;font-size:.85em} td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}
code{background:#f3f3f3;padding:1px 3px}
.bar{height:6px;margin:1px 0} .truth{background:#4a7ebb} .engine{background:#d9822b}
</style></head><body>
<h1>sparsemla prefix: {{.R.Input}}</h1>
<p>format <b>{{.R.Format}}</b>, schema <code>{{.R.Schema}}</code>. Correct cache: page {{.R.Cache.PageSize}},
window {{.R.Cache.Window}}, compress ratios {{.R.Cache.Ratios}}, evictions <b>{{.R.Cache.Evictions}}</b>{{if .R.Cache.Capacity}}
(capacity {{.R.Cache.Capacity}} tokens, LRU){{end}}, hits {{.R.Cache.Hits}}{{if .R.Cache.ResumeAtEndOnly}}, state kept at request ends only{{end}}.</p>
<p>{{.R.Summary.Requests}} requests: {{.R.Summary.Agree}} agree, {{.R.Summary.Warn}} warn, {{.R.Summary.Diverged}} diverged,
{{.R.Summary.Unchecked}} unchecked. Reused tokens: engine {{.R.Summary.RecordedTokens}}, correct cache {{.R.Summary.TruthTokens}};
{{.R.Summary.AlignmentLoss}} shared tokens in {{.R.Summary.AlignmentReqs}} requests fall inside a page.</p>
{{if .R.First}}<div class="verdict diverged"><b>first divergence: request {{.R.First.ID}} (#{{.R.First.Index}}): {{.R.First.Kind}}</b>
<p>{{.R.First.Detail}}</p><p>correct cache: {{.R.First.Truth.Text}}<br>engine: {{.R.First.Recorded.Text}}</p></div>
{{else}}<div class="verdict {{.R.Verdict}}"><b>{{.R.Verdict}}</b>{{if eq .R.Verdict "agree"}}: every request was judged, and every decision is the correct cache's{{else}}: {{.R.Summary.Unchecked}} of {{.R.Summary.Requests}} requests could not be judged (unchecked), no judged decision is wrong{{end}}</div>{{end}}
<h2>Requests that are not plain agreements</h2>
<p>Bars: reused tokens of the request's known tokens, <span style="color:#4a7ebb">correct cache</span> and <span style="color:#d9822b">engine</span>.{{if .Cut}} The first {{len .Rows}} are listed (the JSON report lists all).{{end}}</p>
<table><tr><th>#</th><th>request</th><th>status</th><th>kind</th><th>reuse</th><th>detail</th><th>correct cache</th><th>engine</th></tr>
{{range .Rows}}<tr class="{{.Status}}"><td>{{.Index}}</td><td><code>{{.ID}}</code>{{if .Namespace}}<br>{{.Namespace}}{{end}}</td><td>{{.Status}}</td><td>{{.Kind}}{{if .Cause}} ({{.Cause}}){{end}}</td>
<td style="width:90px"><div class="bar truth" style="width:{{.TruthPct}}%"></div><div class="bar engine" style="width:{{.EnginePct}}%"></div></td>
<td>{{.Detail}}</td><td>{{.Truth}}</td><td>{{.Engine}}</td></tr>{{end}}
</table>
{{if .R.Notes}}<h2>Notes</h2><ul>{{range .R.Notes}}<li>{{.}}</li>{{end}}</ul>{{end}}
</body></html>
`

type prefixRow struct {
	prefixcheck.Result
	TruthPct, EnginePct int
	Truth, Engine       string
}

// maxPrefixRows bounds the requests the page lists.
const maxPrefixRows = 2000

// WritePrefix writes a self-contained HTML page of a prefix-cache check
// report: the verdict and first divergence, the correct cache's
// configuration, and every request that is not a plain agreement with its
// reuse (correct cache and engine) as bars.
func WritePrefix(w io.Writer, r *prefixcheck.Report) error {
	var rows []prefixRow
	cut := false
	for _, q := range r.Requests {
		if q.Status == prefixcheck.StatusAgree && q.Kind == "" {
			continue
		}
		if len(rows) == maxPrefixRows {
			cut = true
			break
		}
		row := prefixRow{Result: q, Truth: q.Truth.Text(), Engine: q.Recorded.Text()}
		if q.Tokens > 0 {
			if q.Truth != nil {
				row.TruthPct = min(100, 100*q.Truth.Tokens/q.Tokens)
			}
			if q.Recorded != nil {
				row.EnginePct = min(100, 100*q.Recorded.Tokens/q.Tokens)
			}
		}
		if q.Status == prefixcheck.StatusUnchecked {
			row.Truth, row.Engine = "", ""
		}
		rows = append(rows, row)
	}
	t := template.Must(template.New("prefix").Parse(prefixTemplate))
	return t.Execute(w, struct {
		R    *prefixcheck.Report
		Rows []prefixRow
		Cut  bool
	}{r, rows, cut})
}
