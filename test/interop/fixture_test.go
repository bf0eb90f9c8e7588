package interop

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	istiohbone "istio.io/istio/pkg/hbone"
	istiolog "istio.io/istio/pkg/log"
	istiospiffe "istio.io/istio/pkg/spiffe"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/test/interop/internal/istioid"
)

// testTimeout bounds every wait of a test: a dial, a transfer, a signal.
const testTimeout = 30 * time.Second

var td = spiffeid.RequireTrustDomainFromString("interop.test")

// The identities of the four parties: Istio's dialer and server hold SVIDs
// issued directly by our CA; meshtun's client and server get theirs from an
// identity.Source as a node would.
var (
	istioClientID   = spiffeid.RequireFromPath(td, "/ns/istio/sa/dialer")
	istioServerID   = spiffeid.RequireFromPath(td, "/ns/istio/sa/server")
	meshtunClientID = spiffeid.RequireFromPath(td, "/ns/meshtun/sa/client")
	meshtunServerID = spiffeid.RequireFromPath(td, "/ns/meshtun/sa/server")
)

func TestMain(m *testing.M) {
	// Istio logs every CONNECT at info level; keep test output readable.
	for _, s := range istiolog.Scopes() {
		s.SetOutputLevel(istiolog.WarnLevel)
	}
	os.Exit(m.Run())
}

// mesh is one trust domain: meshtun's CA in a temporary directory, a node
// Source with meshtun's identities, and Istio's verifier trusting the CA's
// root as Istio loads it, from the PEM file.
type mesh struct {
	ca       *identity.CA
	src      *identity.Source
	verifier *istiospiffe.PeerCertVerifier
}

func newMesh(t *testing.T) *mesh {
	t.Helper()
	dir := t.TempDir()
	ca, err := identity.OpenCA(identity.CAConfig{Dir: dir, TrustDomain: td, SVIDTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	src, err := identity.NewSource(identity.SourceConfig{Issuer: ca, Bundle: ca.Bundle(), TrustDomain: td})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(src.Close)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	for _, id := range []spiffeid.ID{meshtunClientID, meshtunServerID} {
		if err := src.Add(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	rootPEM, err := os.ReadFile(filepath.Join(dir, identity.RootCertFile))
	if err != nil {
		t.Fatal(err)
	}
	v := istiospiffe.NewPeerCertVerifier()
	if err := v.AddMappingFromPEM(td.Name(), rootPEM); err != nil {
		t.Fatalf("Istio's verifier cannot load our CA root: %v", err)
	}
	return &mesh{ca: ca, src: src, verifier: v}
}

// istioCert issues an SVID for id from our CA as a tls.Certificate for the
// Istio side.
func (m *mesh) istioCert(t *testing.T, id spiffeid.ID) tls.Certificate {
	t.Helper()
	svid, err := m.ca.Issue(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return tlsCert(svid)
}

func tlsCert(svid *x509svid.SVID) tls.Certificate {
	c := tls.Certificate{PrivateKey: svid.PrivateKey, Leaf: svid.Certificates[0]}
	for _, x := range svid.Certificates {
		c.Certificate = append(c.Certificate, x.Raw)
	}
	return c
}

// istioClientTLS is the TLS configuration of Istio's dialer: our CA's SVID
// for its identity (none if cert is nil), the server verified the SPIFFE way
// with Istio's verifier, and its identity required to be want. The
// handshake's state is stored in *state if state is not nil.
func (m *mesh) istioClientTLS(cert *tls.Certificate, want spiffeid.ID, state *tlsState) *tls.Config {
	cfg := &tls.Config{
		MinVersion: tls.VersionTLS13,
		// Verified below by SPIFFE ID, not by host name.
		InsecureSkipVerify: true,
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			if len(raw) == 0 {
				return errors.New("server presented no certificate")
			}
			if err := m.verifier.VerifyPeerCert(raw, nil); err != nil {
				return err
			}
			id, err := istioid.PeerID(raw[0])
			if err != nil {
				return err
			}
			if id != want.String() {
				return fmt.Errorf("server is %s, want %s", id, want)
			}
			return nil
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			if state != nil {
				state.set(cs)
			}
			return nil
		},
	}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	return cfg
}

// istioServerTLS is the TLS configuration of Istio's server: our CA's SVID,
// a client certificate required and verified with Istio's verifier, TLS 1.3,
// ALPN h2.
func (m *mesh) istioServerTLS(cert tls.Certificate) *tls.Config {
	return &tls.Config{
		MinVersion:            tls.VersionTLS13,
		Certificates:          []tls.Certificate{cert},
		ClientAuth:            tls.RequireAnyClientCert,
		VerifyPeerCertificate: m.verifier.VerifyPeerCert,
		NextProtos:            []string{"h2"},
	}
}

// tlsState records a handshake's connection state.
type tlsState struct {
	mu sync.Mutex
	cs *tls.ConnectionState
}

func (s *tlsState) set(cs tls.ConnectionState) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cs = &cs
}

func (s *tlsState) get() *tls.ConnectionState {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cs
}

// helloLog records the ClientHellos a server saw.
type helloLog struct {
	mu     sync.Mutex
	hellos []*tls.ClientHelloInfo
}

func (h *helloLog) add(hi *tls.ClientHelloInfo) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.hellos = append(h.hellos, hi)
}

func (h *helloLog) all() []*tls.ClientHelloInfo {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]*tls.ClientHelloInfo(nil), h.hellos...)
}

