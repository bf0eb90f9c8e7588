package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/metrics"
	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/stack"
	"github.com/meshtun/meshtun/test/fixture"
)

// syncBuffer is the shared log sink of test/fixture.
type syncBuffer = fixture.SyncBuffer

// dialed is one DialTCP call of recordingDialer.
type dialed struct{ src, dst netip.AddrPort }

// recordingDialer is the netstack stand-in: it records each upstream dial
// and refuses it (a *stack.Conn needs a real netstack).
type recordingDialer struct{ calls chan dialed }

func (d *recordingDialer) DialTCP(_ context.Context, src, dst netip.AddrPort) (*stack.Conn, error) {
	d.calls <- dialed{src, dst}
	return nil, syscall.ECONNREFUSED
}

// inboundEnv is a Proxy on node "n1" behind a real HBONE server on
// loopback, and an HBONE client for the workload "a/client" of node "n2".
// The server's workload "b/server" has the loopback address, so that the
// HBONE endpoint and the target are both that workload's.
type inboundEnv struct {
	p       *Proxy
	metrics *metrics.Metrics
	access  *syncBuffer
	dialer  *recordingDialer
	cl      *hbone.Client
	snap    *registry.Snapshot

	endpoint       netip.AddrPort
	client, server spiffeid.ID
	other, pod     spiffeid.ID
}

var (
	serverAddr   = netip.MustParseAddr("127.0.0.1")
	clientAddr   = netip.MustParseAddr("198.18.5.1") // a/client, node n2
	otherAddr    = netip.MustParseAddr("198.18.5.2") // c/other, node n2
	podAddr      = netip.MustParseAddr("127.0.0.3")  // d/pod, node n2: a client pod that dials from its own address
	replicaAddr  = netip.MustParseAddr("198.18.5.3") // d/replica, node n2: another pod of d/pod's identity
	unknownAddr  = netip.MustParseAddr("198.18.5.99")
	clientAddr6  = netip.MustParseAddr("fd00:6d74:5::1") // a/client's IPv6
	targetPort   = uint16(8080)
	targetServer = netip.AddrPortFrom(serverAddr, targetPort)
)

