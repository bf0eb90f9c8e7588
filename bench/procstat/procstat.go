// Package procstat reads a process's CPU time and memory from /proc, to
// charge the proxy for the work a benchmark made it do.
package procstat

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// clockTicks is USER_HZ, the unit of the CPU times in /proc/<pid>/stat. It
// is 100 on every Linux architecture Go supports.
const clockTicks = 100

// Sample is one reading of a process.
type Sample struct {
	// CPU is user plus system time since the process started.
	CPU time.Duration
	// RSS is the resident set size (VmRSS), HWM its peak (VmHWM), in bytes.
	RSS, HWM int64
	// Anon and File are RSS's parts (RssAnon, RssFile): the process's own
	// memory (heap, stacks), and pages of files (its binary) mapped from
	// the page cache, shared with every process mapping the same file.
	// RssShmem, the third part, is left out.
	Anon, File int64
}

// Read samples process pid from the /proc file system at root (normally
// "/proc").
func Read(root string, pid int) (Sample, error) {
	dir := filepath.Join(root, strconv.Itoa(pid))
	stat, err := os.ReadFile(filepath.Join(dir, "stat"))
	if err != nil {
		return Sample{}, fmt.Errorf("procstat: pid %d: %w", pid, err)
	}
	cpu, err := parseStat(stat)
	if err != nil {
		return Sample{}, fmt.Errorf("procstat: pid %d: %w", pid, err)
	}
	status, err := os.ReadFile(filepath.Join(dir, "status"))
	if err != nil {
		return Sample{}, fmt.Errorf("procstat: pid %d: %w", pid, err)
	}
	smp := Sample{CPU: cpu}
	if err := parseStatus(status, &smp); err != nil {
		return Sample{}, fmt.Errorf("procstat: pid %d: %w", pid, err)
	}
	return smp, nil
}

// parseStat returns utime+stime from the contents of /proc/<pid>/stat.
// The command name (field 2) is in parentheses and may itself contain
// spaces and parentheses, so fields are counted from the last ')'.
func parseStat(b []byte) (time.Duration, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("stat %q: no command name", firstLine(b))
	}
	// After ")": field 3 (state) onwards; utime and stime are fields 14
	// and 15, so indexes 11 and 12 here.
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("stat %q: %d fields after the name, want at least 13", firstLine(b), len(f))
	}
	var ticks int64
	for _, s := range f[11:13] {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("stat: CPU time %q: %w", s, err)
		}
		ticks += v
	}
	return time.Duration(ticks) * time.Second / clockTicks, nil
}

// parseStatus sets s's memory fields (VmRSS, VmHWM, RssAnon, RssFile, in
// bytes) from the contents of /proc/<pid>/status. VmRSS and VmHWM must be
// there; RssAnon and RssFile (Linux 4.5+) are 0 where they are not.
func parseStatus(b []byte, s *Sample) error {
	fields := map[string]*int64{"VmRSS": &s.RSS, "VmHWM": &s.HWM, "RssAnon": &s.Anon, "RssFile": &s.File}
	var haveRSS, haveHWM bool
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), ":")
		dst := fields[key]
		if !ok || dst == nil {
			continue
		}
		f := strings.Fields(val)
		if len(f) != 2 || f[1] != "kB" {
			return fmt.Errorf("status %s: %q: want \"<n> kB\"", key, strings.TrimSpace(val))
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return fmt.Errorf("status %s: %w", key, err)
		}
		*dst = kb << 10
		haveRSS = haveRSS || key == "VmRSS"
		haveHWM = haveHWM || key == "VmHWM"
	}
	if !haveRSS || !haveHWM {
		return fmt.Errorf("status: no VmRSS or VmHWM line (a kernel thread or a zombie?)")
	}
	return nil
}

func firstLine(b []byte) string {
	s, _, _ := strings.Cut(string(b), "\n")
	if len(s) > 80 {
		s = s[:80] + "…"
	}
	return s
}

// Files returns how many descriptors process pid has open and its
// open-file limit (the soft one, what open(2) checks), from the /proc
// file system at root.
func Files(root string, pid int) (open int, limit uint64, err error) {
	dir := filepath.Join(root, strconv.Itoa(pid))
	fds, err := os.ReadDir(filepath.Join(dir, "fd"))
	if err != nil {
		return 0, 0, fmt.Errorf("procstat: pid %d: %w", pid, err)
	}
	b, err := os.ReadFile(filepath.Join(dir, "limits"))
	if err != nil {
		return 0, 0, fmt.Errorf("procstat: pid %d: %w", pid, err)
	}
	limit, err = parseFileLimit(b)
	if err != nil {
		return 0, 0, fmt.Errorf("procstat: pid %d: %w", pid, err)
	}
	return len(fds), limit, nil
}

// parseFileLimit returns the soft "Max open files" of the contents of
// /proc/<pid>/limits.
func parseFileLimit(b []byte) (uint64, error) {
	const key = "Max open files"
	for line := range strings.SplitSeq(string(b), "\n") {
		rest, ok := strings.CutPrefix(line, key)
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) < 1 {
			break
		}
		if f[0] == "unlimited" {
			return ^uint64(0), nil
		}
		n, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("limits: %q: %w", line, err)
		}
		return n, nil
	}
	return 0, fmt.Errorf("limits: no %q line", key)
}