// ourServer is meshtun's HBONE server on a loopback port.
type ourServer struct {
	*hbone.Server
	addr   netip.AddrPort
	hellos *helloLog
}

func startOurServer(t *testing.T, m *mesh, h hbone.Handler) *ourServer {
	t.Helper()
	return startOurServerOn(t, m, h, "127.0.0.1:0")
}

// startOurServerOn is startOurServer listening on listen.
func startOurServerOn(t *testing.T, m *mesh, h hbone.Handler, listen string) *ourServer {
	t.Helper()
	tc := identity.ServerTLS(m.src, td, func(netip.Addr) (spiffeid.ID, bool) { return meshtunServerID, true })
	hellos := &helloLog{}
	getCert := tc.GetCertificate
	tc.GetCertificate = func(hi *tls.ClientHelloInfo) (*tls.Certificate, error) {
		hellos.add(hi)
		return getCert(hi)
	}
	srv, err := hbone.NewServer(hbone.ServerConfig{
		TLS:     tc,
		Handler: h,
		Logger:  zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel),
	})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("our server: %v", err)
		}
	})
	return &ourServer{Server: srv, addr: addrOf(t, ln.Addr()), hellos: hellos}
}

// dialingHandler is a Handler that records each request and connects to its
// target, or refuses it with the error deny returns.
func dialingHandler(reqs chan<- *hbone.Request, deny func(*hbone.Request) error) hbone.Handler {
	return hbone.HandlerFunc(func(ctx context.Context, req *hbone.Request) (net.Conn, error) {
		reqs <- req
		if deny != nil {
			if err := deny(req); err != nil {
				return nil, err
			}
		}
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", req.Target.String())
		if err != nil {
			return nil, fmt.Errorf("%w: %v", hbone.ErrUnreachable, err)
		}
		return c, nil
	})
}

// istioServer is Istio's HBONE server on a loopback port, set up as the
// issue says: HTTP/2 enabled, TLS with ALPN h2, ServeTLS.
type istioServer struct {
	addr netip.AddrPort
	reqs chan istioRequest
}

// istioRequest is what Istio's server received, captured in front of its
// CONNECT handler: the request as net/http parsed it and the client's
// identity as Istio reads it from the verified certificate.
type istioRequest struct {
	// RemoteAddr is the TCP peer of the HBONE connection, as Istio's
	// server (and ztunnel) sees the client.
	RemoteAddr string
	Method     string
	Host       string
	Proto      string
	Header     http.Header
	PeerID     string
	TLSVer     uint16
	ALPN       string
	ServerSNI  string
}

type connKey struct{}