func newInboundEnv(t *testing.T) *inboundEnv {
	t.Helper()
	snap, err := registry.NewSnapshot(testTD, []*registry.Workload{
		{Name: "server", Namespace: "b", ServiceAccount: "server", Node: "n1", InMesh: true, Addresses: []netip.Addr{serverAddr}},
		{Name: "client", Namespace: "a", ServiceAccount: "client", Node: "n2", InMesh: true, Addresses: []netip.Addr{clientAddr, clientAddr6}},
		{Name: "other", Namespace: "c", ServiceAccount: "other", Node: "n2", InMesh: true, Addresses: []netip.Addr{otherAddr}},
		{Name: "pod", Namespace: "d", ServiceAccount: "pod", Node: "n2", InMesh: true, Addresses: []netip.Addr{podAddr}},
		{Name: "replica", Namespace: "d", ServiceAccount: "pod", Node: "n2", InMesh: true, Addresses: []netip.Addr{replicaAddr}},
	})
	if err != nil {
		t.Fatal(err)
	}
	e := &inboundEnv{
		metrics: metrics.New(),
		access:  &syncBuffer{},
		dialer:  &recordingDialer{calls: make(chan dialed, 16)},
		snap:    snap,
		client:  snap.WorkloadByName("a", "client").Identity,
		server:  snap.WorkloadByName("b", "server").Identity,
		other:   snap.WorkloadByName("c", "other").Identity,
		pod:     snap.WorkloadByName("d", "pod").Identity,
	}
	ca, err := identity.OpenCA(identity.CAConfig{Dir: t.TempDir(), TrustDomain: testTD, SVIDTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	src, err := identity.NewSource(identity.SourceConfig{Issuer: ca, Bundle: ca.Bundle(), TrustDomain: testTD})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(src.Close)
	for _, id := range []spiffeid.ID{e.client, e.server, e.other, e.pod} {
		if err := src.Add(context.Background(), id); err != nil {
			t.Fatal(err)
		}
	}
	reg := registry.New(snap)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	e.p, err = New(ctx, Config{
		Node:      "n1",
		Registry:  reg,
		Metrics:   e.metrics,
		Logger:    zerolog.New(zerolog.NewTestWriter(t)),
		AccessLog: zerolog.New(e.access),
		Netstack:  e.dialer,
		Inbound: hbone.ServerConfig{
			TLS: identity.ServerTLS(src, testTD, func(a netip.Addr) (spiffeid.ID, bool) {
				if w := reg.Load().Workload(a); w != nil {
					return w.Identity, true
				}
				return spiffeid.ID{}, false
			}),
			Logger: zerolog.New(zerolog.NewTestWriter(t)),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := e.p.Server()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		<-served
	})
	e.endpoint = ln.Addr().(*net.TCPAddr).AddrPort()
	e.cl, err = hbone.NewClient(hbone.ClientConfig{
		TLS: func(s, d spiffeid.ID) (*tls.Config, error) { return identity.ClientTLS(src.Workload(s), d), nil },
		DialFrom: func(ctx context.Context, from netip.Addr, ep netip.AddrPort) (net.Conn, error) {
			d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(from, 0))}
			return d.DialContext(ctx, "tcp", ep.String())
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.cl.Close() })
	return e
}

// dial opens an HBONE stream as peer to the server workload's target port,
// with forwarded for fwd (if valid), and returns the refusal.
func (e *inboundEnv) dial(t *testing.T, peer spiffeid.ID, fwd netip.AddrPort) *hbone.StatusError {
	t.Helper()
	return e.dialFrom(t, peer, netip.Addr{}, fwd)
}

// dialFrom is dial with the HBONE connection dialled from address from
// (loopback's 127.0.0.1 if not valid).
func (e *inboundEnv) dialFrom(t *testing.T, peer spiffeid.ID, from netip.Addr, fwd netip.AddrPort) *hbone.StatusError {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := e.cl.Dial(ctx, hbone.DialRequest{
		Source: peer, Destination: e.server, Endpoint: e.endpoint, Target: targetServer, From: from,
		Forwarded: hbone.Forwarded{For: fwd},
	})
	if err == nil {
		c.Close()
		t.Fatal("HBONE stream opened; the test's netstack refuses every dial")
	}
	var se *hbone.StatusError
	if !errors.As(err, &se) {
		t.Fatalf("Dial: %v, want an HTTP refusal", err)
	}
	return se
}

// nextDial returns the upstream dial the proxy made, failing if none.
func (e *inboundEnv) nextDial(t *testing.T) dialed {
	t.Helper()
	select {
	case d := <-e.dialer.calls:
		return d
	default:
		t.Fatal("the proxy did not dial the workload")
	}
	return dialed{}
}

// lastRecord returns the last access-log line.
func (e *inboundEnv) lastRecord(t *testing.T) map[string]any {
	t.Helper()
	l := e.access.Lines(t)
	if len(l) == 0 {
		t.Fatal("no access-log line")
	}
	return l[len(l)-1]
}

// opened returns istio_tcp_connections_opened_total for the destination
// reporter of the server workload with these response flags.
func (e *inboundEnv) opened(t *testing.T, flags string) float64 {
	t.Helper()
	c := metrics.Conn{
		Reporter:       "destination",
		Src:            metrics.Peer{Workload: "client", Namespace: "a", Principal: e.client.String()},
		Dst:            metrics.Peer{Workload: "server", Namespace: "b", Principal: e.server.String()},
		SecurityPolicy: "mutual_tls", ResponseFlags: flags,
	}
	return counterValue(t, e.metrics, "istio_tcp_connections_opened_total", &c)
}

// TestInboundRefusedWhileDraining: after StopNew, an inbound HBONE request
// gets 503, the workload is not dialled, and the record says DRAIN.
func TestInboundRefusedWhileDraining(t *testing.T) {
	e := newInboundEnv(t)
	fwd := netip.AddrPortFrom(clientAddr, 40000)

	// Control: before the drain the same request reaches the workload's
	// dial (refused there: CONNECT).
	if se := e.dial(t, e.client, fwd); se.Code != 503 {
		t.Fatalf("before the drain: %v, want 503", se)
	}
	e.nextDial(t)
	if got := e.lastRecord(t)["response_flags"]; got != "CONNECT" {
		t.Fatalf("before the drain: response_flags %v, want CONNECT", got)
	}

	e.p.StopNew()
	se := e.dial(t, e.client, fwd)
	if se.Code != 503 {
		t.Errorf("while draining: %v, want 503", se)
	}
	select {
	case d := <-e.dialer.calls:
		t.Errorf("while draining the proxy dialled the workload (%s -> %s)", d.src, d.dst)
	default:
	}
	rec := e.lastRecord(t)
	if rec["response_flags"] != "DRAIN" || rec["direction"] != "inbound" || rec["message"] != "connection refused" {
		t.Errorf("access log while draining: %v, want an inbound refusal with response_flags DRAIN", rec)
	}
	if got := e.opened(t, "DRAIN"); got != 1 {
		t.Errorf("istio_tcp_connections_opened_total{response_flags=DRAIN} = %v, want 1", got)
	}
}

// TestInboundSourceChoice: the workload is dialled from the tunnel's
// peer address when the model ties it to the verified peer's identity (a
// client pod that dialled from its own address, as ztunnel does; with
// forwarded's port if forwarded names that address); else from the
// forwarded client address when that address belongs to a workload with
// the verified peer's identity; otherwise from the tunnel's own address,
// port 0 (the claim is not repeated).
func TestInboundSourceChoice(t *testing.T) {
	e := newInboundEnv(t)
	tunnel := netip.AddrPortFrom(serverAddr, 0) // the client dials from loopback
	for _, tc := range []struct {
		name string
		peer spiffeid.ID
		from netip.Addr
		fwd  netip.AddrPort
		want netip.AddrPort
	}{
		{"forwarded address of the peer's workload", e.client, netip.Addr{}, netip.AddrPortFrom(clientAddr, 40001), netip.AddrPortFrom(clientAddr, 40001)},
		{"no forwarded header", e.client, netip.Addr{}, netip.AddrPort{}, tunnel},
		{"forwarded address of another identity's workload", e.client, netip.Addr{}, netip.AddrPortFrom(otherAddr, 40002), tunnel},
		{"the other workload's own address, as itself", e.other, netip.Addr{}, netip.AddrPortFrom(otherAddr, 40003), netip.AddrPortFrom(otherAddr, 40003)},
		{"forwarded address of no workload", e.client, netip.Addr{}, netip.AddrPortFrom(unknownAddr, 40004), tunnel},
		{"forwarded IPv6 for an IPv4 target", e.client, netip.Addr{}, netip.AddrPortFrom(clientAddr6, 40005), tunnel},
		{"peer address of the peer's workload, forwarded the same", e.pod, podAddr, netip.AddrPortFrom(podAddr, 40006), netip.AddrPortFrom(podAddr, 40006)},
		{"peer address of the peer's workload, no forwarded header", e.pod, podAddr, netip.AddrPort{}, netip.AddrPortFrom(podAddr, 0)},
		// ztunnel's form: the peer address wins over a forwarded
		// address (even one the identity would back).
		{"peer address of the peer's workload, forwarded another identity's", e.pod, podAddr, netip.AddrPortFrom(otherAddr, 40007), netip.AddrPortFrom(podAddr, 0)},
		{"peer address of the peer's workload, forwarded a replica of the same identity", e.pod, podAddr, netip.AddrPortFrom(replicaAddr, 40009), netip.AddrPortFrom(podAddr, 0)},
		{"peer address of another identity's workload", e.client, podAddr, netip.AddrPortFrom(clientAddr, 40008), netip.AddrPortFrom(clientAddr, 40008)},
		{"peer address of another identity's workload, no forwarded header", e.client, podAddr, netip.AddrPort{}, netip.AddrPortFrom(podAddr, 0)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e.dialFrom(t, tc.peer, tc.from, tc.fwd)
			d := e.nextDial(t)
			if d.src != tc.want || d.dst != targetServer {
				t.Errorf("dialled %s -> %s, want %s -> %s", d.src, d.dst, tc.want, targetServer)
			}
		})
	}
}

// TestInboundSourceIPPolicy: a source-IP DENY (ipBlocks) is evaluated on
// the address inboundSource chose: a client pod that dials from its own
// address is denied by a rule on that address, with no forwarded header
// at all (ztunnel's form), and the access log names it as src.addr and
// its workload.
func TestInboundSourceIPPolicy(t *testing.T) {
	e := newInboundEnv(t)
	deny, err := policy.New(policy.Policy{Name: "deny-pod-ip", Namespace: "b", Action: policy.Deny,
		Rules: []policy.Rule{{From: []policy.Source{{IPBlocks: []policy.IPBlock{{CIDR: netip.PrefixFrom(podAddr, 32)}}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	snap, err := registry.Build(registry.Model{TrustDomain: testTD, Workloads: e.snap.Workloads, Policies: []*policy.Policy{deny}})
	if err != nil {
		t.Fatal(err)
	}
	e.p.cfg.Registry.Store(snap)
	se := e.dialFrom(t, e.pod, podAddr, netip.AddrPort{})
	if se.Code != 401 && se.Code != 403 {
		t.Errorf("CONNECT from the denied pod address: %d, want a denial", se.Code)
	}
	select {
	case d := <-e.dialer.calls:
		t.Errorf("the denied connection was dialled: %s -> %s", d.src, d.dst)
	default:
	}
	rec := e.lastRecord(t)
	if rec["src.addr"] != podAddr.String()+":0" || rec["src.workload"] != "pod" {
		t.Errorf("access log src.addr %v src.workload %v, want %s:0 and pod", rec["src.addr"], rec["src.workload"], podAddr)
	}
	// Another identity from that address: the rule on the address still
	// applies, and the address's workload is not named as the source.
	e.dialFrom(t, e.client, podAddr, netip.AddrPort{})
	rec = e.lastRecord(t)
	if rec["src.addr"] != podAddr.String()+":0" || rec["src.workload"] == "pod" || rec["src.identity"] != e.client.String() {
		t.Errorf("access log src.addr %v src.workload %v src.identity %v, want %s:0, not pod, %s", rec["src.addr"], rec["src.workload"], rec["src.identity"], podAddr, e.client)
	}
}

// TestInboundAccessLogIdentity: the access-log line of an inbound HBONE
// connection names the verified peer as src.identity, the destination
// workload's identity, both workloads and the HBONE address.
func TestInboundAccessLogIdentity(t *testing.T) {
	e := newInboundEnv(t)
	e.dial(t, e.client, netip.AddrPortFrom(clientAddr, 40010))
	e.nextDial(t)
	rec := e.lastRecord(t)
	want := map[string]string{
		"src.identity":   e.client.String(),
		"dst.identity":   e.server.String(),
		"src.workload":   "client",
		"src.namespace":  "a",
		"dst.workload":   "server",
		"dst.namespace":  "b",
		"src.addr":       "198.18.5.1:40010",
		"dst.addr":       targetServer.String(),
		"dst.hbone_addr": e.endpoint.String(),
		"direction":      "inbound",
		"route":          "hbone",
		"response_flags": "CONNECT",
	}
	for k, v := range want {
		if got, _ := rec[k].(string); got != v {
			t.Errorf("access log %s = %q, want %q", k, got, v)
		}
	}
	// The peer is another identity than the forwarded address claims:
	// src.identity stays the verified peer's, and the source workload is
	// the tunnel's (not the one the header named).
	e.dial(t, e.other, netip.AddrPortFrom(clientAddr, 40011))
	e.nextDial(t)
	rec = e.lastRecord(t)
	if got := rec["src.identity"]; got != e.other.String() {
		t.Errorf("access log src.identity = %v, want the verified peer %s", got, e.other)
	}
	if got := rec["src.workload"]; got == "client" {
		t.Errorf("access log src.workload = %v: the unverified forwarded claim was believed", got)
	}
	if got := e.opened(t, "CONNECT"); got != 1 {
		t.Errorf("istio_tcp_connections_opened_total for a/client -> b/server CONNECT = %v, want 1", got)
	}
}

// counterValue reads one counter of a metrics vector by its labels.
func counterValue(t *testing.T, m *metrics.Metrics, name string, c *metrics.Conn) float64 {
	t.Helper()
	fams, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"reporter": c.Reporter, "source_workload": c.Src.Workload, "source_workload_namespace": c.Src.Namespace,
		"source_principal": c.Src.Principal, "destination_workload": c.Dst.Workload,
		"destination_workload_namespace": c.Dst.Namespace, "destination_principal": c.Dst.Principal,
		"destination_service": c.DstService.Hostname, "destination_service_name": c.DstService.Name,
		"destination_service_namespace": c.DstService.Namespace, "connection_security_policy": c.SecurityPolicy, "response_flags": c.ResponseFlags,
	}
	for k, v := range want {
		if v == "" {
			want[k] = "unknown"
		}
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	metric:
		for _, mt := range f.GetMetric() {
			for _, l := range mt.GetLabel() {
				if v, ok := want[l.GetName()]; ok && v != l.GetValue() {
					continue metric
				}
			}
			return mt.GetCounter().GetValue()
		}
	}
	return 0
}
