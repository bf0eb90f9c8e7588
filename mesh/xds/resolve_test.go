package xds

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/anypb"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// workloadEntry is a WorkloadEntry of cluster as istiod sends it: no
// pod, an address declared by whoever wrote the entry.
func workloadEntry(cluster, ns, name, ip string) (string, *workloadapi.Address) {
	uid := cluster + "/networking.istio.io/WorkloadEntry/" + ns + "/" + name
	a := wl(ns, name, ip, "")
	a.GetWorkload().Uid = uid
	a.GetWorkload().Services = nil
	return uid, a
}

// serviceEntry is a ServiceEntry host with one VIP.
func serviceEntry(ns, host, vip string) (string, *workloadapi.Address) {
	return ns + "/" + host, &workloadapi.Address{Type: &workloadapi.Address_Service{Service: &workloadapi.Service{
		Name: host, Namespace: ns, Hostname: host,
		Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr(vip).AsSlice()}},
		Ports:     []*workloadapi.Port{{ServicePort: 443, TargetPort: 443}},
	}}}
}

// TestConflictsResolvedResourceByResource: a WorkloadEntry on a pod's IP
// and a ServiceEntry VIP that is a pod's address (both of which istiod
// sends, istio#54338) lose against the pods, resource by resource: the
// first response of a stream still gives a starting node its model, the
// NACK names exactly the losers, and a full state after a reconnect is
// applied whole even though the conflict is still in it, so changes made
// while the stream was down are not lost.
func TestConflictsResolvedResourceByResource(t *testing.T) {
	f := newFakeIstiod(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	// The WorkloadEntry's cluster sorts before the pods' ("A" < "K"): the
	// pod wins because it is a pod, not by name.
	weName, we := workloadEntry("A", "default", "we", "10.0.0.1")
	seName, se := serviceEntry("default", "ext.example.com", "10.0.0.2")
	must(f.addrs.UpdateResources(map[string]types.Resource{
		"Kubernetes//Pod/default/a":             wl("default", "a", "10.0.0.1", "node2"),
		"Kubernetes//Pod/default/b":             wl("default", "b", "10.0.0.2", "node2"),
		weName:                                  we,
		seName:                                  se,
		"default/web.default.svc.cluster.local": svc("10.96.0.10"),
	}, nil))

	src, snap := newSource(t, f) // fails (no model) if the response is refused whole
	if w := snap.Workload(netip.MustParseAddr("10.0.0.1")); w == nil || w.Name != "a" {
		t.Fatalf("10.0.0.1 is %v, want pod a", w)
	}
	if snap.WorkloadByName("default", "we") != nil {
		t.Error("the WorkloadEntry that lost the address is in the model")
	}
	if s := snap.ServiceByVIP(netip.MustParseAddr("10.0.0.2")); s != nil {
		t.Errorf("10.0.0.2 is service %s's VIP, not pod b's address", s)
	}
	if w := snap.Workload(netip.MustParseAddr("10.0.0.2")); w == nil || w.Name != "b" {
		t.Errorf("10.0.0.2 is %v, want pod b", w)
	}
	if s := snap.ServiceByVIP(netip.MustParseAddr("10.96.0.10")); s == nil || len(s.Endpoints(netip.MustParseAddr("10.96.0.10"))) != 2 {
		t.Errorf("the service that conflicts with nothing: %v", s)
	}
	nack := f.waitReq(t, "NACK of the losers", func(r *discoveryv3.DeltaDiscoveryRequest) bool {
		return r.TypeUrl == AddressType && isNACK(r)
	})
	msg := nack.ErrorDetail.Message
	for _, want := range []string{weName, seName, "10.0.0.1", "10.0.0.2"} {
		if !strings.Contains(msg, want) {
			t.Errorf("NACK %q does not name %s", msg, want)
		}
	}
	for _, winner := range []string{"Kubernetes//Pod/default/a:", "Kubernetes//Pod/default/b:", "default/web.default.svc.cluster.local:"} {
		if strings.Contains(msg, winner) {
			t.Errorf("NACK %q names %s, which won", msg, winner)
		}
	}
	if st := src.Status(); st.Conflicts != 2 {
		t.Errorf("status counts %d conflicts, want 2", st.Conflicts)
	}

	// istiod goes away; meanwhile pod b is deleted and pod c created. The
	// new stream's full state still holds the WorkloadEntry's conflict,
	// and is applied: b is gone, c is there.
	f.stop()
	must(f.addrs.UpdateResources(map[string]types.Resource{
		"Kubernetes//Pod/default/c": wl("default", "c", "10.0.0.3", "node2"),
	}, []string{"Kubernetes//Pod/default/b"}))
	f.restart(t)
	snap = next(t, src, "the state istiod sent on reconnecting", func(s *registry.Snapshot) bool {
		return s.Workload(netip.MustParseAddr("10.0.0.3")) != nil
	})
	if snap.WorkloadByName("default", "b") != nil {
		t.Error("pod b, deleted while the stream was down, is still in the model")
	}
	if w := snap.Workload(netip.MustParseAddr("10.0.0.1")); w == nil || w.Name != "a" {
		t.Errorf("after reconnecting 10.0.0.1 is %v, want pod a", w)
	}
	// b's address is free now: the ServiceEntry gets its VIP back.
	if s := snap.ServiceByVIP(netip.MustParseAddr("10.0.0.2")); s == nil || s.Hostname != "ext.example.com" {
		t.Errorf("10.0.0.2 after b is gone: service %v, want ext.example.com", s)
	}
}

// withUnknownField adds a field number no istio.security message has, as
// a newer istiod's field would arrive.
func withUnknownField(a *security.Authorization) *security.Authorization {
	var b []byte
	b = protowire.AppendTag(b, 999, protowire.BytesType)
	b = protowire.AppendString(b, "a restriction this meshtun does not know")
	m := a.Groups[0].Rules[0].Matches[0]
	m.ProtoReflect().SetUnknown(b)
	return a
}

func allowFrom(ns, name string, principal string) *security.Authorization {
	a := denyFrom(ns, name, security.Scope_NAMESPACE, principal)
	a.Action = security.Action_ALLOW
	return a
}

// TestAuthorizationUnknownFieldsAndDryRun: an Authorization with fields
// meshtun does not know denies everything in its scope (dropping a
// newer istiod's restriction would allow what it denies), and a dry-run
// policy is evaluated and reported, not enforced nor dropped.
func TestAuthorizationUnknownFieldsAndDryRun(t *testing.T) {
	f := newFakeIstiod(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(f.addrs.UpdateResource("Kubernetes//Pod/ns1/a", wl("ns1", "a", "10.0.0.1", "node2")))
	must(f.addrs.UpdateResource("Kubernetes//Pod/ns2/b", wl("ns2", "b", "10.0.0.2", "node2")))
	must(f.addrs.UpdateResource("Kubernetes//Pod/ns3/c", wl("ns3", "c", "10.0.0.3", "node2")))
	// ns1: ALLOW from x, with a field from a newer istiod.
	must(f.authz.UpdateResource("ns1/allow-x", withUnknownField(allowFrom("ns1", "allow-x", "cluster.local/ns/default/sa/x"))))
	// ns2: the same without the unknown field (the control).
	must(f.authz.UpdateResource("ns2/allow-x", allowFrom("ns2", "allow-x", "cluster.local/ns/default/sa/x")))
	// ns3: a dry-run DENY of x.
	dry := denyFrom("ns3", "dry-deny-x", security.Scope_NAMESPACE, "cluster.local/ns/default/sa/x")
	dry.DryRun = true
	must(f.authz.UpdateResource("ns3/dry-deny-x", dry))

	_, snap := newSource(t, f)
	x := spiffeid.RequireFromString("spiffe://cluster.local/ns/default/sa/x")
	if d := snap.Authorize(&policy.Request{Peer: x, Dest: netip.MustParseAddrPort("10.0.0.2:8080")}); !d.Allowed {
		t.Fatalf("control: x to b in ns2 is denied: %v", d)
	}
	if d := snap.Authorize(&policy.Request{Peer: x, Dest: netip.MustParseAddrPort("10.0.0.1:8080")}); d.Allowed {
		t.Errorf("x to a in ns1 is allowed by a policy with fields meshtun does not know: %v", d)
	}
	nack := f.waitReq(t, "NACK of the unknown fields", func(r *discoveryv3.DeltaDiscoveryRequest) bool {
		return r.TypeUrl == AuthorizationType && isNACK(r)
	})
	if msg := nack.ErrorDetail.Message; !strings.Contains(msg, "ns1/allow-x") || !strings.Contains(msg, "does not know") || strings.Contains(msg, "ns3/") {
		t.Errorf("NACK %q", msg)
	}
	d := snap.Authorize(&policy.Request{Peer: x, Dest: netip.MustParseAddrPort("10.0.0.3:8080")})
	if !d.Allowed {
		t.Errorf("the dry-run DENY is enforced: %v", d)
	}
	if d.Audit == nil || d.Audit.ID() != "ns3/dry-deny-x" || !d.Audit.DryRun || d.Audit.Action != policy.Deny {
		t.Errorf("the dry-run DENY's match is not reported: audit %+v", d.Audit)
	}
	y := spiffeid.RequireFromString("spiffe://cluster.local/ns/default/sa/y")
	if d := snap.Authorize(&policy.Request{Peer: y, Dest: netip.MustParseAddrPort("10.0.0.3:8080")}); d.Audit != nil {
		t.Errorf("the dry-run DENY of x is reported for y: %v", d.Audit.ID())
	}
}

// TestFullStateOf100kWorkloads: a full state of 100,000 workloads (one
// message of ~20 MB, over gRPC's default 4 MiB limit) reaches the model
// through a real gRPC stream.
func TestFullStateOf100kWorkloads(t *testing.T) {
	if testing.Short() {
		t.Skip("100,000 workloads: ~10 s of CPU")
	}
	const n = 100_000
	f := newFakeIstiod(t)
	res := make(map[string]types.Resource, n)
	for i := range n {
		name := fmt.Sprintf("w%d", i)
		ip := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		a := wl("load", name, ip.String(), fmt.Sprintf("node%d", i%500))
		res["Kubernetes//Pod/load/"+name] = a
	}
	if err := f.addrs.UpdateResources(res, nil); err != nil {
		t.Fatal(err)
	}
	res = nil
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)

	tok := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tok, []byte(testToken), 0o600); err != nil {
		t.Fatal(err)
	}
	src := New(Config{
		Address: f.addr, ServerName: "istiod.istio-system.svc", RootCertFile: f.rootFile, TokenFile: tok,
		Node:        Node{PodName: "p", Namespace: "meshtun-system", ServiceAccount: "meshtun", IP: netip.MustParseAddr("198.18.0.2"), NodeName: "node1"},
		TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local"),
		MinBackoff:  20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
		Logger: zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel),
	})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	timer := time.AfterFunc(120*time.Second, cancel)
	start, cpu0 := time.Now(), cpuTime()
	snap, err := src.Start(ctx)
	took, cpu := time.Since(start), cpuTime()-cpu0
	timer.Stop()
	if err != nil {
		t.Fatalf("%v (status %+v)", err, src.Status())
	}
	if got := len(snap.Workloads); got != n {
		t.Fatalf("%d workloads, want %d", got, n)
	}
	if w := snap.Workload(netip.MustParseAddr("10.1.134.159")); w == nil || w.Name != "w99999" {
		t.Fatalf("10.1.134.159 is %v, want w99999", w)
	}
	runtime.GC()
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	t.Logf("%d workloads: first model in %v (CPU of the process, fake istiod's sending included: %v); live heap %d MiB, %d MiB before the source (the fake istiod's cache)",
		n, took.Round(time.Millisecond), cpu.Round(time.Millisecond), after.HeapAlloc>>20, before.HeapAlloc>>20)
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestRefusedWorkloadsOfThisNode: a workload istiod puts in the mesh on
// this node with a feature meshtun refuses stays in the model, refused
// (the node captures and denies it); one of another node is left out;
// a plaintext one of this node is captured once the node enrolls it.
func TestRefusedWorkloadsOfThisNode(t *testing.T) {
	f := newFakeIstiod(t)
	waypoint := &workloadapi.GatewayAddress{
		Destination:   &workloadapi.GatewayAddress_Address{Address: &workloadapi.NetworkAddress{Network: "elsewhere", Address: netip.MustParseAddr("10.0.0.50").AsSlice()}},
		HboneMtlsPort: 15008,
	}
	local := wl("default", "local", "10.0.0.1", "node1")
	local.GetWorkload().Waypoint = waypoint
	remote := wl("default", "remote", "10.0.0.2", "node2")
	remote.GetWorkload().Waypoint = waypoint
	legacy := wl("default", "legacy", "10.0.0.3", "node1")
	legacy.GetWorkload().TunnelProtocol = workloadapi.TunnelProtocol_LEGACY_ISTIO_MTLS
	plain := wl("default", "plain", "10.0.0.4", "node1")
	plain.GetWorkload().TunnelProtocol = workloadapi.TunnelProtocol_NONE
	plain.GetWorkload().Extensions = []*workloadapi.Extension{{Name: "future"}}
	if err := f.addrs.UpdateResources(map[string]types.Resource{
		"Kubernetes//Pod/default/local": local, "Kubernetes//Pod/default/remote": remote,
		"Kubernetes//Pod/default/legacy": legacy, "Kubernetes//Pod/default/plain": plain,
	}, nil); err != nil {
		t.Fatal(err)
	}
	src, snap := newSource(t, f)
	for ip, want := range map[string]string{"10.0.0.1": RefusedWaypoint, "10.0.0.3": RefusedTunnelProtocol} {
		if w := snap.Workload(netip.MustParseAddr(ip)); w == nil || !w.InMesh || w.Refused != want {
			t.Errorf("%s: %+v, want in the mesh, refused %q", ip, w, want)
		}
	}
	if w := snap.Workload(netip.MustParseAddr("10.0.0.2")); w != nil {
		t.Errorf("the refused workload of node2 is in node1's model: %+v", w)
	}
	if w := snap.Workload(netip.MustParseAddr("10.0.0.4")); w != nil {
		t.Errorf("a refused plaintext workload that is not enrolled is in the model: %+v", w)
	}
	if st := src.Status(); st.Refused != 2 {
		t.Errorf("status counts %d refused workloads, want 2", st.Refused)
	}
	src.Enroll(map[registry.WorkloadRef]bool{{Namespace: "default", Name: "plain"}: true})
	snap = next(t, src, "plain enrolled", func(s *registry.Snapshot) bool { return s.Workload(netip.MustParseAddr("10.0.0.4")) != nil })
	if w := snap.Workload(netip.MustParseAddr("10.0.0.4")); !w.InMesh || w.Refused != RefusedExtensions {
		t.Errorf("the enrolled refused workload: %+v", w)
	}
}

