package e2e

import (
	"bytes"
	"context"
	"encoding/xml"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/meshtun/meshtun/bench/report"
)

// TestBenchSuiteQuick runs `meshtun bench --quick` as CI does and checks
// that the suite works: every scenario produced numbers on every path it
// applies to, and the table, the JSON and the charts were written. It
// checks no speed: a figure must exist and be a finite, non-negative
// number, nothing more (a window in which no byte moved is logged, not
// failed: that is the data path's finding, not the suite's).
func TestBenchSuiteQuick(t *testing.T) {
	dir := t.TempDir()
	jsonPath, chartDir := filepath.Join(dir, "bench.json"), filepath.Join(dir, "charts")
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, meshtunBin, "bench", "--quick", "--json", jsonPath, "--out", chartDir)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	t.Logf("meshtun bench --quick: %v\n%s", time.Since(start).Round(time.Second), stdout.String())
	if err != nil {
		t.Fatalf("meshtun bench --quick: %v\nstderr:\n%s", err, stderr.String())
	}

	f, err := os.Open(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	res, err := report.ReadJSON(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Errors) > 0 {
		t.Errorf("failed measurements: %q", res.Errors)
	}
	if !res.Quick || res.Repetitions < 2 || res.Baseline != "direct" || res.Generators == "" || res.Method == "" {
		t.Errorf("run description: quick %v, %d repetitions, baseline %q, generators %q", res.Quick, res.Repetitions, res.Baseline, res.Generators)
	}
	var names []string
	for _, p := range res.Paths {
		names = append(names, p.Name)
	}
	if want := []string{"direct", "verbatim", "passthrough", "mesh"}; !slices.Equal(names, want) {
		t.Fatalf("paths %v, want %v", names, want)
	}

	// Figures about the proxy process exist wherever there is a proxy;
	// every other figure on every path, once per repetition.
	proxyMetric := func(id string) bool {
		return id == "cpu_s_per_gb" || id == "rss_start_mib" || id == "peak_mib" || strings.HasPrefix(id, "idle_conn_kib_")
	}
	moved := func(id string) bool { // figures that count traffic: zero means it did not flow
		return strings.HasPrefix(id, "tcp_") || strings.HasSuffix(id, "_pps") || id == "crr_rate"
	}
	for _, want := range []string{"tcp_up_1", "tcp_up_4", "tcp_down_1", "tcp_down_4", "rr_p50", "rr_p90", "rr_p99",
		"crr_rate", "crr_p50", "crr_p99", "udp_pps", "udp_loss", "udp_max_pps", "cpu_s_per_gb", "rss_start_mib", "peak_mib", "idle_conn_kib_1000"} {
		if res.Metric(want) == nil {
			t.Errorf("no metric %s", want)
		}
	}
	for _, m := range res.Metrics {
		for _, p := range res.Paths {
			v, ok := m.Values[p.Name]
			if p.Name == "direct" && proxyMetric(m.ID) {
				if ok {
					t.Errorf("%s on direct (no proxy there): %+v", m.ID, v)
				}
				continue
			}
			if !ok || v.N == 0 {
				t.Errorf("%s on %s: no figure", m.ID, p.Name)
				continue
			}
			if !proxyMetric(m.ID) && v.N != res.Repetitions {
				t.Errorf("%s on %s: %d samples, want one per repetition (%d)", m.ID, p.Name, v.N, res.Repetitions)
			}
			for _, s := range v.Samples {
				if math.IsNaN(s) || math.IsInf(s, 0) || s < 0 {
					t.Errorf("%s on %s: sample %v", m.ID, p.Name, s)
				}
				if moved(m.ID) && s == 0 {
					t.Logf("note: %s on %s: nothing moved in one repetition (%v)", m.ID, p.Name, v.Samples)
				}
			}
			if v.Min > v.Median || v.Median > v.Max {
				t.Errorf("%s on %s: median %v outside [%v, %v]", m.ID, p.Name, v.Median, v.Min, v.Max)
			}
		}
	}

	// The table names every path and metric.
	table := stdout.String()
	for _, s := range append(names, "TCP client→server, 1 stream", "vs direct", "request/response p99") {
		if !strings.Contains(table, s) {
			t.Errorf("table lacks %q", s)
		}
	}

	// The charts: well-formed SVG files, all linked from index.html.
	svgs, _ := filepath.Glob(filepath.Join(chartDir, "*.svg"))
	if len(svgs) < 5 {
		t.Errorf("%d charts in %s, want one per chart group", len(svgs), chartDir)
	}
	index, err := os.ReadFile(filepath.Join(chartDir, "index.html"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range svgs {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		dec := xml.NewDecoder(bytes.NewReader(b))
		for {
			_, err := dec.Token()
			if err != nil {
				if err.Error() != "EOF" {
					t.Errorf("%s: not well-formed: %v", filepath.Base(p), err)
				}
				break
			}
		}
		if !strings.Contains(string(index), `src="`+filepath.Base(p)+`"`) {
			t.Errorf("index.html does not show %s", filepath.Base(p))
		}
	}
}

// TestBenchSuiteAB runs the suite's A/B mode on one path: the B path must
// be built beside its A path, carry its own numbers, and be compared with
// A in the table.
func TestBenchSuiteAB(t *testing.T) {
	dir := t.TempDir()
	jsonPath := filepath.Join(dir, "bench.json")
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, meshtunBin, "bench", "--quick", "--reps", "1", "--paths", "verbatim",
		"--variant-env", "GOMAXPROCS=1", "--variant-label", "P1", "--json", jsonPath)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("meshtun bench (A/B): %v\nstderr:\n%s", err, stderr.String())
	}
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	res, err := report.ReadJSON(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range res.Paths {
		names = append(names, p.Name+"<"+p.VariantOf)
	}
	if want := []string{"direct<", "verbatim<", "verbatim·P1<verbatim"}; !slices.Equal(names, want) {
		t.Fatalf("paths (name<variant of) %v, want %v", names, want)
	}
	if res.Variant != "environment GOMAXPROCS=1" {
		t.Errorf("variant %q", res.Variant)
	}
	for _, id := range []string{"tcp_up_1", "rr_p50", "cpu_s_per_gb"} {
		if v := res.Metric(id).Values["verbatim·P1"]; v.N == 0 {
			t.Errorf("%s: no figure on the B path", id)
		}
	}
	if !strings.Contains(stdout.String(), "B vs A") {
		t.Errorf("table has no B vs A row:\n%s", stdout.String())
	}
}
