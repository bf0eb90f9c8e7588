package main

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/pprof/profile"
)

// fakeSample is a sample of a built profile: its values, one per sample
// type, and its locations, innermost first, each a list of function names
// with the inlined ones first.
type fakeSample struct {
	values []int64
	locs   [][]string
}

// writeProfile builds a profile with the given sample types ("type/unit")
// and samples, writes it (gzipped, as runtime/pprof does) to a file in a
// temporary directory and returns the file's path.
func writeProfile(t *testing.T, types []string, samples []fakeSample) string {
	t.Helper()
	p := &profile.Profile{Period: 1}
	for _, ty := range types {
		typ, unit, _ := strings.Cut(ty, "/")
		p.SampleType = append(p.SampleType, &profile.ValueType{Type: typ, Unit: unit})
	}
	p.PeriodType = p.SampleType[len(p.SampleType)-1]
	funcs := map[string]*profile.Function{}
	for _, s := range samples {
		ps := &profile.Sample{Value: s.values}
		for _, names := range s.locs {
			loc := &profile.Location{ID: uint64(len(p.Location) + 1), Address: uint64(0x1000 + len(p.Location))}
			for _, n := range names {
				f := funcs[n]
				if f == nil {
					f = &profile.Function{ID: uint64(len(p.Function) + 1), Name: n, SystemName: n, Filename: "x.go"}
					funcs[n] = f
					p.Function = append(p.Function, f)
				}
				loc.Line = append(loc.Line, profile.Line{Function: f, Line: 1})
			}
			p.Location = append(p.Location, loc)
			ps.Location = append(ps.Location, loc)
		}
		p.Sample = append(p.Sample, ps)
	}
	if err := p.CheckValid(); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "x.pprof")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Write(f); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

func checkSums(t *testing.T, got map[string]float64, want map[string]float64) {
	t.Helper()
	for o, w := range want {
		if math.Abs(got[o]-w) > 1e-9*math.Max(1, w) {
			t.Errorf("%s: got %v, want %v", o, got[o], w)
		}
	}
	for o, g := range got {
		if _, ok := want[o]; !ok {
			t.Errorf("unexpected owner %q: %v", o, g)
		}
	}
}

const ms = 1e6 // nanoseconds

// TestByOwnerCPU checks that each CPU sample goes to the owner of its
// innermost owning frame, with inlined frames before their callers, and
// that the values are the cpu/nanoseconds ones in seconds.
func TestByOwnerCPU(t *testing.T) {
	sample := func(n int64, locs ...[]string) fakeSample {
		return fakeSample{values: []int64{n, n * 10 * ms}, locs: locs}
	}
	l := func(names ...string) []string { return names }
	path := writeProfile(t, []string{"samples/count", "cpu/nanoseconds"}, []fakeSample{
		sample(1, l("crypto/internal/fips140/aes/gcm.gcmAesEnc"), l("crypto/tls.(*Conn).Write"), l("github.com/meshtun/meshtun/protocols/hbone.(*stream).Write")),
		sample(2, l("internal/runtime/syscall.Syscall6"), l("syscall.Syscall"), l("github.com/meshtun/meshtun/tun.(*Device).Read"), l("github.com/meshtun/meshtun/stack.(*linkEndpoint).dispatchLoop")),
		sample(3, l("internal/runtime/syscall.Syscall6"), l("syscall.write"), l("internal/poll.(*FD).Write"), l("net.(*conn).Write"), l("crypto/tls.(*Conn).Write")),
		sample(4, l("runtime.epollwait"), l("runtime.netpoll"), l("runtime.findRunnable"), l("runtime.schedule")),
		// One location: crypto/tls inlined into hbone; the inlined frame is the innermost.
		sample(5, l("crypto/tls.(*halfConn).encrypt", "github.com/meshtun/meshtun/protocols/hbone.(*stream).Write")),
		sample(6, l("gvisor.dev/gvisor/pkg/tcpip/transport/tcp.(*endpoint).HandlePacket"), l("github.com/meshtun/meshtun/mesh/proxy.relay")),
		sample(7, l("runtime.mallocgc"), l("github.com/meshtun/meshtun/mesh/proxy.relay")),
		sample(8, l("io.copyBuffer"), l("github.com/meshtun/meshtun/protocols/relay.Copy")),
		sample(9, l("main.main")),
		sample(10), // no stack: the CPU was spent, by no one known
		{values: []int64{5, 0}, locs: [][]string{l("crypto/tls.(*Conn).Write")}},
	})
	got, total, err := byOwner(path, "", cpuRules)
	if err != nil {
		t.Fatal(err)
	}
	checkSums(t, got, map[string]float64{
		"AES-GCM":               0.01,
		"TUN syscalls":          0.02,
		"socket syscalls":       0.03,
		"scheduler, netpoll":    0.04,
		"TLS records (not AES)": 0.05,
		"netstack (gVisor, link endpoint, classifier)": 0.06,
		"GC, allocation": 0.07,
		"relay, proxy":   0.08,
		"other":          0.19,
	})
	if math.Abs(total-0.55) > 1e-9 {
		t.Errorf("total %v, want 0.55", total)
	}
}

