package hbone

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/net/http2"
)

var td = spiffeid.RequireTrustDomainFromString("cluster.local")

func testLogger(t testing.TB) zerolog.Logger {
	return zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel)
}

// identities is a CA and a node Source holding a few workload identities.
type identities struct {
	src              *identity.Source
	client, server   spiffeid.ID
	client2, server2 spiffeid.ID
	clientTLS        func(src, dst spiffeid.ID) (*tls.Config, error)
	serverTLS        *tls.Config
	serverFor        spiffeid.ID // identity the server presents
	serverForMu      sync.Mutex
}

func newIdentities(t testing.TB) *identities {
	t.Helper()
	ca, err := identity.OpenCA(identity.CAConfig{Dir: t.TempDir(), TrustDomain: td, SVIDTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	src, err := identity.NewSource(identity.SourceConfig{Issuer: ca, Bundle: ca.Bundle(), TrustDomain: td})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(src.Close)
	id := &identities{src: src}
	for _, x := range []struct {
		p      *spiffeid.ID
		ns, sa string
	}{{&id.client, "a", "client"}, {&id.server, "b", "server"}, {&id.client2, "a", "client2"}, {&id.server2, "b", "server2"}} {
		*x.p, err = identity.WorkloadID(td, x.ns, x.sa)
		if err != nil {
			t.Fatal(err)
		}
		if err := src.Add(context.Background(), *x.p); err != nil {
			t.Fatal(err)
		}
	}
	id.serverFor = id.server
	id.clientTLS = func(s, d spiffeid.ID) (*tls.Config, error) {
		return identity.ClientTLS(src.Workload(s), d), nil
	}
	id.serverTLS = identity.ServerTLS(src, td, func(netip.Addr) (spiffeid.ID, bool) {
		id.serverForMu.Lock()
		defer id.serverForMu.Unlock()
		return id.serverFor, true
	})
	return id
}

// fixture is an HBONE server on loopback and a client for it.
type fixture struct {
	*identities
	srv      *Server
	endpoint netip.AddrPort
	cl       *Client
}

// fixtureOpt adjusts the server's and client's configurations.
type fixtureOpt func(*ServerConfig, *ClientConfig)

func newFixture(t testing.TB, h Handler, opts ...fixtureOpt) *fixture {
	t.Helper()
	ids := newIdentities(t)
	scfg := ServerConfig{TLS: ids.serverTLS, Handler: h, Logger: testLogger(t)}
	cfg := ClientConfig{TLS: ids.clientTLS, Logger: testLogger(t)}
	for _, o := range opts {
		o(&scfg, &cfg)
	}
	srv, err := NewServer(scfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	c, err := NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &fixture{identities: ids, srv: srv, endpoint: ln.Addr().(*net.TCPAddr).AddrPort(), cl: c}
}

func (f *fixture) dial(ctx context.Context, target netip.AddrPort) (*Conn, error) {
	return f.cl.Dial(ctx, DialRequest{Source: f.client, Destination: f.server, Endpoint: f.endpoint, Target: target})
}

// dialHandler connects to the target over TCP.
var dialHandler = HandlerFunc(func(ctx context.Context, req *Request) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", req.Target.String())
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnreachable, err)
	}
	return c, nil
})

// upstream is a TCP listener whose accepted connections tests take from
// conns.
type upstream struct {
	addr  netip.AddrPort
	conns chan *net.TCPConn
}

