// Command floors summarises the profiles and counters that `meshtun bench
// --pprof DIR` writes, for the floors of the speed targets
// (docs/decisions/2026-12-01-floors-of-unmet-targets.md):
//
//	go run ./bench/floors DIR [DIR...]
//
// It prints, per path and run, the CPU per unit of work (s/GB for the TCP
// streams, µs per round trip, connection or datagram) of the proxies and
// of the load generators, with the cores they kept busy and their sleeps
// (voluntary context switches) per unit; the proxies' CPU split by what
// the innermost owning frame of each profile sample is (AES-GCM, TUN
// system calls, socket system calls, gVisor, TLS records, HTTP/2, ...),
// scaled to the counters; the time goroutines waited to run per unit in
// the execution traces (go tool trace -pprof=sched); and the heap in use
// per idle connection by owner (idle<N> heap profiles against idle0).
// Several directories are summed (profiles merged). It reads the profiles
// with github.com/google/pprof/profile; it runs `go tool trace -pprof` to turn
// the execution traces into profiles (kept next to them as .sched.pb and
// .syscall.pb).
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/google/pprof/profile"
)

// rule names the owner of a sample whose innermost matching frame matches.
type rule struct {
	name string
	re   *regexp.Regexp
}

const sysName = "syscall"

var cpuRules = []rule{
	{"AES-GCM", regexp.MustCompile(`aes/gcm|ghash`)},
	{sysName, regexp.MustCompile(`internal/runtime/syscall|^syscall\.(Raw)?Syscall|^runtime\.futex$|^runtime\.usleep$|epollwait|^runtime\.netpoll$`)},
	{"TLS records (not AES)", regexp.MustCompile(`^crypto/tls\.`)},
	{"netstack (gVisor, link endpoint, classifier)", regexp.MustCompile(`^gvisor\.dev|meshtun/meshtun/stack`)},
	{"HTTP/2 (hbone)", regexp.MustCompile(`meshtun/protocols/hbone`)},
	{"relay, proxy", regexp.MustCompile(`meshtun/mesh/|meshtun/protocols/relay`)},
	{"GC, allocation", regexp.MustCompile(`^runtime\.(gc|mallocgc|bgsweep|bgscavenge|scanobject|markroot|sweep)`)},
	{"scheduler, netpoll", regexp.MustCompile(`^runtime\.(schedule|findRunnable|park_m|mcall|goready|ready|wakep|notewakeup|stopm|startm|runqgrab|stealWork|checkTimers|netpoll)`)},
}

var schedRE = regexp.MustCompile(`runtime\.(netpoll|futex|notesleep|notewakeup|stopm|startm|wakep|schedule|findRunnable|usleep)`)

// syscallOwner splits system-call time by what the call was for.
func syscallOwner(stack []string) string {
	s := strings.Join(stack, " ")
	switch {
	case strings.Contains(s, "meshtun/tun."):
		return "TUN syscalls"
	case schedRE.MatchString(s):
		return "scheduler, netpoll"
	}
	return "socket syscalls"
}

var heapRules = []rule{
	{"gVisor TCP endpoint, accepted", regexp.MustCompile(`TCPRequest\)\.Accept|ForwarderRequest|synRcvdState|listenContext`)},
	{"gVisor TCP endpoint, dialled", regexp.MustCompile(`Stack\)\.DialTCP|synSentState`)},
	{"HBONE stream, HTTP/2", regexp.MustCompile(`meshtun/protocols/hbone`)},
	{"relay, proxy", regexp.MustCompile(`meshtun/mesh/proxy|meshtun/protocols/relay`)},
}

func owner(rules []rule, stack []string) string {
	for _, fr := range stack {
		for _, r := range rules {
			if r.re.MatchString(fr) {
				if r.name == sysName {
					return syscallOwner(stack)
				}
				return r.name
			}
		}
	}
	return "other"
}

// units scales a sample type's unit to seconds or bytes.
var units = map[string]float64{"nanoseconds": 1e-9, "microseconds": 1e-6, "milliseconds": 1e-3, "seconds": 1, "bytes": 1}

