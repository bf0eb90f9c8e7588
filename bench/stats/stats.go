// Package stats summarizes benchmark samples: medians with their range
// across repetitions, and percentiles of per-request latencies.
package stats

import (
	"math"
	"slices"
)

// Summary is the median of a set of samples with its range.
type Summary struct {
	// Median is the middle sample, or the mean of the two middle samples
	// of an even count.
	Median float64 `json:"median"`
	// Min and Max bound the samples.
	Min float64 `json:"min"`
	Max float64 `json:"max"`
	// N is the number of samples.
	N int `json:"n"`
}

// Summarize returns the median, minimum and maximum of samples. NaN
// samples are ignored; with no samples left the summary is all zero with
// N == 0.
func Summarize(samples []float64) Summary {
	s := sortedFinite(samples)
	if len(s) == 0 {
		return Summary{}
	}
	return Summary{Median: Median(s), Min: s[0], Max: s[len(s)-1], N: len(s)}
}

// Median returns the median of sorted, which must be sorted in increasing
// order; 0 for no samples.
func Median(sorted []float64) float64 {
	n := len(sorted)
	switch {
	case n == 0:
		return 0
	case n%2 == 1:
		return sorted[n/2]
	default:
		return (sorted[n/2-1] + sorted[n/2]) / 2
	}
}

// Percentile returns the p-th percentile (0 < p ≤ 100) of sorted, which
// must be sorted in increasing order, by the nearest-rank method: the
// smallest sample such that at least p percent of the samples are less
// than or equal to it. It returns 0 for no samples; p ≤ 0 gives the
// minimum.
func Percentile(sorted []float64, p float64) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	rank := int(math.Ceil(p / 100 * float64(n)))
	rank = min(max(rank, 1), n)
	return sorted[rank-1]
}

// Percentiles sorts a copy of samples and returns the requested
// percentiles of it, in the order asked.
func Percentiles(samples []float64, ps ...float64) []float64 {
	s := sortedFinite(samples)
	out := make([]float64, len(ps))
	for i, p := range ps {
		out[i] = Percentile(s, p)
	}
	return out
}

// sortedFinite returns the non-NaN samples, sorted, in a new slice.
func sortedFinite(samples []float64) []float64 {
	s := make([]float64, 0, len(samples))
	for _, v := range samples {
		if !math.IsNaN(v) {
			s = append(s, v)
		}
	}
	slices.Sort(s)
	return s
}
