package bench

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/bench/procstat"
	"github.com/meshtun/meshtun/bench/report"
	"github.com/meshtun/meshtun/bench/topo"
)

func TestPlan(t *testing.T) {
	full, quick := newPlan(Options{}), newPlan(Options{Quick: true})
	if full.reps < 3 || quick.reps < 2 {
		t.Errorf("repetitions: full %d, quick %d; want several (≥3) and at least 2", full.reps, quick.reps)
	}
	if quick.tcp >= full.tcp || len(quick.idle) >= len(full.idle) {
		t.Errorf("quick is not shorter: %+v vs %+v", quick, full)
	}
	if full.idle[0] != 1000 || full.idle[len(full.idle)-1] != 10000 {
		t.Errorf("full idle steps %v, want 1,000 and 10,000", full.idle)
	}
	if got := newPlan(Options{Repetitions: 7}).reps; got != 7 {
		t.Errorf("Repetitions 7 gave %d", got)
	}
	// 300 Mbit/s of 1200-byte datagrams is 31,250 per second.
	if r := full.udpRate(); r != 31250 {
		t.Errorf("udpRate = %v, want 31250", r)
	}
}

func TestMetricDefs(t *testing.T) {
	pl := newPlan(Options{})
	ms := metricDefs(pl)
	seen := map[string]bool{}
	for _, m := range ms {
		if seen[m.ID] {
			t.Errorf("metric %s twice", m.ID)
		}
		seen[m.ID] = true
		if m.Title == "" || m.Unit == "" || (m.Better != report.Higher && m.Better != report.Lower) || m.Chart == "" {
			t.Errorf("metric %s incomplete: %+v", m.ID, m)
		}
	}
	for _, id := range []string{mTCPUp1, mTCPDown4, mRRp99, mCRRRate, mUDPPPS, mUDPMaxPPS, mCPUPerGB, mPeak, "idle_conn_kib_1000", "idle_conn_kib_10000"} {
		if !seen[id] {
			t.Errorf("no metric %s", id)
		}
	}
	// Every chart mixes only one unit.
	if _, err := report.Charts(&report.Result{Metrics: ms}); err != nil {
		t.Error(err)
	}
	if got := thousands(10000); got != "10,000" {
		t.Errorf("thousands(10000) = %q", got)
	}
	if got := thousands(999); got != "999" {
		t.Errorf("thousands(999) = %q", got)
	}
}

func TestProgressPlainLines(t *testing.T) {
	var b strings.Builder
	p := NewProgress(&b, false)
	clock := time.Unix(0, 0)
	p.start, p.now = clock, func() time.Time { return clock }
	p.setTotal(4)
	p.step("warm-up · direct")
	clock = clock.Add(10 * time.Second)
	p.step("rep 1/2 · TCP → 1 stream · mesh")
	p.note("bench: failed: x")
	p.finish()
	want := "[1/4] 0:00 · warm-up · direct\n" +
		"[2/4] 0:10, ~0:30 left · rep 1/2 · TCP → 1 stream · mesh\n" +
		"bench: failed: x\n"
	if b.String() != want {
		t.Errorf("plain progress:\n%q\nwant\n%q", b.String(), want)
	}
}

func TestProgressLiveRedrawsOneLine(t *testing.T) {
	var b strings.Builder
	p := NewProgress(&b, true)
	p.setTotal(2)
	p.step("a long first step")
	p.step("short")
	out := b.String()
	if strings.Contains(out, "\n") {
		t.Errorf("live progress wrote a newline: %q", out)
	}
	if strings.Count(out, "\r") != 2 {
		t.Errorf("live progress: %q, want one carriage return per step", out)
	}
	// The shorter line blanks what is left of the longer one.
	last := out[strings.LastIndex(out, "\r")+1:]
	first := out[1:strings.LastIndex(out, "\r")]
	if len([]rune(last)) < len([]rune(first)) {
		t.Errorf("second line %q does not cover the first %q", last, first)
	}
	p.note("kept")
	if !strings.HasSuffix(b.String(), "\rkept\n") {
		t.Errorf("note after a live line: %q", b.String())
	}
	var nilP *Progress
	nilP.step("nothing") // a nil Progress reports nothing and does not panic
	nilP.note("nothing")
	nilP.finish()
}

// TestFilesNoteNamesAProxyOutOfDescriptors runs a stand-in proxy (this
// test binary, see TestStandInProxy), lowers its open-file limit to what it
// holds, and expects the note to name it; with room left there is no note.
// filesReserve's margin is checked on its own.
func TestFilesNoteNamesAProxyOutOfDescriptors(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestStandInProxy$")
	cmd.Env = append(os.Environ(), standInEnv+"=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		stdin.Close()
		cmd.Process.Kill()
		cmd.Wait()
	}()
	// The stand-in says ready once it holds every descriptor it will hold:
	// counting before that raced with a process still opening or closing
	// some (sleep(1) reading its locale).
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || line != "ready\n" {
		t.Fatalf("stand-in proxy: read %q, %v; want ready", line, err)
	}
	l := &lane{Path: &topo.Path{Proxies: []topo.Proxy{{Name: "stand-in n1", Pid: cmd.Process.Pid}}}}
	if got := filesNote(l); got != "" {
		t.Errorf("with room left: %q, want no note", got)
	}
	open, _, err := procstat.Files("/proc", cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	// Within filesReserve of the limit counts as at it: a proxy may
	// stop accepting a few descriptors short of it.
	near := uint64(open) + filesReserve(uint64(open)) - 1
	if err := unix.Prlimit(cmd.Process.Pid, unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: near, Max: near}, nil); err != nil {
		t.Fatal(err)
	}
	if got, want := filesNote(l), fmt.Sprintf(" (stand-in n1 holds %d descriptors of its open-file limit of %d)", open, near); got != want {
		t.Errorf("near the limit: %q, want %q", got, want)
	}
	lim := unix.Rlimit{Cur: uint64(open), Max: uint64(open)}
	if err := unix.Prlimit(cmd.Process.Pid, unix.RLIMIT_NOFILE, &lim, nil); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf(" (stand-in n1 holds %d descriptors of its open-file limit of %d)", open, open)
	if got := filesNote(l); got != want {
		t.Errorf("at the limit: %q, want %q", got, want)
	}
}

// standInEnv makes TestStandInProxy act as the stand-in proxy.
const standInEnv = "MESHTUN_BENCH_STAND_IN"

// TestStandInProxy is the stand-in proxy of
// TestFilesNoteNamesAProxyOutOfDescriptors when run with standInEnv set:
// it says ready and holds its descriptors until its stdin closes.
// Otherwise it does nothing.
func TestStandInProxy(t *testing.T) {
	if os.Getenv(standInEnv) == "" {
		return
	}
	os.Stdout.WriteString("ready\n")
	io.Copy(io.Discard, os.Stdin)
	os.Exit(0)
}

func TestFilesReserve(t *testing.T) {
	for _, c := range []struct{ limit, want uint64 }{{20000, 200}, {1024, 16}, {100, 16}} {
		if got := filesReserve(c.limit); got != c.want {
			t.Errorf("filesReserve(%d) = %d, want %d", c.limit, got, c.want)
		}
	}
}