// stream opens a stream through f to a new upstream and returns both
// ends: the client's Conn (closed when the test ends) and the upstream's
// side of the connection the server dialled.
func (f *fixture) stream(t testing.TB) (*Conn, *net.TCPConn) {
	t.Helper()
	up := newUpstream(t)
	conn, err := f.dial(ctxTimeout(t, 5*time.Second), up.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn, up.accept(t)
}

func newUpstream(t testing.TB) *upstream {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	u := &upstream{addr: ln.Addr().(*net.TCPAddr).AddrPort(), conns: make(chan *net.TCPConn, 128)}
	go func() {
		for {
			c, err := ln.AcceptTCP()
			if err != nil {
				return
			}
			u.conns <- c
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		for {
			select {
			case c := <-u.conns:
				c.Close()
			default:
				return
			}
		}
	})
	return u
}

func (u *upstream) accept(t testing.TB) *net.TCPConn {
	t.Helper()
	select {
	case c := <-u.conns:
		t.Cleanup(func() { c.Close() })
		return c
	case <-time.After(5 * time.Second):
		t.Fatal("upstream: no connection within 5s")
		return nil
	}
}

func randomBytes(t testing.TB, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func ctxTimeout(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// readAll reads c to EOF in the background.
func readAll(r io.Reader) <-chan result {
	ch := make(chan result, 1)
	go func() {
		b, err := io.ReadAll(r)
		ch <- result{b, err}
	}()
	return ch
}

type result struct {
	data []byte
	err  error
}

func wait(t testing.TB, ch <-chan result, what string) result {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: nothing within 10s", what)
		return result{}
	}
}

func TestConnectDataBothWays(t *testing.T) {
	f := newFixture(t, dialHandler)
	conn, uc := f.stream(t)

	// Both directions at once. The upstream ends its half only after the
	// client's FIN: the other order is TestHalfCloseUpstreamFirst.
	const size = 3<<20 + 12345
	toUp, toClient := randomBytes(t, size), randomBytes(t, size)
	upGot := readAll(uc)
	clientGot := readAll(conn)
	wrote := make(chan error, 1)
	go func() {
		_, err := uc.Write(toClient)
		wrote <- err
	}()
	if n, err := conn.Write(toUp); err != nil || n != size {
		t.Fatalf("client Write = %d, %v", n, err)
	}
	if err := conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if r := wait(t, upGot, "upstream read"); r.err != nil || !bytes.Equal(r.data, toUp) {
		t.Errorf("upstream got %d bytes (%v), want the %d sent, byte-exact", len(r.data), r.err, size)
	}
	if err := <-wrote; err != nil {
		t.Fatalf("upstream write: %v", err)
	}
	uc.CloseWrite()
	if r := wait(t, clientGot, "client read"); r.err != nil || !bytes.Equal(r.data, toClient) {
		t.Errorf("client got %d bytes (%v), want the %d sent, byte-exact", len(r.data), r.err, size)
	}
	if got := conn.PeerID(); got != f.server {
		t.Errorf("PeerID = %s, want %s", got, f.server)
	}
	if got, want := conn.RemoteAddr().String(), uc.LocalAddr().String(); got != want {
		t.Errorf("RemoteAddr = %s, want the target %s", got, want)
	}
}

func TestServerFirst(t *testing.T) {
	f := newFixture(t, dialHandler)
	conn, uc := f.stream(t)
	const banner = "220 smtp.example ESMTP ready\r\n"
	if _, err := uc.Write([]byte(banner)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, len(banner))
	if _, err := io.ReadFull(conn, buf); err != nil || string(buf) != banner {
		t.Fatalf("client read %q, %v; want the banner before writing anything", buf, err)
	}
	if _, err := conn.Write([]byte("EHLO x\r\n")); err != nil {
		t.Fatal(err)
	}
	buf = make([]byte, 8)
	if _, err := io.ReadFull(uc, buf); err != nil || string(buf) != "EHLO x\r\n" {
		t.Fatalf("upstream read %q, %v", buf, err)
	}
}

// rawConnect sends one request over a plain x/net/http2 client connection,
// bypassing Client's checks.
func rawConnect(t *testing.T, f *fixture, method, authority string, h http.Header) (int, string) {
	t.Helper()
	cfg, _ := f.clientTLS(f.client, f.server)
	tc, err := tls.Dial("tcp", f.endpoint.String(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	//lint:ignore SA1019 x/net's client on a connection the test dialled: an HTTP/2 client independent of the server under test
	cc, err := (&http2.Transport{}).NewClientConn(tc)
	if err != nil {
		t.Fatal(err)
	}
	if h == nil {
		h = http.Header{}
	}
	req, _ := http.NewRequestWithContext(ctxTimeout(t, 5*time.Second), method, "https://"+authority+"/", nil)
	req.Host = authority
	req.Header = h
	if method == http.MethodConnect {
		req.URL.Scheme, req.URL.Path = "", ""
	}
	resp, err := cc.RoundTrip(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, authority, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

func TestBadRequests(t *testing.T) {
	called := make(chan *Request, 1)
	f := newFixture(t, HandlerFunc(func(ctx context.Context, req *Request) (net.Conn, error) {
		called <- req
		return nil, errors.New("handler must not be called")
	}))
	tests := []struct {
		name, method, authority string
		header                  http.Header
		status                  int
		body                    string
	}{
		{"host name authority", http.MethodConnect, "example.com:80", nil, 400, `:authority "example.com:80" is not ip:port`},
		{"no port", http.MethodConnect, "10.0.0.1", nil, 400, `:authority "10.0.0.1" is not ip:port`},
		{"port zero", http.MethodConnect, "10.0.0.1:0", nil, 400, "not a connectable address"},
		{"bad forwarded", http.MethodConnect, "10.0.0.1:80", http.Header{"Forwarded": {`for="10.0.0.2:1`}}, 400, "unterminated quoted value"},
		{"forwarded for a host name", http.MethodConnect, "10.0.0.1:80", http.Header{"Forwarded": {`for=client.example`}}, 400, "not an IP address"},
		{"GET", http.MethodGet, "10.0.0.1:80", nil, 405, "HBONE takes CONNECT"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, body := rawConnect(t, f, tt.method, tt.authority, tt.header)
			if status != tt.status || !strings.Contains(body, tt.body) {
				t.Errorf("%d %q, want %d with a body saying %q", status, body, tt.status, tt.body)
			}
		})
	}
	select {
	case req := <-called:
		t.Errorf("handler called for a bad request to %s", req.Target)
	default:
	}
}

func TestHandlerRefusals(t *testing.T) {
	closedPort := func() netip.AddrPort {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return ln.Addr().(*net.TCPAddr).AddrPort()
	}()
	f := newFixture(t, HandlerFunc(func(ctx context.Context, req *Request) (net.Conn, error) {
		switch req.Target.Port() {
		case 1001:
			return nil, fmt.Errorf("%w: DENY policy ns-b/deny-a matches %s", ErrDenied, req.Peer)
		case 1002:
			return nil, fmt.Errorf("%w: target port 1002 is not a port of the workload", ErrBadRequest)
		case 1003:
			return nil, errors.New("something unexpected")
		}
		return dialHandler(ctx, req)
	}))
	tests := []struct {
		target netip.AddrPort
		code   int
		is     error
		msg    string
	}{
		{netip.MustParseAddrPort("127.0.0.1:1001"), 401, ErrDenied, "DENY policy ns-b/deny-a matches spiffe://cluster.local/ns/a/sa/client"},
		{closedPort, 503, ErrUnreachable, "connection refused"},
		{netip.MustParseAddrPort("127.0.0.1:1002"), 400, ErrBadRequest, "not a port of the workload"},
		{netip.MustParseAddrPort("127.0.0.1:1003"), 503, ErrUnreachable, "something unexpected"},
	}
	for _, tt := range tests {
		_, err := f.dial(ctxTimeout(t, 5*time.Second), tt.target)
		var se *StatusError
		if !errors.As(err, &se) {
			t.Errorf("Dial %s: %v, want a *StatusError", tt.target, err)
			continue
		}
		if se.Code != tt.code || !errors.Is(err, tt.is) || !strings.Contains(se.Message, tt.msg) {
			t.Errorf("Dial %s: %v; want %d, errors.Is %v, message saying %q", tt.target, err, tt.code, tt.is, tt.msg)
		}
	}
	if s := f.cl.Stats(); s.Streams != 0 || s.Conns != 1 {
		t.Errorf("after refusals: %+v, want 1 connection and no streams", s)
	}
}

func TestHalfCloseClientFirst(t *testing.T) {
	f := newFixture(t, dialHandler)
	conn, uc := f.stream(t)
	if _, err := conn.Write([]byte("request")); err != nil {
		t.Fatal(err)
	}
	conn.CloseWrite()
	// The upstream sees the request and then EOF, while its own half is
	// still open.
	if r := wait(t, readAll(uc), "upstream"); r.err != nil || string(r.data) != "request" {
		t.Fatalf("upstream read %q, %v; want \"request\" then EOF", r.data, r.err)
	}
	if _, err := conn.Write([]byte("more")); err == nil {
		t.Error("Write after CloseWrite succeeded")
	}
	// The response still flows after the client's FIN.
	if _, err := uc.Write([]byte("response")); err != nil {
		t.Fatal(err)
	}
	uc.CloseWrite()
	if r := wait(t, readAll(conn), "client"); r.err != nil || string(r.data) != "response" {
		t.Fatalf("client read %q, %v; want \"response\" then EOF", r.data, r.err)
	}
}

// TestHalfCloseUpstreamFirst: the upstream's FIN ends the response at once
// (the client reads EOF while its own half is open), and the client's
// bytes after that still reach the upstream until it ends its half.
func TestHalfCloseUpstreamFirst(t *testing.T) {
	f := newFixture(t, dialHandler)
	conn, uc := f.stream(t)
	upGot := readAll(uc)
	uc.Write([]byte("bye"))
	uc.CloseWrite() // the upstream keeps reading
	// EOF arrives while the client has written nothing and keeps its half
	// open: no linger, no wait for the client.
	if r := wait(t, readAll(conn), "client EOF"); r.err != nil || string(r.data) != "bye" {
		t.Fatalf("client read %q, %v; want \"bye\" then EOF", r.data, r.err)
	}
	// The client's half is still open: what it sends now, however slowly,
	// reaches the upstream.
	var sent bytes.Buffer
	for i := range 5 {
		msg := fmt.Sprintf("chunk %02d;", i)
		if _, err := conn.Write([]byte(msg)); err != nil {
			t.Fatalf("write %d after the upstream's FIN: %v", i, err)
		}
		sent.WriteString(msg)
	}
	select {
	case r := <-upGot:
		t.Fatalf("upstream read ended (%q, %v) before the client ended its half", r.data, r.err)
	default:
	}
	if err := conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if r := wait(t, upGot, "upstream"); r.err != nil || string(r.data) != sent.String() {
		t.Errorf("upstream got %q, %v; want %q", r.data, r.err, sent.String())
	}
	// Both halves ended: the stream is gone from the pool.
	deadline := time.Now().Add(5 * time.Second)
	for f.cl.Stats().Streams != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("stream still counted after both halves ended: %+v", f.cl.Stats())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestHalfCloseIndependent: each direction ends exactly when its sender
// ends it, in either order, with the other direction still carrying data
// afterwards in both directions.
func TestHalfCloseIndependent(t *testing.T) {
	f := newFixture(t, dialHandler)
	up := newUpstream(t)
	for _, clientFirst := range []bool{true, false} {
		t.Run(fmt.Sprintf("clientFirst=%v", clientFirst), func(t *testing.T) {
			conn, err := f.dial(ctxTimeout(t, 5*time.Second), up.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			uc := up.accept(t)
			buf := make([]byte, 64)
			// Request and response each carry data in both phases.
			if clientFirst {
				conn.Write([]byte("q1"))
				conn.CloseWrite()
				if r := wait(t, readAll(uc), "upstream"); r.err != nil || string(r.data) != "q1" {
					t.Fatalf("upstream read %q, %v; want q1 then EOF", r.data, r.err)
				}
				uc.Write([]byte("r1"))
				n, err := io.ReadFull(conn, buf[:2])
				if err != nil || string(buf[:n]) != "r1" {
					t.Fatalf("client read %q, %v after its FIN", buf[:n], err)
				}
				uc.CloseWrite()
				if r := wait(t, readAll(conn), "client"); r.err != nil || len(r.data) != 0 {
					t.Fatalf("client read %q, %v; want EOF", r.data, r.err)
				}
			} else {
				uc.Write([]byte("r1"))
				uc.CloseWrite()
				if r := wait(t, readAll(conn), "client"); r.err != nil || string(r.data) != "r1" {
					t.Fatalf("client read %q, %v; want r1 then EOF", r.data, r.err)
				}
				conn.Write([]byte("q1"))
				n, err := io.ReadFull(uc, buf[:2])
				if err != nil || string(buf[:n]) != "q1" {
					t.Fatalf("upstream read %q, %v after its FIN", buf[:n], err)
				}
				conn.CloseWrite()
				if r := wait(t, readAll(uc), "upstream"); r.err != nil || len(r.data) != 0 {
					t.Fatalf("upstream read %q, %v; want EOF", r.data, r.err)
				}
			}
		})
	}
}

func TestResetClientToUpstream(t *testing.T) {
	f := newFixture(t, dialHandler)
	up := newUpstream(t)
	conn, err := f.dial(ctxTimeout(t, 5*time.Second), up.addr)
	if err != nil {
		t.Fatal(err)
	}
	uc := up.accept(t)
	if _, err := conn.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(uc, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	conn.Abort()
	uc.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = uc.Read(make([]byte, 1))
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("upstream read after the client's Abort: %v, want ECONNRESET (a TCP RST)", err)
	}
	if _, err := conn.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Errorf("Read after Abort: %v, want net.ErrClosed", err)
	}
}

func TestResetUpstreamToClient(t *testing.T) {
	f := newFixture(t, dialHandler)
	conn, uc := f.stream(t)
	uc.Write([]byte("partial"))
	buf := make([]byte, 7)
	if _, err := io.ReadFull(conn, buf); err != nil {
		t.Fatal(err)
	}
	uc.SetLinger(0)
	uc.Close() // TCP RST
	r := wait(t, readAll(conn), "client")
	if !errors.Is(r.err, ErrReset) {
		t.Fatalf("client read after the upstream's RST: %q, %v; want an error wrapping ErrReset", r.data, r.err)
	}
	t.Logf("client saw: %v", r.err)
	var se http2.StreamError
	if errors.As(r.err, &se) {
		t.Errorf("the http2 error type leaked: %v", se)
	}
}

func TestDialCancelReachesHandler(t *testing.T) {
	entered := make(chan struct{})
	handlerDone := make(chan error, 1)
	f := newFixture(t, HandlerFunc(func(ctx context.Context, req *Request) (net.Conn, error) {
		close(entered)
		<-ctx.Done()
		handlerDone <- ctx.Err()
		return nil, ctx.Err()
	}))
	ctx, cancel := context.WithCancel(context.Background())
	dialErr := make(chan error, 1)
	go func() {
		_, err := f.dial(ctx, netip.MustParseAddrPort("127.0.0.1:9"))
		dialErr <- err
	}()
	<-entered
	cancel()
	if err := <-dialErr; !errors.Is(err, context.Canceled) {
		t.Errorf("Dial after cancel: %v, want context.Canceled", err)
	}
	select {
	case err := <-handlerDone:
		if err == nil {
			t.Error("handler context not cancelled")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the handler's context did not end after the client cancelled the stream")
	}
}

func TestRequestReachesHandler(t *testing.T) {
	got := make(chan *Request, 1)
	f := newFixture(t, HandlerFunc(func(ctx context.Context, req *Request) (net.Conn, error) {
		got <- req
		return dialHandler(ctx, req)
	}))
	up := newUpstream(t)
	fwd := Forwarded{For: netip.MustParseAddrPort("10.1.2.3:45678"), Host: "reviews.bookinfo.svc.cluster.local"}
	bag := Baggage{"k8s.namespace.name": "bookinfo", "service.name": "product page", "service.version": "v1"}
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	conn, err := f.cl.Dial(ctxTimeout(t, 5*time.Second), DialRequest{
		Source: f.client, Destination: f.server, Endpoint: f.endpoint, Target: up.addr,
		Forwarded: fwd, Baggage: bag, TraceParent: tp,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	req := <-got
	if req.Peer != f.client {
		t.Errorf("Peer = %s, want %s", req.Peer, f.client)
	}
	if req.Target != up.addr {
		t.Errorf("Target = %s, want %s", req.Target, up.addr)
	}
	if req.Forwarded != fwd {
		t.Errorf("Forwarded = %+v, want %+v", req.Forwarded, fwd)
	}
	if len(req.Baggage) != 3 || req.Baggage["service.name"] != "product page" || req.Baggage["k8s.namespace.name"] != "bookinfo" {
		t.Errorf("Baggage = %v, want %v", req.Baggage, bag)
	}
	if req.TraceParent != tp {
		t.Errorf("TraceParent = %q", req.TraceParent)
	}
	if req.LocalAddr != f.endpoint {
		t.Errorf("LocalAddr = %s, want the endpoint %s", req.LocalAddr, f.endpoint)
	}
	if la := conn.LocalAddr().(*net.TCPAddr).AddrPort(); req.PeerAddr != la {
		t.Errorf("PeerAddr = %s, want the client's %s", req.PeerAddr, la)
	}
	if ua := req.Header.Get("User-Agent"); ua != "" {
		t.Errorf("client sent User-Agent %q", ua)
	}
}

// TestServerIdentityIsChecked: a client expecting another identity than
// the server presents does not get a stream.
func TestServerIdentityIsChecked(t *testing.T) {
	f := newFixture(t, dialHandler)
	_, err := f.cl.Dial(ctxTimeout(t, 5*time.Second), DialRequest{
		Source: f.client, Destination: f.server2, Endpoint: f.endpoint, Target: netip.MustParseAddrPort("127.0.0.1:9"),
	})
	if err == nil || !strings.Contains(err.Error(), "server is "+f.server.String()+", want "+f.server2.String()) {
		t.Fatalf("Dial expecting %s from a server presenting %s: %v", f.server2, f.server, err)
	}
}

// pipeHandler answers every request with one end of a net.Pipe whose other
// end is kept in ends.
type pipeHandler struct {
	mu   sync.Mutex
	ends []net.Conn
}

func (p *pipeHandler) Connect(ctx context.Context, req *Request) (net.Conn, error) {
	a, b := net.Pipe()
	p.mu.Lock()
	p.ends = append(p.ends, b)
	p.mu.Unlock()
	return a, nil
}

func (p *pipeHandler) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.ends {
		c.Close()
	}
}

func TestPoolOpensSecondConnectionPast100Streams(t *testing.T) {
	ph := &pipeHandler{}
	f := newFixture(t, ph)
	defer ph.close()
	const n = MaxStreamsPerConn + 1
	target := netip.MustParseAddrPort("127.0.0.1:7")
	conns := make(chan *Conn, n)
	errs := make(chan error, n)
	ctx := ctxTimeout(t, 10*time.Second)
	for range n {
		go func() {
			c, err := f.dial(ctx, target)
			if err != nil {
				errs <- err
				return
			}
			conns <- c
		}()
	}
	var all []*Conn
	for range n {
		select {
		case c := <-conns:
			all = append(all, c)
		case err := <-errs:
			t.Fatalf("Dial: %v", err)
		}
	}
	if s := f.cl.Stats(); s.Conns != 2 || s.Streams != n || s.Keys != 1 {
		t.Errorf("with %d open streams: %+v, want 2 connections", n, s)
	}
	if got := f.srv.OpenConns(); got != 2 {
		t.Errorf("server serves %d connections, want 2", got)
	}
	perConn := map[string]int{}
	for _, c := range all {
		perConn[c.LocalAddr().String()]++
	}
	for addr, k := range perConn {
		if k > MaxStreamsPerConn {
			t.Errorf("connection %s carries %d streams, over %d", addr, k, MaxStreamsPerConn)
		}
	}
	for _, c := range all {
		c.Abort()
	}
	if s := f.cl.Stats(); s.Streams != 0 {
		t.Errorf("after closing all streams: %+v", s)
	}
}

func TestPoolKeys(t *testing.T) {
	ph := &pipeHandler{}
	f := newFixture(t, ph)
	defer ph.close()
	target := netip.MustParseAddrPort("127.0.0.1:7")
	ctx := ctxTimeout(t, 5*time.Second)
	dial := func(src, dst spiffeid.ID) *Conn {
		t.Helper()
		f.serverForMu.Lock()
		f.serverFor = dst
		f.serverForMu.Unlock()
		c, err := f.cl.Dial(ctx, DialRequest{Source: src, Destination: dst, Endpoint: f.endpoint, Target: target})
		if err != nil {
			t.Fatalf("Dial as %s to %s: %v", src, dst, err)
		}
		return c
	}
	a := dial(f.client, f.server)
	b := dial(f.client, f.server) // same key: same connection
	if a.LocalAddr().String() != b.LocalAddr().String() {
		t.Error("two streams of one key use two connections")
	}
	c := dial(f.client2, f.server) // other source identity
	d := dial(f.client, f.server2) // other destination identity
	if s := f.cl.Stats(); s.Keys != 3 || s.Conns != 3 || s.Streams != 4 {
		t.Errorf("stats %+v, want 3 keys, 3 connections, 4 streams", s)
	}
	if c.LocalAddr().String() == a.LocalAddr().String() || d.LocalAddr().String() == a.LocalAddr().String() {
		t.Error("streams of different identities share a connection")
	}
	if d.PeerID() != f.server2 {
		t.Errorf("stream to %s has peer %s", f.server2, d.PeerID())
	}
	// A closed stream's slot is reused without a new connection.
	a.Abort()
	e := dial(f.client, f.server)
	if e.LocalAddr().String() != b.LocalAddr().String() {
		t.Error("a new stream of a pooled key opened a new connection")
	}
	for _, x := range []*Conn{b, c, d, e} {
		x.Abort()
	}
}

func TestPoolEvictsIdleConnections(t *testing.T) {
	ph := &pipeHandler{}
	f := newFixture(t, ph, func(_ *ServerConfig, c *ClientConfig) { c.IdleTimeout = 100 * time.Millisecond })
	defer ph.close()
	c, err := f.dial(ctxTimeout(t, 5*time.Second), netip.MustParseAddrPort("127.0.0.1:7"))
	if err != nil {
		t.Fatal(err)
	}
	// Busy connections stay however long they are used.
	time.Sleep(200 * time.Millisecond)
	if s := f.cl.Stats(); s.Conns != 1 {
		t.Fatalf("busy connection evicted: %+v", s)
	}
	c.Abort()
	deadline := time.Now().Add(5 * time.Second)
	for f.cl.Stats().Conns != 0 || f.srv.OpenConns() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("idle connection not evicted: client %+v, server %d open", f.cl.Stats(), f.srv.OpenConns())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestKeepaliveSettingsConfigured(t *testing.T) {
	f := newFixture(t, dialHandler)
	if f.cl.cfg.PingInterval != 10*time.Second || f.cl.cfg.PingTimeout != 20*time.Second {
		t.Errorf("client: ping after %s, timeout %s; want 10s, 20s", f.cl.cfg.PingInterval, f.cl.cfg.PingTimeout)
	}
	if f.srv.pingInterval != 10*time.Second || f.srv.pingTimeout != 20*time.Second {
		t.Errorf("server: ping after %s, timeout %s; want 10s, 20s", f.srv.pingInterval, f.srv.pingTimeout)
	}
}

// TestServerSettingsOnTheWire reads the server's SETTINGS and connection
// WINDOW_UPDATE with a bare framer.
func TestServerSettingsOnTheWire(t *testing.T) {
	f := newFixture(t, dialHandler)
	cfg, _ := f.clientTLS(f.client, f.server)
	tc, err := tls.Dial("tcp", f.endpoint.String(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	tc.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(tc, http2.ClientPreface)
	fr := http2.NewFramer(tc, tc)
	fr.WriteSettings()
	settings := map[http2.SettingID]uint32{}
	var connWindow uint32
	for connWindow == 0 || len(settings) == 0 {
		frame, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("reading server frames: %v", err)
		}
		switch fr := frame.(type) {
		case *http2.SettingsFrame:
			if !fr.IsAck() {
				fr.ForeachSetting(func(s http2.Setting) error { settings[s.ID] = s.Val; return nil })
			}
		case *http2.WindowUpdateFrame:
			if fr.StreamID == 0 {
				connWindow = 65535 + fr.Increment
			}
		}
	}
	want := map[http2.SettingID]uint32{
		http2.SettingMaxFrameSize:         1 << 20,
		http2.SettingInitialWindowSize:    4 << 20,
		http2.SettingMaxConcurrentStreams: 100,
	}
	for id, v := range want {
		if settings[id] != v {
			t.Errorf("server %v = %d, want %d", id, settings[id], v)
		}
	}
	if connWindow != 16<<20 {
		t.Errorf("server connection window %d, want 16 MiB", connWindow)
	}
}

// fakeH2Server accepts one TLS connection, hands its framer to fn.
func fakeH2Server(t *testing.T, ids *identities, fn func(fr *http2.Framer, c *tls.Conn)) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		tc := tls.Server(c, ids.serverTLS)
		if tc.Handshake() != nil {
			return
		}
		preface := make([]byte, len(http2.ClientPreface))
		if _, err := io.ReadFull(tc, preface); err != nil {
			return
		}
		fn(http2.NewFramer(tc, tc), tc)
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// TestClientSettingsOnTheWire reads the client's SETTINGS and connection
// WINDOW_UPDATE.
func TestClientSettingsOnTheWire(t *testing.T) {
	ids := newIdentities(t)
	type seen struct {
		settings   map[http2.SettingID]uint32
		connWindow uint32
	}
	got := make(chan seen, 1)
	ep := fakeH2Server(t, ids, func(fr *http2.Framer, c *tls.Conn) {
		c.SetDeadline(time.Now().Add(5 * time.Second))
		s := seen{settings: map[http2.SettingID]uint32{}}
		for s.connWindow == 0 || len(s.settings) == 0 {
			frame, err := fr.ReadFrame()
			if err != nil {
				break
			}
			switch fr := frame.(type) {
			case *http2.SettingsFrame:
				fr.ForeachSetting(func(x http2.Setting) error { s.settings[x.ID] = x.Val; return nil })
			case *http2.WindowUpdateFrame:
				if fr.StreamID == 0 {
					s.connWindow = 65535 + fr.Increment
				}
			}
		}
		got <- s
	})
	c, err := NewClient(ClientConfig{TLS: ids.clientTLS, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	go c.Dial(ctx, DialRequest{Source: ids.client, Destination: ids.server, Endpoint: ep, Target: netip.MustParseAddrPort("10.0.0.1:80")})
	s := <-got
	if s.settings[http2.SettingMaxFrameSize] != 1<<20 || s.settings[http2.SettingInitialWindowSize] != 4<<20 {
		t.Errorf("client settings %v, want max frame 1 MiB and stream window 4 MiB", s.settings)
	}
	if s.connWindow != 16<<20 {
		t.Errorf("client connection window %d, want 16 MiB", s.connWindow)
	}
}

// TestKeepaliveDetectsDeadServer: a server that completes TLS and then never
// sends a frame is detected by the PING health check.
func TestKeepaliveDetectsDeadServer(t *testing.T) {
	ids := newIdentities(t)
	ep := fakeH2Server(t, ids, func(fr *http2.Framer, c *tls.Conn) {
		io.Copy(io.Discard, c) // swallow everything, answer nothing
	})
	c, err := NewClient(ClientConfig{TLS: ids.clientTLS, PingInterval: 100 * time.Millisecond, PingTimeout: 200 * time.Millisecond, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	_, err = c.Dial(ctxTimeout(t, 10*time.Second), DialRequest{Source: ids.client, Destination: ids.server, Endpoint: ep, Target: netip.MustParseAddrPort("10.0.0.1:80")})
	if err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Dial to a silent server: %v, want the PING timeout to fail it", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("dead connection detected after %s", d)
	}
	t.Logf("after %s: %v", time.Since(start).Round(time.Millisecond), err)
}

func BenchmarkStreamUpload(b *testing.B) {
	f := newFixture(b, dialHandler)
	up := newUpstream(b)
	conn, err := f.dial(ctxTimeout(b, 5*time.Second), up.addr)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	uc := up.accept(b)
	done := make(chan int64, 1)
	go func() {
		n, _ := io.Copy(io.Discard, uc)
		done <- n
	}()
	chunk := randomBytes(b, 1<<20)
	b.SetBytes(int64(len(chunk)))
	b.ResetTimer()
	for range b.N {
		if _, err := conn.Write(chunk); err != nil {
			b.Fatal(err)
		}
	}
	conn.CloseWrite()
	n := <-done
	b.StopTimer()
	if n != int64(b.N*len(chunk)) {
		b.Fatalf("upstream got %d bytes, want %d", n, b.N*len(chunk))
	}
}

func BenchmarkStreamDownload(b *testing.B) {
	f := newFixture(b, dialHandler)
	up := newUpstream(b)
	conn, err := f.dial(ctxTimeout(b, 5*time.Second), up.addr)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	uc := up.accept(b)
	chunk := randomBytes(b, 1<<20)
	b.SetBytes(int64(len(chunk)))
	b.ResetTimer()
	go func() {
		for range b.N {
			if _, err := uc.Write(chunk); err != nil {
				return
			}
		}
		uc.CloseWrite()
	}()
	n, err := io.Copy(io.Discard, conn)
	b.StopTimer()
	if err != nil || n != int64(b.N*len(chunk)) {
		b.Fatalf("client got %d bytes, %v; want %d", n, err, b.N*len(chunk))
	}
}

// TestDialFrom: a request with From is dialled by DialFrom from that
// address (the server sees it as the peer address) and pooled apart from
// another From of the same identities; without DialFrom it is refused.
func TestDialFrom(t *testing.T) {
	got := make(chan *Request, 4)
	f := newFixture(t, HandlerFunc(func(ctx context.Context, req *Request) (net.Conn, error) {
		got <- req
		return dialHandler(ctx, req)
	}), func(_ *ServerConfig, c *ClientConfig) {
		c.DialFrom = func(ctx context.Context, from netip.Addr, endpoint netip.AddrPort) (net.Conn, error) {
			d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(from, 0))}
			return d.DialContext(ctx, "tcp", endpoint.String())
		}
	})
	up := newUpstream(t)
	ctx := ctxTimeout(t, 5*time.Second)
	for _, from := range []netip.Addr{netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("127.0.0.3"), netip.MustParseAddr("127.0.0.2")} {
		c, err := f.cl.Dial(ctx, DialRequest{Source: f.client, Destination: f.server, Endpoint: f.endpoint, Target: up.addr, From: from})
		if err != nil {
			t.Fatalf("Dial from %s: %v", from, err)
		}
		defer c.Close()
		if req := <-got; req.PeerAddr.Addr() != from {
			t.Errorf("server saw peer %s, want %s", req.PeerAddr, from)
		}
	}
	if s := f.cl.Stats(); s.Keys != 2 || s.Conns != 2 || s.Streams != 3 {
		t.Errorf("stats %+v, want 2 keys (one per local address), 2 connections, 3 streams", s)
	}
	if _, err := f.cl.Dial(ctx, DialRequest{Source: f.client, Destination: f.server, Endpoint: f.endpoint, Target: up.addr, From: netip.MustParseAddr("::1")}); err == nil {
		t.Error("a dial from an IPv6 address to an IPv4 endpoint was not refused")
	}
	c2, err := NewClient(ClientConfig{TLS: f.clientTLS})
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if _, err := c2.Dial(ctx, DialRequest{Source: f.client, Destination: f.server, Endpoint: f.endpoint, Target: up.addr, From: netip.MustParseAddr("127.0.0.2")}); err == nil {
		t.Error("a client without DialFrom dialled from an address")
	}
}
