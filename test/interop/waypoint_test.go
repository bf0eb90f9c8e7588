package interop

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	istiohbone "istio.io/istio/pkg/hbone"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/metrics"
	"github.com/meshtun/meshtun/mesh/proxy"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/stack"
	"github.com/meshtun/meshtun/stack/classify"
	"github.com/meshtun/meshtun/test/fixture"
	"github.com/meshtun/meshtun/test/interop/internal/istioid"
)

// waypointID is the stand-in waypoint's identity.
var waypointID = spiffeid.RequireFromPath(td, "/ns/istio/sa/waypoint")

// The addresses of the waypoint test's model. None is configured
// anywhere: meshtun's HBONE client, the waypoint and the destination's
// node reach them through wpNet, which maps each to a loopback listener.
var (
	wpClient    = netip.MustParseAddr("198.18.1.11") // meshtun/client, node n1 (meshtun's node under test)
	wpPod       = netip.MustParseAddr("198.18.2.5")  // istio/waypoint, node n2
	wpImpostor  = netip.MustParseAddr("198.18.2.6")  // istio/waypoint-bad: presents the wrong identity
	wpServer    = netip.MustParseAddr("198.18.2.20") // meshtun/server, node n2, behind the waypoint
	wpVIP       = netip.MustParseAddrPort("198.19.0.1:80")
	wpVIPNx     = netip.MustParseAddrPort("198.19.0.3:80")
	wpVIPBad    = netip.MustParseAddrPort("198.19.0.4:80")
	wpServerApp = netip.AddrPortFrom(wpServer, 8080)
)

// wpNet is the test's network: where each model address:port listens on
// loopback.
type wpNet struct {
	mu sync.Mutex
	m  map[netip.AddrPort]netip.AddrPort
}

func (n *wpNet) set(model, real netip.AddrPort) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.m == nil {
		n.m = map[netip.AddrPort]netip.AddrPort{}
	}
	n.m[model] = real
}

func (n *wpNet) dial(ctx context.Context, model netip.AddrPort) (net.Conn, error) {
	n.mu.Lock()
	real, ok := n.m[model]
	n.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("test network: nothing at %s", model)
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", real.String())
}

// waypointStandIn is the stand-in waypoint: Istio's Go HBONE server
// (pkg/hbone.NewServer) with the waypoint's certificate. In front of its
// CONNECT handler it records each request (the :authority and the
// client's verified identity) and resolves the original destination as a
// waypoint would (a service VIP to its endpoint); Istio's handler then
// connects to a local forwarder that carries the stream on over HBONE to
// the destination's node with Istio's Go HBONE dialer, presenting the
// waypoint's identity.
type waypointStandIn struct {
	reqs chan istioRequest
	addr netip.AddrPort
}

func startWaypoint(t *testing.T, m *mesh, id spiffeid.ID, endpoints map[string]netip.AddrPort, n *wpNet) *waypointStandIn {
	t.Helper()
	cert := m.istioCert(t, id)
	// The forwarder: one listener per endpoint, each connection carried
	// over HBONE (Istio's dialer) to the endpoint's node, :authority the
	// endpoint.
	forwarders := map[string]string{}
	for host, ep := range endpoints {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		forwarders[host] = ln.Addr().String()
		node := netip.AddrPortFrom(ep.Addr(), hbone.Port)
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				go func() {
					defer c.Close()
					n.mu.Lock()
					real := n.m[node]
					n.mu.Unlock()
					d := istiohbone.NewDialer(istiohbone.Config{ProxyAddress: real.String(), TLS: m.istioClientTLS(&cert, meshtunServerID, nil)})
					up, err := d.Dial("tcp", ep.String())
					if err != nil {
						return
					}
					defer up.Close()
					done := make(chan struct{}, 2)
					go func() { io.Copy(up, c); done <- struct{}{} }()
					go func() { io.Copy(c, up); done <- struct{}{} }()
					<-done
				}()
			}
		}()
	}

	srv := istiohbone.NewServer()
	srv.Protocols.SetHTTP2(true)
	srv.TLSConfig = m.istioServerTLS(cert)
	srv.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		return context.WithValue(ctx, connKey{}, c)
	}
	w := &waypointStandIn{reqs: make(chan istioRequest, 16)}
	connect := srv.Handler
	srv.Handler = http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		ir := istioRequest{RemoteAddr: r.RemoteAddr, Method: r.Method, Host: r.Host, Proto: r.Proto}
		if tc, ok := r.Context().Value(connKey{}).(*tls.Conn); ok {
			if cs := tc.ConnectionState(); len(cs.PeerCertificates) > 0 {
				ir.PeerID, _ = istioid.PeerID(cs.PeerCertificates[0].Raw)
			}
		}
		w.reqs <- ir
		fwd, ok := forwarders[r.Host]
		if !ok {
			rw.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		r.Host = fwd
		connect.ServeHTTP(rw, r)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.ServeTLS(ln, "", "") }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("the stand-in waypoint: %v", err)
		}
	})
	w.addr = addrOf(t, ln.Addr())
	return w
}

