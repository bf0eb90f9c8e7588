package procstat

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

func TestParseStatNameWithSpacesAndParens(t *testing.T) {
	// Fields: pid (comm) state ppid pgrp session tty tpgid flags minflt
	// cminflt majflt cmajflt utime stime …
	line := "4242 (my (odd) proc) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 3 0\n"
	got, err := parseStat([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if want := 3250 * time.Millisecond; got != want {
		t.Errorf("parseStat = %v, want %v (250+75 ticks)", got, want)
	}
	if _, err := parseStat([]byte("1 (x) S 1 2")); err == nil {
		t.Error("parseStat of a short line: no error")
	}
	if _, err := parseStat([]byte("garbage")); err == nil {
		t.Error("parseStat without a name: no error")
	}
}

func TestParseStatus(t *testing.T) {
	status := "Name:\tmeshtun\nVmPeak:\t  900 kB\nVmHWM:\t   20480 kB\nVmRSS:\t   10240 kB\nRssAnon:\t    3072 kB\nRssFile:\t    7168 kB\nThreads:\t7\n"
	var s Sample
	if err := parseStatus([]byte(status), &s); err != nil {
		t.Fatal(err)
	}
	if s.RSS != 10<<20 || s.HWM != 20<<20 {
		t.Errorf("parseStatus = rss %d hwm %d, want %d and %d", s.RSS, s.HWM, 10<<20, 20<<20)
	}
	if s.Anon != 3<<20 || s.File != 7<<20 {
		t.Errorf("parseStatus = anon %d file %d, want %d and %d", s.Anon, s.File, 3<<20, 7<<20)
	}
	if err := parseStatus([]byte("Name:\tkthreadd\n"), &s); err == nil {
		t.Error("parseStatus without Vm lines: no error")
	}
	if err := parseStatus([]byte("VmRSS:\t12 MB\nVmHWM:\t1 kB\n"), &s); err == nil {
		t.Error("parseStatus with a unit other than kB: no error")
	}
}

func TestReadSelf(t *testing.T) {
	before, err := Read("/proc", os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// Burn some CPU so that the counter must move.
	deadline := time.Now().Add(150 * time.Millisecond)
	x := 0
	for time.Now().Before(deadline) {
		x++
	}
	runtime.KeepAlive(x)
	after, err := Read("/proc", os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if after.CPU <= before.CPU {
		t.Errorf("CPU did not grow after 150 ms of work: %v then %v", before.CPU, after.CPU)
	}
	if after.RSS <= 0 || after.HWM < after.RSS {
		t.Errorf("memory: RSS %d, HWM %d; want 0 < RSS <= HWM", after.RSS, after.HWM)
	}
}

func TestReadMissing(t *testing.T) {
	if _, err := Read(filepath.Join(t.TempDir(), "proc"), 1); err == nil {
		t.Error("Read of a missing process: no error")
	}
}

func TestParseFileLimit(t *testing.T) {
	const limits = `Limit                     Soft Limit           Hard Limit           Units     
Max cpu time              unlimited            unlimited            seconds   
Max open files            12000                20000                files     
Max locked memory         8388608              8388608              bytes     
`
	if n, err := parseFileLimit([]byte(limits)); err != nil || n != 12000 {
		t.Errorf("parseFileLimit = %d, %v; want the soft 12000", n, err)
	}
	if _, err := parseFileLimit([]byte("Max cpu time unlimited unlimited seconds\n")); err == nil {
		t.Error("no open-files line: no error")
	}
	if _, err := parseFileLimit([]byte("Max open files            many    many   files\n")); err == nil {
		t.Error("a limit that is not a number: no error")
	}
	open, limit, err := Files("/proc", os.Getpid())
	if err != nil || open < 3 || limit < uint64(open) {
		t.Errorf("Files(self) = %d open, limit %d, %v", open, limit, err)
	}
}
