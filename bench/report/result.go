// Package report holds the results of a benchmark run and writes them for
// people and machines: a terminal table with each path's ratio to the
// baseline and to each peer, a JSON document, and SVG bar charts.
package report

import (
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/meshtun/meshtun/bench/stats"
)

// Result is everything a run measured.
type Result struct {
	// Tool and Version name what produced the result.
	Tool    string `json:"tool"`
	Version string `json:"version"`
	// Command is the command line of the run.
	Command string `json:"command"`
	// Started is when the run started; Seconds its wall-clock length.
	Started time.Time `json:"started"`
	Seconds float64   `json:"seconds"`
	// Quick marks a smoke run with short measurements.
	Quick bool `json:"quick"`
	// Repetitions is how many times each scenario ran on each path.
	Repetitions int `json:"repetitions"`
	// Host describes the machine.
	Host Host `json:"host"`
	// Method says how the figures were taken; Generators what made the
	// traffic.
	Method     string `json:"method"`
	Generators string `json:"generators"`
	// Baseline is the name of the path ratios are first taken to (the
	// kernel alone).
	Baseline string `json:"baseline"`
	// Variant says what the B paths of an A/B comparison ran with (see
	// Path.VariantOf); empty if the run had none.
	Variant string `json:"variant,omitempty"`
	// Paths are the measured paths, in display order.
	Paths []Path `json:"paths"`
	// Metrics are the figures, in display order.
	Metrics []Metric `json:"metrics"`
	// Profiles are the CPU profiles taken, if asked for.
	Profiles []string `json:"profiles,omitempty"`
	// Errors lists the measurements that failed ("path/scenario: error").
	Errors []string `json:"errors,omitempty"`
	// Limits lists the measurements a peer could not make within a limit
	// of its own, such as its open-file limit ("path/scenario: why"): a
	// property of the peer on this machine, not a failure of the run.
	Limits []string `json:"limits,omitempty"`
}

// Host describes the machine a run was on.
type Host struct {
	CPUs   int    `json:"cpus"`
	Kernel string `json:"kernel"`
	Go     string `json:"go"`
}

// Path is a measured path.
type Path struct {
	Name        string `json:"name"`
	Description string `json:"description"`
	// Peer marks a path of another project: each peer is a reference of
	// the ratios of meshtun's paths.
	Peer bool `json:"peer,omitempty"`
	// VariantOf is set on the B path of an A/B comparison: the name of the
	// A path it is compared with.
	VariantOf string `json:"variant_of,omitempty"`
	// Proxies are the proxy processes on the path.
	Proxies []string `json:"proxies,omitempty"`
}

// Better says which direction of a metric is an improvement.
type Better string

// Directions of improvement.
const (
	Higher Better = "higher"
	Lower  Better = "lower"
)

// Metric is one figure measured on every path.
type Metric struct {
	// ID is a stable machine name, e.g. "tcp_up_1".
	ID string `json:"id"`
	// Title is what the table shows; Label the shorter text under a bar.
	Title string `json:"title"`
	Label string `json:"label"`
	// Unit of the values, e.g. "Gbit/s".
	Unit string `json:"unit"`
	// Better says whether a higher or lower value is an improvement.
	Better Better `json:"better"`
	// Chart is the title of the chart the metric is drawn in; metrics with
	// the same Chart share one chart and must share a unit.
	Chart string `json:"chart"`
	// Values by path name; a path the metric does not apply to, or where
	// it failed, has none.
	Values map[string]Value `json:"values"`
}

// Value is a metric's figure on one path.
type Value struct {
	stats.Summary
	// Samples are the per-repetition figures the summary is made of.
	Samples []float64 `json:"samples"`
}

// NewValue summarizes samples.
func NewValue(samples []float64) Value {
	return Value{Summary: stats.Summarize(samples), Samples: samples}
}

// Metric returns the metric with this ID, or nil.
func (r *Result) Metric(id string) *Metric {
	for i := range r.Metrics {
		if r.Metrics[i].ID == id {
			return &r.Metrics[i]
		}
	}
	return nil
}

// Peers returns the names of the peer paths, in display order; none if
// no peer was measured.
func (r *Result) Peers() []string {
	var out []string
	for _, p := range r.Paths {
		if p.Peer {
			out = append(out, p.Name)
		}
	}
	return out
}

// Ratio returns the median of path over the median of ref for metric m,
// and false if either is missing or ref's is zero.
func (m *Metric) Ratio(path, ref string) (float64, bool) {
	v, ok1 := m.Values[path]
	r, ok2 := m.Values[ref]
	if !ok1 || !ok2 || v.N == 0 || r.N == 0 || r.Median == 0 {
		return 0, false
	}
	return v.Median / r.Median, true
}

// WriteJSON writes r as indented JSON.
func WriteJSON(w io.Writer, r *Result) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(r); err != nil {
		return fmt.Errorf("report: write JSON: %w", err)
	}
	return nil
}

// ReadJSON reads a result written by WriteJSON.
func ReadJSON(rd io.Reader) (*Result, error) {
	var r Result
	if err := json.NewDecoder(rd).Decode(&r); err != nil {
		return nil, fmt.Errorf("report: read JSON: %w", err)
	}
	return &r, nil
}
