package report

import (
	"fmt"
	"io"
	"math"
	"strings"
	"unicode/utf8"
)

// WriteTable writes r as a text table: one row per metric with each path's
// median and (min–max) range, and under it each path's ratio to the
// baseline, then the ratio of each path that is not a peer to each peer
// (value ÷ reference; for latencies the added time too; none for
// percentages such as loss, whose ratios mean nothing). A variant path (the B of an A/B comparison) also gets its
// ratio to its A path, on a row of its own. Paths are columns, in r.Paths
// order.
func WriteTable(w io.Writer, r *Result) error {
	peers := r.Peers()
	isPeer := map[string]bool{}
	for _, p := range peers {
		isPeer[p] = true
	}
	header := []string{"metric"}
	for _, p := range r.Paths {
		header = append(header, p.Name)
	}
	rows := [][]string{header}
	for i := range r.Metrics {
		m := &r.Metrics[i]
		row := []string{m.Title + " [" + m.Unit + "]"}
		for _, p := range r.Paths {
			row = append(row, cell(m.Values[p.Name]))
		}
		rows = append(rows, row)
		for _, ref := range append([]string{r.Baseline}, peers...) {
			if ref == "" || m.Unit == "%" {
				continue
			}
			row := []string{"  vs " + ref}
			any := false
			for _, p := range r.Paths {
				s := ""
				// Peers are compared with the baseline, not with
				// one another.
				if p.Name != ref && (!isPeer[ref] || !p.Peer) {
					s = ratioCell(m, p.Name, ref)
				}
				any = any || s != ""
				row = append(row, s)
			}
			if any {
				rows = append(rows, row)
			}
		}
		if m.Unit != "%" && hasVariants(r) {
			row := []string{"  B vs A"}
			any := false
			for _, p := range r.Paths {
				s := ""
				if p.VariantOf != "" {
					s = ratioCell(m, p.Name, p.VariantOf)
				}
				any = any || s != ""
				row = append(row, s)
			}
			if any {
				rows = append(rows, row)
			}
		}
	}
	widths := make([]int, len(header))
	for _, row := range rows {
		for i, c := range row {
			widths[i] = max(widths[i], utf8.RuneCountInString(c))
		}
	}
	var b strings.Builder
	for n, row := range rows {
		for i, c := range row {
			if i > 0 {
				b.WriteString("  ")
			}
			b.WriteString(c)
			if i < len(row)-1 {
				b.WriteString(strings.Repeat(" ", widths[i]-utf8.RuneCountInString(c)))
			}
		}
		b.WriteString("\n")
		if n == 0 {
			total := len(widths) - 1
			for _, wd := range widths {
				total += wd + 1
			}
			b.WriteString(strings.Repeat("─", total) + "\n")
		}
	}
	b.WriteString("cells: median (min–max) of the repetitions; “vs X”: ×median÷X's median")
	b.WriteString(", and for latencies the time added over X\n")
	if hasVariants(r) {
		b.WriteString("B paths (·): " + r.Variant + "; “B vs A”: each B path against the same path of A\n")
	}
	if len(r.Limits) > 0 {
		fmt.Fprintf(&b, "\n%d measurement(s) beyond a peer's own limits (not taken):\n", len(r.Limits))
		for _, e := range r.Limits {
			b.WriteString("  " + e + "\n")
		}
	}
	if len(r.Errors) > 0 {
		fmt.Fprintf(&b, "\n%d measurement(s) failed:\n", len(r.Errors))
		for _, e := range r.Errors {
			b.WriteString("  " + e + "\n")
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// hasVariants reports whether r holds an A/B comparison.
func hasVariants(r *Result) bool {
	for _, p := range r.Paths {
		if p.VariantOf != "" {
			return true
		}
	}
	return false
}

// cell formats a value as "median (min–max)", or "—" if there is none.
func cell(v Value) string {
	if v.N == 0 {
		return "—"
	}
	if v.N == 1 || v.Min == v.Max {
		return Num(v.Median)
	}
	return fmt.Sprintf("%s (%s–%s)", Num(v.Median), Num(v.Min), Num(v.Max))
}

// ratioCell formats path's ratio to ref for m: "×0.42", with "+35µs"
// before it for latencies.
func ratioCell(m *Metric, path, ref string) string {
	x, ok := m.Ratio(path, ref)
	if !ok {
		return ""
	}
	s := "×" + Num(x)
	if m.Unit == "µs" {
		d := m.Values[path].Median - m.Values[ref].Median
		sign := "+"
		if d < 0 {
			sign = "−"
		}
		s = sign + Num(math.Abs(d)) + "µs " + s
	}
	return s
}

// Num formats a figure with about three significant digits.
func Num(v float64) string {
	a := math.Abs(v)
	switch {
	case v == 0:
		return "0"
	case math.IsNaN(v) || math.IsInf(v, 0):
		return fmt.Sprint(v)
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	case a >= 1:
		return fmt.Sprintf("%.2f", v)
	case a >= 0.001:
		return trimZeros(fmt.Sprintf("%.3f", v))
	default:
		return fmt.Sprintf("%.2g", v)
	}
}

func trimZeros(s string) string {
	if strings.Contains(s, ".") {
		s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	}
	return s
}
