package bench

import (
	"os"
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

func TestParseSleeps(t *testing.T) {
	n, err := parseSleeps([]byte("Name:\tx\nvoluntary_ctxt_switches:\t1234\nnonvoluntary_ctxt_switches:\t5\n"))
	if err != nil || n != 1234 {
		t.Errorf("parseSleeps = %d, %v; want 1234 (the voluntary count, not the nonvoluntary one)", n, err)
	}
	if _, err := parseSleeps([]byte("Name:\tx\n")); err == nil {
		t.Error("no count: no error")
	}
	if n, err := sleeps(os.Getpid()); err != nil || n <= 0 {
		t.Errorf("sleeps(self) = %d, %v; want a positive count", n, err)
	}
}
