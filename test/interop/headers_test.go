package interop

import (
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	istiohbone "istio.io/istio/pkg/hbone"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/protocols/hbone"
)

// The request metadata of a tunnelled connection, as ztunnel sends it: the
// original client, the service it called, the source workload's baggage and
// a W3C trace context.
var (
	testForwarded = hbone.Forwarded{
		For:  netip.MustParseAddrPort("10.1.2.3:45678"),
		Host: "echo.default.svc.cluster.local",
	}
	testBaggage = hbone.Baggage{
		"k8s.cluster.name":    "Kubernetes",
		"k8s.namespace.name":  "default",
		"k8s.deployment.name": "sleep",
		"service.name":        "sleep",
		"service.version":     "v1",
	}
	testTraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
)

// The forwarded, baggage and traceparent headers of our client arrive at
// Istio's server intact, as its net/http stack parses them, and nothing else
// comes with them; baggage and traceparent parse with OpenTelemetry's W3C
// parsers (Istio's own tracing library). Over IPv4 and IPv6, where the
// :authority is [ip]:port and Istio's server dials it as given.
func TestHeadersOurClientAtIstioServer(t *testing.T) {
	for _, tc := range []struct {
		name, listen string
		forwarded    hbone.Forwarded
		wantFwd      string
	}{
		{"ipv4", "127.0.0.1:0", testForwarded, `for="10.1.2.3:45678";host=echo.default.svc.cluster.local`},
		{"ipv6", "[::1]:0", hbone.Forwarded{For: netip.MustParseAddrPort("[fd00::1:2]:45678")}, `for="[fd00::1:2]:45678"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newMesh(t)
			workload := startWorkload(t, "tcp", tc.listen, echo)
			is := startIstioServer(t, m, "tcp", tc.listen)
			client := ourClient(t, m)
			r := dialReq(is.addr, workload, istioServerID)
			r.Forwarded, r.Baggage, r.TraceParent = tc.forwarded, testBaggage, testTraceParent
			conn, err := ourDial(t, client, r)
			if err != nil {
				t.Fatalf("our client via Istio's server to %s: %v", workload, err)
			}
			defer conn.Close()
			// The stream works: the :authority was dialled.
			if _, err := conn.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			conn.CloseWrite()
			got, err := within(t, "echo", func() ([]byte, error) { return io.ReadAll(conn) })
			if err != nil || string(got) != "ping" {
				t.Fatalf("echo via Istio's server: %q, %v", got, err)
			}

			req := is.next(t)
			if req.Host != workload.String() {
				t.Errorf(":authority at Istio's server is %q, want %q", req.Host, workload)
			}
			want := http.Header{
				"Forwarded":   {tc.wantFwd},
				"Baggage":     {testBaggage.String()},
				"Traceparent": {testTraceParent},
			}
			if !equalHeaders(req.Header, want) {
				t.Errorf("headers at Istio's server:\n got %q\nwant %q", req.Header, want)
			}
			checkW3C(t, req.Header)
		})
	}
}

// checkW3C parses baggage and traceparent with OpenTelemetry.
func checkW3C(t *testing.T, h http.Header) {
	t.Helper()
	b, err := baggage.Parse(h.Get("Baggage"))
	if err != nil {
		t.Errorf("OpenTelemetry cannot parse our baggage %q: %v", h.Get("Baggage"), err)
	} else {
		if n := b.Len(); n != len(testBaggage) {
			t.Errorf("OpenTelemetry parses %d baggage members, want %d", n, len(testBaggage))
		}
		for k, v := range testBaggage {
			if got := b.Member(k).Value(); got != v {
				t.Errorf("baggage %s = %q per OpenTelemetry, want %q", k, got, v)
			}
		}
	}
	ctx := propagation.TraceContext{}.Extract(context.Background(), propagation.HeaderCarrier(h))
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() || !sc.IsRemote() || sc.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" ||
		sc.SpanID().String() != "00f067aa0ba902b7" || !sc.IsSampled() {
		t.Errorf("OpenTelemetry reads traceparent %q as %+v", h.Get("Traceparent"), sc)
	}
}

func equalHeaders(a, b http.Header) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if !slices.Equal(v, b[k]) {
			return false
		}
	}
	return true
}

// What Istio's dialer sends, as our server's handler sees it: no
// forwarded, baggage or traceparent, even when its Config.Headers holds
// them (this version of pkg/hbone never copies Config.Headers into the
// request), only user-agent and accept-encoding (Go's defaults, meaningless
// for CONNECT). Our server accepts the request without them.
func TestHeadersIstioDialerAtOurServer(t *testing.T) {
	m := newMesh(t)
	workload := startWorkload(t, "tcp", "127.0.0.1:0", echo)
	reqs := make(chan *hbone.Request, 1)
	srv := startOurServer(t, m, dialingHandler(reqs, nil))
	cert := m.istioCert(t, istioClientID)
	d := istiohbone.NewDialer(istiohbone.Config{
		ProxyAddress: srv.addr.String(),
		TLS:          m.istioClientTLS(&cert, meshtunServerID, nil),
		Headers: http.Header{
			"Forwarded":   {testForwarded.String()},
			"Baggage":     {testBaggage.String()},
			"Traceparent": {testTraceParent},
		},
	})
	c, err := istioDial(t, d, workload)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	req := wait(t, "handler request", reqs)
	want := http.Header{"User-Agent": {"Go-http-client/2.0"}, "Accept-Encoding": {"gzip"}}
	if !equalHeaders(req.Header, want) {
		t.Errorf("Istio's dialer sent headers %q, want %q (did Istio start sending Config.Headers? then check them here)", req.Header, want)
	}
	if !req.Forwarded.IsZero() || req.Baggage != nil || req.TraceParent != "" {
		t.Errorf("our server parsed forwarded %v, baggage %v, traceparent %q from no headers", req.Forwarded, req.Baggage, req.TraceParent)
	}
	if req.Target != workload {
		t.Errorf("target %s, want %s", req.Target, workload)
	}
}

// The CONNECT as it is on the wire, decoded from HPACK by a bare HTTP/2
// endpoint, from our client and from Istio's dialer for the same target:
// the same pseudo-headers (:method CONNECT, :authority ip:port, neither
// :scheme nor :path); our regular headers are exactly forwarded, baggage
// and traceparent, Istio's only user-agent and accept-encoding. Also our
// client's SETTINGS and connection window, which are ztunnel's (stream
// window 4 MiB, connection window 16 MiB, frames up to 1 MiB); Istio's
// dialer keeps x/net's defaults (stream window 4 MiB, connection window
// 1 GiB, frames up to 16 KiB), logged for comparison.
func TestWireCONNECTOurClientVsIstioDialer(t *testing.T) {
	m := newMesh(t)
	target := netip.MustParseAddrPort("127.0.0.1:8080")
	capSrv := startCaptureServer(t, m.istioServerTLS(m.istioCert(t, istioServerID)))

	client := ourClient(t, m)
	r := dialReq(capSrv.addr, target, istioServerID)
	r.Forwarded, r.Baggage, r.TraceParent = testForwarded, testBaggage, testTraceParent
	conn, err := ourDial(t, client, r)
	if err != nil {
		t.Fatalf("our client to the capture server: %v", err)
	}
	ours := wait(t, "our CONNECT", capSrv.got)
	conn.Close()

	cert := m.istioCert(t, istioClientID)
	ic, err := istioDial(t, istioDialer(m, capSrv.addr, &cert, istioServerID, nil), target)
	if err != nil {
		t.Fatalf("Istio's dialer to the capture server: %v", err)
	}
	istio := wait(t, "Istio's CONNECT", capSrv.got)
	ic.Close()

	t.Logf("our CONNECT:    %s", ours)
	t.Logf("Istio's CONNECT: %s", istio)

	if p, q := ours.pseudo(), istio.pseudo(); !slices.Equal(p, q) {
		t.Errorf("pseudo-headers differ: ours %q, Istio's %q", p, q)
	}
	wantPseudo := []string{":authority=" + target.String(), ":method=CONNECT"}
	if p := ours.pseudo(); !slices.Equal(p, wantPseudo) {
		t.Errorf("our pseudo-headers %q, want %q", p, wantPseudo)
	}
	wantOurs := []string{
		"baggage=" + testBaggage.String(),
		`forwarded=for="10.1.2.3:45678";host=echo.default.svc.cluster.local`,
		"traceparent=" + testTraceParent,
	}
	if h := ours.regular(); !slices.Equal(h, wantOurs) {
		t.Errorf("our headers %q, want %q", h, wantOurs)
	}
	if h := istio.regular(); !slices.Equal(h, []string{"accept-encoding=gzip", "user-agent=Go-http-client/2.0"}) {
		t.Errorf("Istio's headers %q, want only accept-encoding and user-agent", h)
	}
	if !ours.endHeadersNoEndStream || !istio.endHeadersNoEndStream {
		t.Errorf("CONNECT HEADERS must leave the stream open: ours %v, Istio's %v", ours.endHeadersNoEndStream, istio.endHeadersNoEndStream)
	}

	for id, want := range map[http2.SettingID]uint32{
		http2.SettingEnablePush:        0,
		http2.SettingInitialWindowSize: hbone.StreamWindow,
		http2.SettingMaxFrameSize:      hbone.MaxFrameSize,
	} {
		if got, ok := ours.settings[id]; !ok || got != want {
			t.Errorf("our SETTINGS %s = %d (sent: %v), want %d", id, got, ok, want)
		}
	}
	if w := 65535 + ours.connWindowIncrement; w != hbone.ConnWindow {
		t.Errorf("our connection window is %d, want %d", w, hbone.ConnWindow)
	}
}

// capturedConnect is what a client sent on a connection up to and with its
// first HEADERS frame.
type capturedConnect struct {
	settings              map[http2.SettingID]uint32
	connWindowIncrement   uint32
	fields                []hpack.HeaderField
	endHeadersNoEndStream bool
}

func (c capturedConnect) pseudo() []string {
	var s []string
	for _, f := range c.fields {
		if f.IsPseudo() {
			s = append(s, f.Name+"="+f.Value)
		}
	}
	slices.Sort(s)
	return s
}

func (c capturedConnect) regular() []string {
	var s []string
	for _, f := range c.fields {
		if !f.IsPseudo() {
			s = append(s, f.Name+"="+f.Value)
		}
	}
	slices.Sort(s)
	return s
}

func (c capturedConnect) String() string {
	var b strings.Builder
	for _, f := range c.fields {
		b.WriteString(f.Name + ": " + f.Value + "; ")
	}
	ids := make([]http2.SettingID, 0, len(c.settings))
	for id := range c.settings {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	b.WriteString("SETTINGS")
	for _, id := range ids {
		b.WriteString(" " + id.String() + "=" + strconv.FormatUint(uint64(c.settings[id]), 10))
	}
	b.WriteString("; connection WINDOW_UPDATE +" + strconv.FormatUint(uint64(c.connWindowIncrement), 10))
	return b.String()
}

// captureServer is a bare HTTP/2 endpoint over TLS: it records the client's
// SETTINGS, connection WINDOW_UPDATEs and first HEADERS, answers :status
// 200, and then reads and drops frames until the client goes.
type captureServer struct {
	addr netip.AddrPort
	got  chan capturedConnect
}

func startCaptureServer(t *testing.T, cfg *tls.Config) *captureServer {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	cs := &captureServer{addr: addrOf(t, ln.Addr()), got: make(chan capturedConnect, 4)}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				cs.serve(t, c)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return cs
}

func (cs *captureServer) serve(t *testing.T, c net.Conn) {
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(c, preface); err != nil || string(preface) != http2.ClientPreface {
		t.Errorf("capture server: client preface %q, %v", preface, err)
		return
	}
	fr := http2.NewFramer(c, c)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	fr.MaxHeaderListSize = 64 << 10
	if err := fr.WriteSettings(); err != nil {
		return
	}
	cap := capturedConnect{settings: map[http2.SettingID]uint32{}}
	sent := false
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if f.IsAck() {
				continue
			}
			if !sent {
				f.ForeachSetting(func(s http2.Setting) error {
					cap.settings[s.ID] = s.Val
					return nil
				})
			}
			fr.WriteSettingsAck()
		case *http2.WindowUpdateFrame:
			if f.StreamID == 0 && !sent {
				cap.connWindowIncrement += f.Increment
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				fr.WritePing(true, f.Data)
			}
		case *http2.MetaHeadersFrame:
			if sent {
				continue
			}
			sent = true
			cap.fields = f.Fields
			cap.endHeadersNoEndStream = f.HeadersEnded() && !f.StreamEnded()
			var buf bytes.Buffer
			enc := hpack.NewEncoder(&buf)
			enc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
			fr.WriteHeaders(http2.HeadersFrameParam{
				StreamID:      f.StreamID,
				BlockFragment: buf.Bytes(),
				EndHeaders:    true,
			})
			cs.got <- cap
		}
	}
}

// Istio's server (ztunnel's behaviour: the TCP peer is the source) sees
// the address our client dialled from (hbone.DialRequest.From, what a
// meshtun node sets to the client pod's address), and the forwarded
// header is sent alongside, unchanged.
func TestPeerAddressOurClientAtIstioServer(t *testing.T) {
	m := newMesh(t)
	workload := startWorkload(t, "tcp", "127.0.0.1:0", echo)
	is := startIstioServer(t, m, "tcp", "127.0.0.1:0")
	client, err := hbone.NewClient(hbone.ClientConfig{
		TLS: func(src, dst spiffeid.ID) (*tls.Config, error) {
			return identity.ClientTLS(m.src.Workload(src), dst), nil
		},
		DialFrom: func(ctx context.Context, from netip.Addr, ep netip.AddrPort) (net.Conn, error) {
			d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(from, 0))}
			return d.DialContext(ctx, "tcp", ep.String())
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	for _, from := range []netip.Addr{{}, netip.MustParseAddr("127.0.0.2")} {
		r := dialReq(is.addr, workload, istioServerID)
		r.From = from
		r.Forwarded = hbone.Forwarded{For: netip.MustParseAddrPort("127.0.0.2:45678")}
		conn, err := ourDial(t, client, r)
		if err != nil {
			t.Fatalf("our client from %v via Istio's server: %v", from, err)
		}
		conn.Close()
		req := is.next(t)
		peer, err := netip.ParseAddrPort(req.RemoteAddr)
		if err != nil {
			t.Fatalf("Istio's server's RemoteAddr %q: %v", req.RemoteAddr, err)
		}
		want := netip.MustParseAddr("127.0.0.1")
		if from.IsValid() {
			want = from
		}
		if peer.Addr() != want {
			t.Errorf("dialled from %v: Istio's server sees the peer %s, want %s", from, peer, want)
		}
		if got := req.Header.Get("Forwarded"); got != `for="127.0.0.2:45678"` {
			t.Errorf("forwarded at Istio's server: %q", got)
		}
	}
}
