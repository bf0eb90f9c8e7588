package main

import "testing"

func TestNodeProcs(t *testing.T) {
	for _, c := range []struct {
		flag    int
		envSet  bool
		runtime int
		want    int
	}{
		{0, false, 1, 1},
		{0, false, 2, 1},
		{0, false, 3, 1},
		{0, false, 8, 4},
		{0, false, 64, 32},
		{0, true, 2, 2}, // GOMAXPROCS=2 in the environment
		{3, false, 2, 3},
		{3, true, 8, 3}, // the flag wins
	} {
		if got := nodeProcs(c.flag, c.envSet, c.runtime); got != c.want {
			t.Errorf("nodeProcs(%d, %v, %d) = %d, want %d", c.flag, c.envSet, c.runtime, got, c.want)
		}
	}
}