// TestNACKMessageBounded: a full state with thousands of rejected
// resources gives a NACK of bounded size.
func TestNACKMessageBounded(t *testing.T) {
	errs := make([]string, 5000)
	for i := range errs {
		errs[i] = fmt.Sprintf("Kubernetes//Pod/ns/w%d: workload ns/w%d has extensions (x), which meshtun does not understand", i, i)
	}
	msg := nackMessage(errs)
	if len(msg) > 16<<10 || !strings.HasSuffix(msg, "and 4900 more") || !strings.Contains(msg, "/w99:") || strings.Contains(msg, "/w100:") {
		t.Errorf("NACK of %d bytes: ...%s", len(msg), msg[max(0, len(msg)-60):])
	}
}

// TestUndecodablePolicyKeepsItsLastVersion: an Authorization that does
// not decode keeps its previous version, also across a full state: its
// scope is unknown, and dropping it would let in what it denies.
func TestUndecodablePolicyKeepsItsLastVersion(t *testing.T) {
	src := New(Config{TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local")})
	w, _ := anypb.New(wl("ns", "w", "10.0.0.1", "n1"))
	if nack := src.apply(response{typeURL: AddressType, full: true, resources: []*discoveryv3.Resource{{Name: "w", Resource: w}}}); nack != "" {
		t.Fatal(nack)
	}
	p, _ := anypb.New(denyFrom("ns", "deny-x", security.Scope_NAMESPACE, "cluster.local/ns/default/sa/x"))
	if nack := src.apply(response{typeURL: AuthorizationType, full: true, resources: []*discoveryv3.Resource{{Name: "ns/deny-x", Resource: p}}}); nack != "" {
		t.Fatal(nack)
	}
	garbage := &anypb.Any{TypeUrl: AuthorizationType, Value: []byte{0xff, 0xff, 0xff}}
	nack := src.apply(response{typeURL: AuthorizationType, full: true, resources: []*discoveryv3.Resource{{Name: "ns/deny-x", Resource: garbage}}})
	if !strings.Contains(nack, "ns/deny-x") {
		t.Errorf("NACK %q does not name the resource", nack)
	}
	snap, _, _, err := src.build(src.st)
	if err != nil {
		t.Fatal(err)
	}
	x := spiffeid.RequireFromString("spiffe://cluster.local/ns/default/sa/x")
	if d := snap.Authorize(&policy.Request{Peer: x, Dest: netip.MustParseAddrPort("10.0.0.1:80")}); d.Allowed {
		t.Errorf("x is allowed once the DENY policy's new version does not decode: %v", d)
	}
}