// received returns the requests the waypoint has seen so far.
func (w *waypointStandIn) received() []istioRequest {
	var out []istioRequest
	for {
		select {
		case r := <-w.reqs:
			out = append(out, r)
		default:
			return out
		}
	}
}

// linkDevices carries every packet one device's stack writes to the
// other's, both ways, until the test ends: the client pod's netstack
// and the node's, back to back.
func linkDevices(t *testing.T, a, b *fixture.MemDevice) {
	t.Helper()
	done := make(chan struct{})
	var wg sync.WaitGroup
	pump := func(from, to *fixture.MemDevice) {
		defer wg.Done()
		for {
			select {
			case p := <-from.Out:
				select {
				case to.In <- p:
				case <-done:
					return
				}
			case <-done:
				return
			}
		}
	}
	wg.Add(2)
	go pump(a, b)
	go pump(b, a)
	t.Cleanup(func() { close(done); wg.Wait() })
}

func newStack(t *testing.T, dev *fixture.MemDevice, h stack.TCPHandler) *stack.Stack {
	t.Helper()
	cls := classify.New(classify.Config{Policy: classify.PolicyFunc(func(_, _ netip.AddrPort) bool { return true })})
	st, err := stack.New(stack.Config{Device: dev, Classifier: cls, Logger: zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close(); st.Close() })
	if err := st.Start(h); err != nil {
		t.Fatal(err)
	}
	return st
}