// readProfile parses the pprof file at path.
func readProfile(path string) (*profile.Profile, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	p, err := profile.Parse(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return p, nil
}

// sampleIndex returns the index of p's sample type typ, or of its last one
// (pprof's default) when typ is "", and the scale of its unit to seconds or
// bytes.
func sampleIndex(p *profile.Profile, typ string) (int, float64, error) {
	i := len(p.SampleType) - 1
	if typ != "" {
		i = slices.IndexFunc(p.SampleType, func(t *profile.ValueType) bool { return t.Type == typ })
	}
	if i < 0 {
		return 0, 0, fmt.Errorf("no sample type %q", typ)
	}
	scale, ok := units[p.SampleType[i].Unit]
	if !ok {
		return 0, 0, fmt.Errorf("sample type %s has unit %q, not a time or bytes", p.SampleType[i].Type, p.SampleType[i].Unit)
	}
	return i, scale, nil
}

// stack returns the function names of a sample's frames, innermost first,
// an inlined call before the function it was inlined into.
func stack(s *profile.Sample) []string {
	var names []string
	for _, loc := range s.Location {
		for _, l := range loc.Line {
			if l.Function != nil {
				names = append(names, l.Function.Name)
			}
		}
	}
	return names
}

// byOwner sums the positive values of sample type typ (see sampleIndex) of
// the profile at path by the owner of their stacks, in seconds or bytes, and
// returns the sums and their total. A sample without a stack (the runtime
// records a few) is "other"; go tool pprof -traces, which this replaces, left
// it out.
func byOwner(path, typ string, rules []rule) (map[string]float64, float64, error) {
	p, err := readProfile(path)
	if err != nil {
		return nil, 0, err
	}
	i, scale, err := sampleIndex(p, typ)
	if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", path, err)
	}
	sums, all := map[string]int64{}, int64(0)
	for _, s := range p.Sample {
		if v := s.Value[i]; v > 0 {
			sums[owner(rules, stack(s))] += v
			all += v
		}
	}
	sum := map[string]float64{}
	for o, v := range sums {
		sum[o] = float64(v) * scale
	}
	return sum, float64(all) * scale, nil
}

// total returns the sum of a profile's default (last) sample type, in
// seconds or bytes (go tool pprof -top's "of X total").
func total(p *profile.Profile) (float64, error) {
	i, scale, err := sampleIndex(p, "")
	if err != nil {
		return 0, err
	}
	t := int64(0)
	for _, s := range p.Sample {
		t += max(s.Value[i], -s.Value[i])
	}
	return float64(t) * scale, nil
}

type key struct{ path, run string }

type count struct {
	units, wall, gen, genSleeps, machine float64
	proxy, proxySleeps                   map[string]float64
}

func readCounters(dirs []string) (map[key]*count, []key, error) {
	c := map[key]*count{}
	var order []key
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "counters.tsv"))
		if err != nil {
			return nil, nil, err
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		var head []string
		seen := map[key]bool{}
		for sc.Scan() {
			f := strings.Split(sc.Text(), "\t")
			if head == nil {
				head = f
				continue
			}
			r := map[string]string{}
			for i, h := range head {
				if i < len(f) {
					r[h] = f[i]
				}
			}
			num := func(k string) float64 { v, _ := strconv.ParseFloat(r[k], 64); return v }
			k := key{r["path"], r["run"]}
			x := c[k]
			if x == nil {
				x = &count{proxy: map[string]float64{}, proxySleeps: map[string]float64{}}
				c[k] = x
				order = append(order, k)
			}
			if !seen[k] {
				seen[k] = true
				x.units += num("units")
				x.wall += num("wall s")
				x.gen += num("generators CPU s")
				x.genSleeps += num("generators sleeps")
				x.machine += num("machine busy CPU s")
			}
			if p := r["proxy"]; p != "-" {
				x.proxy[p] += num("proxy CPU s")
				x.proxySleeps[p] += num("proxy sleeps")
			}
		}
	}
	return c, order, nil
}

// perUnit scales seconds to the run's unit: s/GB for streams, µs otherwise.
func perUnit(run string) (float64, string) {
	if run == "up" || run == "down" {
		return 1, "CPU s/GB"
	}
	return 1e6, "CPU µs"
}

func sumMap(m map[string]float64) float64 {
	s := 0.0
	for _, v := range m {
		s += v
	}
	return s
}

func byValue(m map[string]float64) []string {
	ks := slices.Collect(maps.Keys(m))
	slices.SortFunc(ks, func(a, b string) int {
		if m[a] != m[b] {
			if m[a] > m[b] {
				return -1
			}
			return 1
		}
		return strings.Compare(a, b)
	})
	return ks
}

func main() {
	flag.String("bin", "", "ignored: the profiles carry their symbols (kept for old command lines)")
	traceSeconds := flag.Float64("trace-seconds", 5, "length of the execution traces (bench's profile length)")
	flag.Parse()
	dirs := flag.Args()
	if len(dirs) == 0 {
		fmt.Fprintln(os.Stderr, "usage: floors [-trace-seconds S] DIR [DIR...]")
		os.Exit(2)
	}
	if err := run(*traceSeconds, dirs); err != nil {
		fmt.Fprintln(os.Stderr, "floors:", err)
		os.Exit(1)
	}
}

