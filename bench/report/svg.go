package report

import (
	"errors"
	"fmt"
	"html"
	"io"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Chart is a group of metrics drawn as one grouped bar chart: one group of
// bars per metric, one bar per path.
type Chart struct {
	// Title is the metrics' Chart field; Unit their shared unit.
	Title, Unit string
	// File is the SVG file name, derived from Title.
	File    string
	Metrics []*Metric
}

// Charts groups r's metrics by their Chart field, in order of first
// appearance. A metric whose unit differs from its chart's first metric
// is an error.
func Charts(r *Result) ([]Chart, error) {
	var out []Chart
	index := map[string]int{}
	for i := range r.Metrics {
		m := &r.Metrics[i]
		if m.Chart == "" {
			continue
		}
		j, ok := index[m.Chart]
		if !ok {
			j = len(out)
			index[m.Chart] = j
			out = append(out, Chart{Title: m.Chart, Unit: m.Unit, File: slug(m.Chart) + ".svg"})
		}
		if out[j].Unit != m.Unit {
			return nil, fmt.Errorf("report: chart %q: metric %s is in %s, the chart in %s", m.Chart, m.ID, m.Unit, out[j].Unit)
		}
		out[j].Metrics = append(out[j].Metrics, m)
	}
	return out, nil
}

// slug turns a title into a file name stem: lowercase letters and digits,
// other runs of characters as one '-'.
func slug(s string) string {
	var b strings.Builder
	dash := false
	for _, r := range strings.ToLower(s) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			if dash && b.Len() > 0 {
				b.WriteByte('-')
			}
			b.WriteRune(r)
			dash = false
		} else {
			dash = true
		}
	}
	if b.Len() == 0 {
		return "chart"
	}
	return b.String()
}