// TestWaypointClientSide runs meshtun's node proxy (mesh/proxy on its
// netstack, fed by a client pod's netstack back to back) with a model in
// which a service and a workload have a waypoint, and a stand-in
// waypoint built on Istio's Go pkg/hbone (server and dialer; not Envoy)
// in front of the destination's node (meshtun's HBONE server):
//
//   - the client's bytes reach the destination through the waypoint
//     only: the waypoint sees the original destination in :authority
//     (the VIP and port for the service, the pod's address and port for
//     the workload) and the client's identity; the destination's node
//     sees the waypoint's identity, never the client's;
//   - a waypoint that presents another identity is refused (the client
//     is reset, nothing reaches the destination);
//   - a waypoint that cannot be resolved resets the client, and the
//     access log says why (response_flags UH).
func TestWaypointClientSide(t *testing.T) {
	m := newMesh(t)
	n := &wpNet{}

	// The destination application and its node.
	app := startWorkload(t, "tcp", "127.0.0.1:0", echo)
	nodeReqs := make(chan *hbone.Request, 16)
	dstNode := startOurServer(t, m, hbone.HandlerFunc(func(ctx context.Context, r *hbone.Request) (net.Conn, error) {
		nodeReqs <- r
		if r.Target != wpServerApp {
			return nil, fmt.Errorf("%w: no workload at %s", hbone.ErrUnreachable, r.Target)
		}
		var d net.Dialer
		return d.DialContext(ctx, "tcp", app.String())
	}))
	n.set(netip.AddrPortFrom(wpServer, hbone.Port), dstNode.addr)

	// The waypoint (a VIP or the pod's address: to the pod's port 8080)
	// and an impostor at another address.
	endpoints := map[string]netip.AddrPort{wpVIP.String(): wpServerApp, wpServerApp.String(): wpServerApp, wpVIPBad.String(): wpServerApp}
	wp := startWaypoint(t, m, waypointID, endpoints, n)
	n.set(netip.AddrPortFrom(wpPod, hbone.Port), wp.addr)
	bad := startWaypoint(t, m, istioServerID, endpoints, n)
	n.set(netip.AddrPortFrom(wpImpostor, hbone.Port), bad.addr)

	// The model, as istiod's conversion gives it.
	ws := []*registry.Workload{
		{Name: "client", Namespace: "meshtun", ServiceAccount: "client", Node: "n1", InMesh: true, Addresses: []netip.Addr{wpClient}},
		{Name: "waypoint", Namespace: "istio", ServiceAccount: "waypoint", Node: "n2", InMesh: true, Addresses: []netip.Addr{wpPod},
			Labels: map[string]string{"gateway.networking.k8s.io/gateway-name": "waypoint"}},
		{Name: "waypoint-bad", Namespace: "istio", ServiceAccount: "waypoint", Node: "n2", InMesh: true, Addresses: []netip.Addr{wpImpostor}},
		{Name: "server", Namespace: "meshtun", ServiceAccount: "server", Node: "n2", InMesh: true, Addresses: []netip.Addr{wpServer},
			Labels: map[string]string{"app": "server"}, Waypoint: &registry.Waypoint{Addr: wpPod, Port: 15008}},
	}
	ports := []registry.ServicePort{{Port: 80, TargetPort: 8080}}
	svcs := []*registry.Service{
		{Name: "waypoint", Namespace: "istio", VIPs: []netip.Addr{netip.MustParseAddr("198.19.0.50")},
			Ports: []registry.ServicePort{{Port: 15021}, {Port: 15008}}, Selector: map[string]string{"gateway.networking.k8s.io/gateway-name": "waypoint"}},
		{Name: "server", Namespace: "meshtun", VIPs: []netip.Addr{wpVIP.Addr()}, Ports: ports, Selector: map[string]string{"app": "server"},
			Waypoint: &registry.Waypoint{Hostname: "waypoint.istio.svc.cluster.local", Namespace: "istio", Port: 15008}},
		{Name: "server-nx", Namespace: "meshtun", VIPs: []netip.Addr{wpVIPNx.Addr()}, Ports: ports, Selector: map[string]string{"app": "server"},
			Waypoint: &registry.Waypoint{Hostname: "nowhere.istio.svc.cluster.local", Namespace: "istio", Port: 15008}},
		{Name: "server-bad", Namespace: "meshtun", VIPs: []netip.Addr{wpVIPBad.Addr()}, Ports: ports, Selector: map[string]string{"app": "server"},
			Waypoint: &registry.Waypoint{Addr: wpImpostor, Port: 15008}},
	}
	snap, err := registry.Build(registry.Model{TrustDomain: td, Workloads: ws, Services: svcs})
	if err != nil {
		t.Fatal(err)
	}

	// meshtun's node n1: the proxy on its netstack, its HBONE client on
	// the test network.
	hc, err := hbone.NewClient(hbone.ClientConfig{
		TLS: func(src, dst spiffeid.ID) (*tls.Config, error) {
			return identity.ClientTLS(m.src.Workload(src), dst), nil
		},
		Dial: func(ctx context.Context, _, addr string) (net.Conn, error) {
			return n.dial(ctx, netip.MustParseAddrPort(addr))
		},
		Logger: zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hc.Close() })
	nodeDev, podDev := fixture.NewMemDevice(0, 1024), fixture.NewMemDevice(0, 1024)
	linkDevices(t, podDev, nodeDev)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	access := &fixture.SyncBuffer{}
	var p *proxy.Proxy
	nodeStack := newStack(t, nodeDev, func(r *stack.TCPRequest) { p.HandleTCP(r) })
	p, err = proxy.New(ctx, proxy.Config{
		Node: "n1", Registry: registry.New(snap), HBONE: hc, Metrics: metrics.New(),
		Logger: zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel), AccessLog: zerolog.New(access),
		ConnectTimeout: testTimeout, Netstack: nodeStack,
	})
	if err != nil {
		t.Fatal(err)
	}
	// The client pod's own netstack: it opens connections, takes none.
	podStack := newStack(t, podDev, func(r *stack.TCPRequest) { r.Reject() })

	dial := func(dst netip.AddrPort) (net.Conn, error) {
		return within(t, "the client's connect to "+dst.String(), func() (net.Conn, error) {
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			c, err := podStack.DialTCP(ctx, netip.AddrPortFrom(wpClient, 0), dst)
			if err != nil {
				return nil, err
			}
			return c, nil
		})
	}
	roundTrip := func(what string, dst netip.AddrPort) {
		t.Helper()
		c, err := dial(dst)
		if err != nil {
			t.Fatalf("%s: connect: %v", what, err)
		}
		defer c.Close()
		msg := []byte("through the waypoint to " + dst.String())
		if _, err := c.Write(msg); err != nil {
			t.Fatalf("%s: write: %v", what, err)
		}
		got, err := within(t, what+": echo", func() ([]byte, error) {
			b := make([]byte, len(msg))
			_, err := io.ReadFull(c, b)
			return b, err
		})
		if err != nil || string(got) != string(msg) {
			t.Fatalf("%s: echo %q, %v; want %q", what, got, err, msg)
		}
	}

	for _, c := range []struct {
		what string
		dst  netip.AddrPort
	}{
		{"to the service's VIP", wpVIP},
		{"to the workload's address", wpServerApp},
	} {
		roundTrip(c.what, c.dst)
		// The waypoint got the original destination and the client.
		r := wait(t, c.what+": the waypoint's request", wp.reqs)
		if r.Method != "CONNECT" || r.Host != c.dst.String() || r.PeerID != meshtunClientID.String() {
			t.Errorf("%s: the waypoint got %s %s from %q, want CONNECT %s from %s", c.what, r.Method, r.Host, r.PeerID, c.dst, meshtunClientID)
		}
		// The destination's node got it from the waypoint.
		nr := wait(t, c.what+": the destination node's request", nodeReqs)
		if nr.Peer != waypointID || nr.Target != wpServerApp {
			t.Errorf("%s: the destination's node got %s from %s, want %s from the waypoint %s", c.what, nr.Target, nr.Peer, wpServerApp, waypointID)
		}
		if more := wp.received(); len(more) > 0 {
			t.Errorf("%s: the waypoint got more requests: %+v", c.what, more)
		}
		rec := access.WaitLine(t, func(l map[string]any) bool {
			return l["dst.addr"] == c.dst.String() && l["message"] == "connection complete"
		})
		if rec["route"] != "waypoint" || rec["dst.hbone_addr"] != netip.AddrPortFrom(wpPod, hbone.Port).String() || rec["dst.identity"] != waypointID.String() {
			t.Errorf("%s: access log %v, want route waypoint to %s:15008 (%s)", c.what, rec, wpPod, waypointID)
		}
	}

	// A waypoint with the wrong identity: refused before any request.
	if c, err := dial(wpVIPBad); err == nil {
		c.Close()
		t.Error("the connection through a waypoint with the wrong identity opened")
	}
	rec := access.WaitLine(t, func(l map[string]any) bool { return l["dst.addr"] == wpVIPBad.String() })
	if e, _ := rec["error"].(string); rec["message"] != "connection refused" || !strings.Contains(e, waypointID.String()) {
		t.Errorf("wrong waypoint identity: access log %v, want a refusal naming the expected identity %s", rec, waypointID)
	}
	if got := bad.received(); len(got) > 0 {
		t.Errorf("the impostor waypoint got requests: %+v", got)
	}

	// An unresolvable waypoint: reset, nothing sent anywhere.
	if c, err := dial(wpVIPNx); err == nil {
		c.Close()
		t.Error("the connection to a service whose waypoint does not resolve opened")
	}
	rec = access.WaitLine(t, func(l map[string]any) bool { return l["dst.addr"] == wpVIPNx.String() })
	if e, _ := rec["error"].(string); rec["response_flags"] != "UH" || !strings.Contains(e, "nowhere.istio.svc.cluster.local") {
		t.Errorf("unresolvable waypoint: access log %v, want UH naming the waypoint", rec)
	}

	// Nothing else reached the waypoint or the destination's node.
	if got := wp.received(); len(got) > 0 {
		t.Errorf("the waypoint got more requests: %+v", got)
	}
	select {
	case r := <-nodeReqs:
		t.Errorf("the destination's node got another request: %s from %s", r.Target, r.Peer)
	default:
	}
}
