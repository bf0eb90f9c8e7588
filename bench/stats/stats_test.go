package stats

import (
	"math"
	"testing"
)

func TestSummarize(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []float64
		want Summary
	}{
		{"empty", nil, Summary{}},
		{"one", []float64{3}, Summary{Median: 3, Min: 3, Max: 3, N: 1}},
		{"odd unsorted", []float64{5, 1, 3}, Summary{Median: 3, Min: 1, Max: 5, N: 3}},
		{"even takes the mean of the middle two", []float64{4, 1, 2, 10}, Summary{Median: 3, Min: 1, Max: 10, N: 4}},
		{"NaN ignored", []float64{math.NaN(), 2, 8}, Summary{Median: 5, Min: 2, Max: 8, N: 2}},
		{"only NaN", []float64{math.NaN()}, Summary{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Summarize(tc.in); got != tc.want {
				t.Errorf("Summarize(%v) = %+v, want %+v", tc.in, got, tc.want)
			}
		})
	}
}

func TestSummarizeLeavesInputAlone(t *testing.T) {
	in := []float64{3, 1, 2}
	Summarize(in)
	if in[0] != 3 || in[1] != 1 || in[2] != 2 {
		t.Errorf("Summarize reordered its input: %v", in)
	}
}

func TestPercentileNearestRank(t *testing.T) {
	// 1..100: the p-th percentile is p itself.
	s := make([]float64, 100)
	for i := range s {
		s[i] = float64(i + 1)
	}
	for _, tc := range []struct{ p, want float64 }{
		{50, 50}, {90, 90}, {99, 99}, {100, 100}, {0.5, 1}, {0, 1}, {99.5, 100},
	} {
		if got := Percentile(s, tc.p); got != tc.want {
			t.Errorf("Percentile(1..100, %v) = %v, want %v", tc.p, got, tc.want)
		}
	}
	// Few samples: p50 of 4 is the 2nd, p90 and p99 the 4th.
	four := []float64{10, 20, 30, 40}
	for _, tc := range []struct{ p, want float64 }{{50, 20}, {75, 30}, {90, 40}, {99, 40}, {25, 10}} {
		if got := Percentile(four, tc.p); got != tc.want {
			t.Errorf("Percentile(%v, %v) = %v, want %v", four, tc.p, got, tc.want)
		}
	}
	if got := Percentile(nil, 50); got != 0 {
		t.Errorf("Percentile(nil, 50) = %v, want 0", got)
	}
}

func TestPercentilesUnsorted(t *testing.T) {
	got := Percentiles([]float64{9, 1, 5, 3, 7, 2, 8, 4, 6, 10}, 50, 90, 99)
	want := []float64{5, 9, 10}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("Percentiles = %v, want %v", got, want)
		}
	}
}

func TestMedian(t *testing.T) {
	if got := Median(nil); got != 0 {
		t.Errorf("Median(nil) = %v", got)
	}
	if got := Median([]float64{1, 2, 3, 100}); got != 2.5 {
		t.Errorf("Median(1,2,3,100) = %v, want 2.5", got)
	}
}