// TestByOwnerHeap checks that heap samples are summed by their inuse_space
// values (not the profile's other sample types) by owner.
func TestByOwnerHeap(t *testing.T) {
	types := []string{"alloc_objects/count", "alloc_space/bytes", "inuse_objects/count", "inuse_space/bytes"}
	sample := func(inuse int64, names ...string) fakeSample {
		s := fakeSample{values: []int64{7, 1 << 20, 3, inuse}}
		for _, n := range names {
			s.locs = append(s.locs, []string{n})
		}
		return s
	}
	path := writeProfile(t, types, []fakeSample{
		sample(1000, "gvisor.dev/gvisor/pkg/tcpip/transport/tcp.newEndpoint", "gvisor.dev/gvisor/pkg/tcpip/transport/tcp.(*listenContext).createConnectingEndpoint"),
		sample(2000, "gvisor.dev/gvisor/pkg/tcpip/transport/tcp.newEndpoint", "gvisor.dev/gvisor/pkg/tcpip/stack.(*Stack).DialTCP", "github.com/meshtun/meshtun/mesh/proxy.dial"),
		sample(3000, "golang.org/x/net/http2.(*Framer).WriteHeaders", "github.com/meshtun/meshtun/protocols/hbone.Dial"),
		sample(4000, "bufio.NewReaderSize", "github.com/meshtun/meshtun/protocols/relay.Copy"),
		sample(5000, "main.main"),
		sample(0, "github.com/meshtun/meshtun/protocols/hbone.Dial"),
	})
	got, total, err := byOwner(path, "inuse_space", heapRules)
	if err != nil {
		t.Fatal(err)
	}
	checkSums(t, got, map[string]float64{
		"gVisor TCP endpoint, accepted": 1000,
		"gVisor TCP endpoint, dialled":  2000,
		"HBONE stream, HTTP/2":          3000,
		"relay, proxy":                  4000,
		"other":                         5000,
	})
	if total != 15000 {
		t.Errorf("total %v, want 15000", total)
	}
	if _, _, err := byOwner(path, "delay", heapRules); err == nil {
		t.Error("byOwner of a missing sample type did not fail")
	}
}

// TestTotal checks the total of a go tool trace -pprof profile: its last
// sample type (delay), all samples, those without a stack too.
func TestTotal(t *testing.T) {
	path := writeProfile(t, []string{"contentions/count", "delay/nanoseconds"}, []fakeSample{
		{values: []int64{1, 3 * ms}, locs: [][]string{{"runtime.gopark"}}},
		{values: []int64{9, 4 * ms}},
	})
	p, err := readProfile(path)
	if err != nil {
		t.Fatal(err)
	}
	got, err := total(p)
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(got-0.007) > 1e-12 {
		t.Errorf("total %v, want 0.007", got)
	}
}