// palette colours the paths that are not peers, in order; the peers take
// peerPalette's warm colours, in order.
var (
	palette     = []string{"#6b6b6b", "#4e79a7", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948"}
	peerPalette = []string{"#f28e2b", "#9c755f", "#ff9da7", "#bab0ac"}
)

// colours returns the colour of each of paths.
func colours(paths []Path) []string {
	out := make([]string, len(paths))
	ours, peers := 0, 0
	for i, p := range paths {
		if p.Peer {
			out[i] = peerPalette[peers%len(peerPalette)]
			peers++
		} else {
			out[i] = palette[ours%len(palette)]
			ours++
		}
	}
	return out
}

// Chart geometry, in SVG user units (pixels).
const (
	barW      = 34
	groupGap  = 30
	marginL   = 72
	marginR   = 24
	marginTop = 56
	plotH     = 240
	marginBot = 96
	// legendLine is the height of a line of the legend, which starts 48
	// below the plot: two lines fit in the bottom margin.
	legendLine = 18
)

// WriteSVG draws chart c of r: bars at each path's median, a whisker from
// minimum to maximum, the median written above each bar.
func WriteSVG(w io.Writer, r *Result, c Chart) error {
	paths := r.Paths
	cols := colours(paths)
	groupW := len(paths)*barW + groupGap
	width := max(marginL+len(c.Metrics)*groupW+marginR, 480)
	height := marginTop + plotH + marginBot
	top := 0.0
	for _, m := range c.Metrics {
		for _, v := range m.Values {
			if v.N > 0 {
				top = max(top, v.Max, v.Median)
			}
		}
	}
	step := niceCeil(top / 5)
	ymax := step * math.Ceil(top/step*(1-1e-9))
	if ymax <= 0 {
		ymax = step
	}
	y := func(v float64) float64 { return marginTop + plotH - v/ymax*plotH }

	var b strings.Builder
	esc := html.EscapeString
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="11">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	better := ""
	if len(c.Metrics) > 0 {
		better = string(c.Metrics[0].Better) + " is better"
	}
	fmt.Fprintf(&b, `<text x="%d" y="22" font-size="15" font-weight="bold">%s</text>`+"\n", marginL, esc(c.Title))
	fmt.Fprintf(&b, `<text x="%d" y="40" fill="#555">%s · median of %d repetition(s), whiskers min–max · %s</text>`+"\n",
		marginL, esc(c.Unit), r.Repetitions, esc(better))
	// Axis and grid.
	for i := 0; float64(i)*step <= ymax*(1+1e-9); i++ {
		v := float64(i) * step
		yy := y(v)
		fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#e4e4e4"/>`+"\n", marginL, width-marginR, yy, yy)
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end" fill="#555">%s</text>`+"\n", marginL-6, yy+4, strconv.FormatFloat(v, 'g', 6, 64))
	}
	fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#333"/>`+"\n", marginL, width-marginR, y(0), y(0))
	for gi, m := range c.Metrics {
		x0 := marginL + gi*groupW + groupGap/2
		for pi, p := range paths {
			x := float64(x0 + pi*barW)
			colour := cols[pi]
			v, ok := m.Values[p.Name]
			if !ok || v.N == 0 {
				fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" fill="#999">n/a</text>`+"\n", x+barW/2, y(0)-4)
				continue
			}
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%d" height="%.1f" fill="%s"><title>%s %s: %s %s (%s–%s)</title></rect>`+"\n",
				x+2, y(v.Median), barW-4, y(0)-y(v.Median), colour,
				esc(p.Name), esc(m.Title), esc(Num(v.Median)), esc(m.Unit), esc(Num(v.Min)), esc(Num(v.Max)))
			if v.N > 1 && v.Max > v.Min {
				cx := x + barW/2
				fmt.Fprintf(&b, `<path d="M%.1f %.1fV%.1fM%.1f %.1fh8M%.1f %.1fh8" stroke="#222" fill="none"/>`+"\n",
					cx, y(v.Min), y(v.Max), cx-4, y(v.Min), cx-4, y(v.Max))
			}
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="9">%s</text>`+"\n",
				x+barW/2, min(y(v.Median), y(v.Max))-4, esc(Num(v.Median)))
		}
		label := m.Label
		if label == "" {
			label = m.Title
		}
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="middle">%s</text>`+"\n",
			x0+len(paths)*barW/2, y(0)+18, esc(label))
	}
	// Legend.
	lx, ly := marginL, marginTop+plotH+48
	for pi, p := range paths {
		colour := cols[pi]
		w := 30 + 7*utf8.RuneCountInString(p.Name)
		if lx > marginL && lx+w > width-marginR {
			lx, ly = marginL, ly+legendLine // wrap onto a new line
		}
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s</text>`+"\n",
			lx, ly, colour, lx+16, ly+10, esc(p.Name))
		lx += w
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// niceCeil rounds v up to 1, 2, 2.5 or 5 times a power of ten; 1 for v ≤ 0.
func niceCeil(v float64) float64 {
	if v <= 0 || math.IsNaN(v) || math.IsInf(v, 0) {
		return 1
	}
	e := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*e >= v*(1-1e-12) {
			return m * e
		}
	}
	return 10 * e
}

// WriteCharts writes every chart of r as an SVG file into dir (created if
// needed), and index.html showing them all with the table, and returns
// the paths written.
func WriteCharts(dir string, r *Result) ([]string, error) {
	charts, err := Charts(r)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("report: charts: %w", err)
	}
	var written []string
	write := func(name string, fill func(io.Writer) error) error {
		p := filepath.Join(dir, name)
		f, err := os.Create(p)
		if err != nil {
			return fmt.Errorf("report: %w", err)
		}
		err = errors.Join(fill(f), f.Close())
		if err != nil {
			return fmt.Errorf("report: write %s: %w", p, err)
		}
		written = append(written, p)
		return nil
	}
	for _, c := range charts {
		if err := write(c.File, func(w io.Writer) error { return WriteSVG(w, r, c) }); err != nil {
			return written, err
		}
	}
	err = write("index.html", func(w io.Writer) error {
		var b strings.Builder
		b.WriteString("<!doctype html>\n<meta charset=\"utf-8\">\n<title>meshtun bench</title>\n")
		fmt.Fprintf(&b, "<h1>meshtun bench</h1>\n<p>%s · %s · %d repetition(s) · %.0f s</p>\n",
			html.EscapeString(r.Started.Format("2006-01-02 15:04:05 MST")), html.EscapeString(r.Command), r.Repetitions, r.Seconds)
		b.WriteString("<pre>")
		var t strings.Builder
		if err := WriteTable(&t, r); err != nil {
			return err
		}
		b.WriteString(html.EscapeString(t.String()))
		b.WriteString("</pre>\n")
		for _, c := range charts {
			fmt.Fprintf(&b, "<p><img src=\"%s\" alt=\"%s\"></p>\n", html.EscapeString(c.File), html.EscapeString(c.Title))
		}
		_, err := io.WriteString(w, b.String())
		return err
	})
	return written, err
}