func startIstioServer(t *testing.T, m *mesh, network, addr string) *istioServer {
	t.Helper()
	srv := istiohbone.NewServer()
	srv.Protocols.SetHTTP2(true)
	srv.TLSConfig = m.istioServerTLS(m.istioCert(t, istioServerID))
	srv.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		return context.WithValue(ctx, connKey{}, c)
	}
	is := &istioServer{reqs: make(chan istioRequest, 64)}
	connect := srv.Handler
	srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ir := istioRequest{RemoteAddr: r.RemoteAddr, Method: r.Method, Host: r.Host, Proto: r.Proto, Header: r.Header.Clone()}
		// net/http sets r.TLS only for :scheme https, which CONNECT lacks.
		if tc, ok := r.Context().Value(connKey{}).(*tls.Conn); ok {
			cs := tc.ConnectionState()
			ir.TLSVer, ir.ALPN, ir.ServerSNI = cs.Version, cs.NegotiatedProtocol, cs.ServerName
			if len(cs.PeerCertificates) > 0 {
				if id, err := istioid.PeerID(cs.PeerCertificates[0].Raw); err == nil {
					ir.PeerID = id
				} else {
					ir.PeerID = "error: " + err.Error()
				}
			}
		}
		is.reqs <- ir
		connect.ServeHTTP(w, r)
	})
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.ServeTLS(ln, "", "") }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("Istio's server: %v", err)
		}
	})
	is.addr = addrOf(t, ln.Addr())
	return is
}

// next returns the next request Istio's server received.
func (s *istioServer) next(t *testing.T) istioRequest {
	t.Helper()
	select {
	case r := <-s.reqs:
		return r
	case <-time.After(testTimeout):
		t.Fatal("Istio's server received no request")
		return istioRequest{}
	}
}

// ourClient is meshtun's HBONE client with certificates from m.
func ourClient(t *testing.T, m *mesh) *hbone.Client {
	t.Helper()
	c, err := hbone.NewClient(hbone.ClientConfig{
		TLS: func(src, dst spiffeid.ID) (*tls.Config, error) {
			return identity.ClientTLS(m.src.Workload(src), dst), nil
		},
		Logger: zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// workload is a plain TCP server on loopback standing for the destination
// application. Each accepted connection is handed to serve in a goroutine
// and closed when serve returns.
func startWorkload(t *testing.T, network, addr string, serve func(*net.TCPConn)) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				serve(c.(*net.TCPConn))
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	return addrOf(t, ln.Addr())
}

// echo copies what it reads back until EOF, then half-closes.
func echo(c *net.TCPConn) {
	io.Copy(c, c)
	c.CloseWrite()
}

// closedPort returns a loopback address where nothing listens.
func closedPort(t *testing.T) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a := addrOf(t, ln.Addr())
	ln.Close()
	return a
}

func addrOf(t *testing.T, a net.Addr) netip.AddrPort {
	t.Helper()
	ap, err := netip.ParseAddrPort(a.String())
	if err != nil {
		t.Fatal(err)
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

// payload returns n pseudo-random bytes, the same for the same seed.
func payload(seed uint64, n int) []byte {
	var key [32]byte
	key[0] = byte(seed)
	r := rand.NewChaCha8(key)
	b := make([]byte, n)
	r.Read(b)
	return b
}

// within runs f and fails the test if it does not return within
// testTimeout. f must not call t.Fatal.
func within[T any](t *testing.T, what string, f func() (T, error)) (T, error) {
	t.Helper()
	type result struct {
		v   T
		err error
	}
	ch := make(chan result, 1)
	go func() {
		v, err := f()
		ch <- result{v, err}
	}()
	select {
	case r := <-ch:
		return r.v, r.err
	case <-time.After(testTimeout):
		t.Fatalf("%s: no result within %s", what, testTimeout)
		var zero T
		return zero, nil
	}
}

// wait receives from ch or fails the test after testTimeout.
func wait[T any](t *testing.T, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(testTimeout):
		t.Fatalf("%s: nothing within %s", what, testTimeout)
		var zero T
		return zero
	}
}

// equalBytes reports where got and want first differ.
func equalBytes(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if bytes.Equal(got, want) {
		return
	}
	i := 0
	for i < len(got) && i < len(want) && got[i] == want[i] {
		i++
	}
	t.Errorf("%s: got %d bytes, want %d; first difference at offset %d", what, len(got), len(want), i)
}
