package bench

import (
	"testing"
	"time"
)

func TestParseBusy(t *testing.T) {
	// user nice system idle iowait irq softirq steal guest guest_nice
	got, err := parseBusy([]byte("cpu  100 20 30 5000 70 0 8 2 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"))
	if err != nil {
		t.Fatal(err)
	}
	if want := 160 * time.Second / 100; got != want {
		t.Errorf("busy = %v, want %v (all counters but idle and iowait)", got, want)
	}
	for _, bad := range []string{"", "intr 1 2 3\n", "cpu 1 2 x 4 5 6\n", "cpu 1 2\n"} {
		if _, err := parseBusy([]byte(bad)); err == nil {
			t.Errorf("parseBusy(%q): no error", bad)
		}
	}
	if _, err := machineBusy(); err != nil {
		t.Errorf("this machine's /proc/stat: %v", err)
	}
}
