// Package htmlreport draws a replay.Report as one self-contained HTML page.
// It is a view only (it computes nothing the report does not hold): the
// verdict and first-divergence diagnosis, a heatmap of the worst stage
// severity by layer x step, one plot per stage of its metric over the steps,
// and the table of failing and tied stages.
//
// WritePrefix draws a prefixcheck.Report the same way: the verdict and first
// divergence, the correct cache's configuration, and every request that is
// not a plain agreement with its reuse (correct cache and engine) as bars.
//
// Write renders the page; the images are inline SVG data URIs (gonum/plot),
// so the file needs nothing else and loads nothing from the network. The same
// report gives the same bytes (cmd/sparsemla TestDeterministicOutput,
// TestGoldenOutput).
package htmlreport
