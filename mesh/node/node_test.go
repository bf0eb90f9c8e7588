package node

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/mesh/config"
	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/proxy"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/tun"
)

var testTD = spiffeid.RequireTrustDomainFromString("cluster.local")

// TestCapturePolicy: the SYNs the netstack takes on node n1. Connections
// opened by a local mesh workload and HBONE to one are always taken;
// plaintext to a local mesh workload only when STRICT mode or a policy
// protects it; nothing that concerns only other nodes' or non-mesh
// workloads.
func TestCapturePolicy(t *testing.T) {
	deny, err := policy.New(policy.Policy{Name: "no-9", Namespace: "guarded", Action: policy.Deny,
		Rules: []policy.Rule{{To: []policy.Operation{{Ports: []uint16{9}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	a := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	snap, err := registry.Build(registry.Model{
		TrustDomain: testTD,
		Workloads: []*registry.Workload{
			{Name: "open", Namespace: "default", Node: "n1", InMesh: true, Addresses: []netip.Addr{a("198.18.1.1"), a("fd00:6d74:1::1")}},
			{Name: "strict", Namespace: "default", Node: "n1", InMesh: true, PeerAuth: registry.Strict, Addresses: []netip.Addr{a("198.18.1.2"), a("fd00:6d74:1::2")}},
			{Name: "guarded", Namespace: "guarded", Node: "n1", InMesh: true, Addresses: []netip.Addr{a("198.18.1.3")}},
			{Name: "plain", Namespace: "default", Node: "n1", InMesh: false, PeerAuth: registry.Strict, Addresses: []netip.Addr{a("198.18.1.4")}},
			{Name: "remote", Namespace: "default", Node: "n2", InMesh: true, PeerAuth: registry.Strict, Addresses: []netip.Addr{a("198.18.2.1")}},
		},
		Policies: []*policy.Policy{deny},
	})
	if err != nil {
		t.Fatal(err)
	}
	take := capturePolicy(registry.New(snap), "n1", func(netip.Addr) bool { return false })
	ap := func(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }
	for _, tc := range []struct {
		name     string
		src, dst string
		want     bool
	}{
		{"from a local mesh workload", "198.18.1.1:40000", "198.18.9.9:80", true},
		{"from a local mesh workload (IPv6)", "[fd00:6d74:1::1]:40000", "[fd00:6d74:9::9]:80", true},
		{"HBONE to a local mesh workload", "198.18.9.9:40000", "198.18.1.1:15008", true},
		{"plaintext to a PERMISSIVE unprotected local workload", "198.18.9.9:40000", "198.18.1.1:80", false},
		{"plaintext to a STRICT local workload", "198.18.9.9:40000", "198.18.1.2:80", true},
		{"plaintext to a STRICT local workload (IPv6)", "[fd00:6d74:9::9]:40000", "[fd00:6d74:1::2]:80", true},
		{"plaintext to a policy-protected local workload", "198.18.9.9:40000", "198.18.1.3:80", true},
		{"to a STRICT workload outside the mesh", "198.18.9.9:40000", "198.18.1.4:80", false},
		{"from a workload outside the mesh", "198.18.1.4:40000", "198.18.9.9:80", false},
		{"to a STRICT mesh workload of another node", "198.18.9.9:40000", "198.18.2.1:80", false},
		{"from a mesh workload of another node", "198.18.2.1:40000", "198.18.9.9:80", false},
		{"HBONE to another node's workload", "198.18.9.9:40000", "198.18.2.1:15008", false},
		{"between unknown addresses", "198.18.9.8:40000", "198.18.9.9:80", false},
	} {
		if got := take.InterceptTCP(ap(tc.src), ap(tc.dst)); got != tc.want {
			t.Errorf("%s: %s -> %s intercepted %v, want %v", tc.name, tc.src, tc.dst, got, tc.want)
		}
	}
}

// inNewNetns moves the calling goroutine, locked to its thread for the rest
// of its life, into a new network namespace, and returns a handle to it:
// nothing the test installs there touches the machine's own routing.
func inNewNetns(t *testing.T) netns.NsHandle {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("this test needs root: CAP_SYS_ADMIN for a network namespace, CAP_NET_ADMIN and /dev/net/tun for a TUN")
	}
	runtime.LockOSThread() // never unlocked: the thread ends with the test
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		t.Fatalf("unshare network namespace: %v", err)
	}
	h, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// logLines is a zerolog writer that hands each line's message and error
// to a channel.
type logLines chan map[string]any

func (l logLines) Write(p []byte) (int, error) {
	var m map[string]any
	if json.Unmarshal(p, &m) == nil {
		select {
		case l <- m:
		default:
		}
	}
	return len(p), nil
}

// captureRuleDsts returns the destinations and input links of the rules
// that route into table in the current network namespace.
func captureRules(t *testing.T, table int) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		rules, err := netlink.RuleListFiltered(family, &netlink.Rule{Table: table}, netlink.RT_FILTER_TABLE)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rules {
			switch {
			case r.Dst != nil:
				out["to "+r.Dst.String()] = true
			case r.IifName != "":
				out[fmt.Sprintf("iif %s v%d", r.IifName, map[int]int{unix.AF_INET: 4, unix.AF_INET6: 6}[family])] = true
			}
		}
	}
	return out
}

// TestReload: the config watcher of a running node applies a valid change
// (new workloads in the registry, certificates for new local ones, capture
// rules for their addresses and links, old ones removed) and keeps the
// last good model when the file turns invalid. The node's routing lives in
// a network namespace of the test's own.
func TestReload(t *testing.T) {
	ns := inNewNetns(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "mesh.yaml")
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(path+".tmp", []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".tmp", path); err != nil {
			t.Fatal(err)
		}
	}
	const before = `nodes:
  - name: n1
    uplinks: [eth0]
  - name: n2
    uplinks: [eth0]
workloads:
  - {name: client, node: n1, addresses: [198.18.1.11], captureLink: vp1p1}
  - {name: gone, node: n1, addresses: [198.18.1.12], captureLink: vp1p2}
  - {name: far, node: n2, addresses: [198.18.2.11], captureLink: vp2p1}
`
	const after = `nodes:
  - name: n1
    uplinks: [eth0]
  - name: n2
    uplinks: [eth0]
workloads:
  - {name: client, node: n1, addresses: [198.18.1.11], captureLink: vp1p1}
  - {name: added, serviceAccount: added, node: n1, addresses: [198.18.1.13, "fd00:6d74:1::13"], captureLink: vp1p3}
  - {name: far, node: n2, addresses: [198.18.2.11], captureLink: vp2p1}
  - {name: far2, node: n2, addresses: [198.18.2.12], captureLink: vp2p2}
`
	write(before)
	c, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	snap, err := c.Snapshot()
	if err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	logs := make(logLines, 64)
	log := zerolog.New(logs)
	n := &node{cfg: Config{Name: "n1"}, log: log, reg: registry.New(snap)}
	ca, err := identity.OpenCA(identity.CAConfig{Dir: t.TempDir(), TrustDomain: snap.TrustDomain, SVIDTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	n.svids, err = identity.NewSource(identity.SourceConfig{Issuer: ca, Bundle: ca.Bundle(), TrustDomain: snap.TrustDomain})
	if err != nil {
		t.Fatal(err)
	}
	defer n.svids.Close()
	n.px, err = proxy.New(ctx, proxy.Config{Node: "n1", Registry: n.reg})
	if err != nil {
		t.Fatal(err)
	}
	dev, err := tun.Open(tun.Config{Name: "mtreload0", NoOffload: true})
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	n.routes, err = tun.InstallRouting(dev, tun.RoutingConfig{
		CaptureLinks: []string{"vp1p1", "vp1p2"},
		PodPrefixes:  podPrefixes(localWorkloads(snap, "n1")),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer n.routes.Close()
	if got := captureRules(t, tun.DefaultTable); !got["to 198.18.1.12/32"] || !got["iif vp1p2 v4"] {
		t.Fatalf("capture rules before the reload: %v", got)
	}

	watched := make(chan struct{})
	go func() {
		// The watcher updates routing: it must run in the test's
		// namespace, on a thread of its own that ends with it.
		runtime.LockOSThread()
		defer close(watched)
		if err := netns.Set(ns); err != nil {
			t.Errorf("enter the test's network namespace: %v", err)
			return
		}
		watchConfig(ctx, path, n, log)
	}()
	// Watch skips the file it finds when it starts; a change made before
	// it watches is that file. So the change is written again, each time
	// a little different, until the reload is logged.
	waitLog := func(msg string, rewrite func(i int)) map[string]any {
		t.Helper()
		deadline := time.After(20 * time.Second)
		tick := time.NewTicker(3 * config.Debounce)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case l := <-logs:
				if l["message"] == msg {
					return l
				}
			case <-tick.C:
				rewrite(i)
			case <-deadline:
				t.Fatalf("no %q logged", msg)
			}
		}
	}
	waitLog("config reloaded", func(i int) { write(after + fmt.Sprintf("# %d\n", i)) })

	s := n.reg.Load()
	if s.WorkloadByName("default", "added") == nil || s.WorkloadByName("default", "far2") == nil || s.WorkloadByName("default", "gone") != nil {
		t.Errorf("registry after the reload does not hold the new file's workloads")
	}
	added := s.WorkloadByName("default", "added")
	if added != nil {
		if _, err := n.svids.SVID(added.Identity); err != nil {
			t.Errorf("no certificate for the new local workload %s: %v", added.Identity, err)
		}
	}
	got := captureRules(t, tun.DefaultTable)
	for _, want := range []string{"to 198.18.1.11/32", "to 198.18.1.13/32", "to fd00:6d74:1::13/128", "iif vp1p1 v4", "iif vp1p3 v6"} {
		if !got[want] {
			t.Errorf("after the reload, no capture rule %q (have %v)", want, got)
		}
	}
	for _, gone := range []string{"to 198.18.1.12/32", "iif vp1p2 v4", "iif vp1p2 v6", "to 198.18.2.12/32", "iif vp2p2 v4"} {
		if got[gone] {
			t.Errorf("after the reload, capture rule %q remains (or was added for another node)", gone)
		}
	}

	// An invalid file: the last good model stays, and the error names
	// the file and line.
	good := n.reg.Load()
	l := waitLog("config reload failed; keeping the last good model", func(i int) {
		write(after + fmt.Sprintf("  - {name: bad%d, node: n1, addresses: [not-an-address]}\n", i))
	})
	if e, _ := l["error"].(string); !strings.Contains(e, "mesh.yaml:") || !strings.Contains(e, "not-an-address") {
		t.Errorf("reload error %q does not name the file, line and bad value", e)
	}
	if n.reg.Load() != good {
		t.Errorf("an invalid file replaced the model")
	}
	if got := captureRules(t, tun.DefaultTable); !got["to 198.18.1.13/32"] {
		t.Errorf("an invalid file changed the capture rules: %v", got)
	}
	cancel()
	<-watched
}