func run(traceSeconds float64, dirs []string) error {
	c, order, err := readCounters(dirs)
	if err != nil {
		return err
	}
	fmt.Println("## Counters: per unit (TCP runs per GB), summed over the directories")
	fmt.Println("| path | run | units | proxies CPU | generators CPU | proxies+generators cores | machine busy cores | sleeps per unit: generators / proxies |")
	fmt.Println("|---|---|---|---|---|---|---|---|")
	for _, k := range order {
		x := c[k]
		if x.units == 0 {
			continue
		}
		f, unit := perUnit(strings.TrimSuffix(k.run, "-trace"))
		var ps []string
		for _, p := range slices.Sorted(maps.Keys(x.proxySleeps)) {
			ps = append(ps, fmt.Sprintf("%s %.3g", p, x.proxySleeps[p]/x.units))
		}
		fmt.Printf("| %s | %s | %.4g | %.4g %s | %.4g | %.2f | %.2f | %.3g / %s |\n", k.path, k.run, x.units,
			sumMap(x.proxy)*f/x.units, unit, x.gen*f/x.units, (sumMap(x.proxy)+x.gen)/x.wall, x.machine/x.wall,
			x.genSleeps/x.units, strings.Join(ps, ", "))
	}
	for _, run := range []string{"up", "down", "rr", "crr", "udp"} {
		f, unit := perUnit(run)
		fmt.Printf("\n## %s: proxies' %s per unit by owner (profile shares × counters, nodes summed)\n", run, unit)
		for _, k := range order {
			if k.run != run {
				continue
			}
			x := c[k]
			sum, samples := map[string]float64{}, 0.0
			for p, cpu := range x.proxy {
				node := strings.ReplaceAll(p, " ", "-")
				share, tot := map[string]float64{}, 0.0
				for _, d := range dirs {
					file := filepath.Join(d, fmt.Sprintf("%s-%s-%s.pprof", k.path, node, run))
					if _, err := os.Stat(file); err != nil {
						continue
					}
					s, t, err := byOwner(file, "", cpuRules)
					if err != nil {
						return err
					}
					for o, v := range s {
						share[o] += v
					}
					tot += t
				}
				if tot == 0 {
					continue
				}
				samples += tot
				for o, v := range share {
					sum[o] += v / tot * cpu * f / x.units
				}
			}
			if len(sum) == 0 {
				continue
			}
			var parts []string
			for _, o := range byValue(sum) {
				parts = append(parts, fmt.Sprintf("%s %.3g", o, sum[o]))
			}
			fmt.Printf("- %s (total %.4g, %.1f s of samples): %s\n", k.path, sumMap(sum), samples, strings.Join(parts, "; "))
		}
	}
	fmt.Printf("\n## Execution traces: µs per unit a goroutine waited to run, and spent in blocking (non-raw) system calls\n")
	for _, d := range dirs {
		files, _ := filepath.Glob(filepath.Join(d, "*-trace"))
		for _, file := range files {
			m := regexp.MustCompile(`^(.*)-(meshtun-n\d+)-(rr|crr)-trace$`).FindStringSubmatch(filepath.Base(file))
			if m == nil {
				continue
			}
			x := c[key{m[1], m[3] + "-trace"}]
			if x == nil || x.wall == 0 {
				continue
			}
			n := x.units / x.wall * traceSeconds
			var out []string
			for _, kind := range []string{"sched", "syscall"} {
				pb := file + "." + kind + ".pb"
				if _, err := os.Stat(pb); err != nil {
					b, err := exec.Command("go", "tool", "trace", "-pprof="+kind, file).Output()
					if err != nil {
						return fmt.Errorf("go tool trace %s: %w", file, err)
					}
					if err := os.WriteFile(pb, b, 0o644); err != nil {
						return err
					}
				}
				p, err := readProfile(pb)
				if err != nil {
					return err
				}
				t, err := total(p)
				if err != nil {
					return fmt.Errorf("%s: %w", pb, err)
				}
				out = append(out, fmt.Sprintf("%s %.1f", kind, t*1e6/n))
			}
			fmt.Printf("- %s %s %s %s (≈%.0f units traced): %s\n", filepath.Base(d), m[1], m[2], m[3], n, strings.Join(out, ", "))
		}
	}
	fmt.Printf("\n## Heap in use per idle connection by owner (idle<N> against idle0)\n")
	for _, d := range dirs {
		files, _ := filepath.Glob(filepath.Join(d, "*-idle0.heap.pprof"))
		for _, base := range files {
			prefix := strings.TrimSuffix(base, "-idle0.heap.pprof")
			more, _ := filepath.Glob(prefix + "-idle*.heap.pprof")
			for _, top := range more {
				n, err := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(top, prefix+"-idle"), ".heap.pprof"))
				if err != nil || n == 0 {
					continue
				}
				a, _, err := byOwner(base, "inuse_space", heapRules)
				if err != nil {
					return err
				}
				z, _, err := byOwner(top, "inuse_space", heapRules)
				if err != nil {
					return err
				}
				diff := map[string]float64{}
				for o := range z {
					diff[o] = (z[o] - a[o]) / float64(n) / 1024
				}
				for o := range a {
					diff[o] = (z[o] - a[o]) / float64(n) / 1024
				}
				var parts []string
				for _, o := range byValue(diff) {
					parts = append(parts, fmt.Sprintf("%s %.2f", o, diff[o]))
				}
				fmt.Printf("- %s, %d idle: %.2f KiB: %s\n", filepath.Base(prefix), n, sumMap(diff), strings.Join(parts, "; "))
			}
		}
	}
	return nil
}
