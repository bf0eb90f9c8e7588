package identity

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// staticWorkload is a WorkloadSource with a fixed SVID.
type staticWorkload struct {
	*x509svid.SVID
	x509bundle.Source
}

// staticServer is a ServerSource with fixed SVIDs.
type staticServer struct {
	svids map[spiffeid.ID]*x509svid.SVID
	x509bundle.Source
}

func (s staticServer) SVID(id spiffeid.ID) (*x509svid.SVID, error) {
	if svid, ok := s.svids[id]; ok {
		return svid, nil
	}
	return nil, fmt.Errorf("no SVID for %s", id)
}

type side struct {
	state tls.ConnectionState
	err   error
}

// handshake runs one TLS handshake over loopback TCP between a server
// listening on addr and a client. After a successful handshake the server
// writes one byte that the client reads, which surfaces a client certificate
// rejection on the client (in TLS 1.3 the client finishes its handshake
// before the server has checked the client's certificate).
func handshake(t *testing.T, addr string, server, client *tls.Config) (srv, cli side) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("listen on %s: %v", addr, err)
	}
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	done := make(chan side, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- side{err: err}
			return
		}
		defer c.Close()
		tc := tls.Server(c, server)
		err = tc.HandshakeContext(ctx)
		if err == nil {
			_, err = tc.Write([]byte{'x'})
		}
		st := tc.ConnectionState()
		// Wait for the client to finish reading before closing.
		io.Copy(io.Discard, tc)
		done <- side{st, err}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	tc := tls.Client(c, client)
	err = tc.HandshakeContext(ctx)
	if err == nil {
		var b [1]byte
		_, err = io.ReadFull(tc, b[:])
	}
	cli = side{tc.ConnectionState(), err}
	tc.Close()
	srv = <-done
	return srv, cli
}

type tlsFixture struct {
	caDir          string
	ca             *CA
	src            *Source
	client, server spiffeid.ID
	server2        spiffeid.ID
	serverTLS      *tls.Config
	pickedAddrs    chan netip.Addr
	serverByAddr   map[netip.Addr]spiffeid.ID
}

func newTLSFixture(t *testing.T) *tlsFixture {
	t.Helper()
	dir := t.TempDir()
	f := &tlsFixture{caDir: dir, ca: openCA(t, dir, testTD, time.Hour), pickedAddrs: make(chan netip.Addr, 8)}
	f.src, _ = newTestSource(t, f.ca, f.ca)
	f.client = mustID(t, testTD, "client-ns", "client")
	f.server = mustID(t, testTD, "server-ns", "server")
	f.server2 = mustID(t, testTD, "server-ns", "server2")
	for _, id := range []spiffeid.ID{f.client, f.server, f.server2} {
		if err := f.src.Add(context.Background(), id); err != nil {
			t.Fatal(err)
		}
	}
	f.serverByAddr = map[netip.Addr]spiffeid.ID{
		netip.MustParseAddr("127.0.0.1"): f.server,
		netip.MustParseAddr("127.0.0.2"): f.server2,
	}
	f.serverTLS = ServerTLS(f.src, testTD, f.pick)
	return f
}

func (f *tlsFixture) pick(local netip.Addr) (spiffeid.ID, bool) {
	select {
	case f.pickedAddrs <- local:
	default:
	}
	id, ok := f.serverByAddr[local]
	return id, ok
}

func wantErr(t *testing.T, what string, err error, parts ...string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: no error, want one saying %q", what, parts)
		return
	}
	for _, p := range parts {
		if !strings.Contains(err.Error(), p) {
			t.Errorf("%s: error %q does not say %q", what, err, p)
		}
	}
}

func TestTLSHandshake(t *testing.T) {
	f := newTLSFixture(t)
	srv, cli := handshake(t, "127.0.0.1:0", f.serverTLS, ClientTLS(f.src.Workload(f.client), f.server))
	if srv.err != nil || cli.err != nil {
		t.Fatalf("handshake: server %v, client %v", srv.err, cli.err)
	}
	if got := <-f.pickedAddrs; got != netip.MustParseAddr("127.0.0.1") {
		t.Errorf("server picked its certificate for local address %s, want 127.0.0.1", got)
	}
	for name, st := range map[string]tls.ConnectionState{"server": srv.state, "client": cli.state} {
		if st.Version != tls.VersionTLS13 {
			t.Errorf("%s: TLS version %#x, want TLS 1.3", name, st.Version)
		}
		if st.NegotiatedProtocol != "h2" {
			t.Errorf("%s: ALPN %q, want h2", name, st.NegotiatedProtocol)
		}
		if st.DidResume {
			t.Errorf("%s: session resumed", name)
		}
	}
	if srv.state.ServerName != "" {
		t.Errorf("client sent SNI %q, want none", srv.state.ServerName)
	}
	if id, err := PeerID(srv.state); err != nil || id != f.client {
		t.Errorf("server sees peer %s (%v), want %s", id, err, f.client)
	}
	if id, err := PeerID(cli.state); err != nil || id != f.server {
		t.Errorf("client sees peer %s (%v), want %s", id, err, f.server)
	}

	// The server picks its certificate by the address the client dialled.
	srv, cli = handshake(t, "127.0.0.2:0", f.serverTLS, ClientTLS(f.src.Workload(f.client), f.server2))
	if srv.err != nil || cli.err != nil {
		t.Fatalf("handshake on 127.0.0.2: server %v, client %v", srv.err, cli.err)
	}
	if id, _ := PeerID(cli.state); id != f.server2 {
		t.Errorf("server on 127.0.0.2 presented %s, want %s", id, f.server2)
	}

	// A second connection is a full handshake again: no tickets, no cache.
	cfg := ClientTLS(f.src.Workload(f.client), f.server)
	for i := range 2 {
		srv, cli = handshake(t, "127.0.0.1:0", f.serverTLS, cfg)
		if srv.err != nil || cli.err != nil || cli.state.DidResume {
			t.Fatalf("handshake %d: server %v, client %v, resumed %t", i, srv.err, cli.err, cli.state.DidResume)
		}
	}
	if cfg.ClientSessionCache != nil || !f.serverTLS.SessionTicketsDisabled {
		t.Error("session resumption is not disabled")
	}
}

func TestTLSRejections(t *testing.T) {
	f := newTLSFixture(t)
	ctx := context.Background()

	// A second CA of another trust domain.
	otherTD := spiffeid.RequireTrustDomainFromString("other.example")
	otherCA := openCA(t, t.TempDir(), otherTD, time.Hour)
	otherID := mustID(t, otherTD, "client-ns", "client")
	otherSVID, err := otherCA.Issue(ctx, otherID)
	if err != nil {
		t.Fatal(err)
	}
	// A rogue CA that claims our trust domain with its own root.
	rogueCA := openCA(t, t.TempDir(), testTD, time.Hour)
	rogueClient, err := rogueCA.Issue(ctx, f.client)
	if err != nil {
		t.Fatal(err)
	}
	rogueServer, err := rogueCA.Issue(ctx, f.server)
	if err != nil {
		t.Fatal(err)
	}
	// The real CA, its clock two hours behind: expired SVIDs.
	past, err := OpenCA(CAConfig{Dir: f.caDir, TrustDomain: testTD, SVIDTTL: time.Hour,
		Now: func() time.Time { return time.Now().Add(-2 * time.Hour) }})
	if err != nil {
		t.Fatal(err)
	}
	expiredClient, err := past.Issue(ctx, f.client)
	if err != nil {
		t.Fatal(err)
	}
	expiredServer, err := past.Issue(ctx, f.server)
	if err != nil {
		t.Fatal(err)
	}
	bundle := f.ca.Bundle()
	goodClient := ClientTLS(f.src.Workload(f.client), f.server)

	tests := []struct {
		name           string
		server, client *tls.Config
		// rejecting side and what its error must say; the other side
		// must fail too.
		serverRejects bool
		want          []string
	}{
		{"client of another trust domain",
			f.serverTLS, ClientTLS(staticWorkload{otherSVID, x509bundle.NewSet(otherCA.Bundle(), bundle)}, f.server),
			true, []string{"client certificate rejected", `no X.509 bundle found for trust domain: "other.example"`}},
		{"federated client of another trust domain",
			ServerTLS(staticServer{map[spiffeid.ID]*x509svid.SVID{f.server: mustSVID(t, f.src, f.server)}, x509bundle.NewSet(bundle, otherCA.Bundle())}, testTD, f.pick),
			ClientTLS(staticWorkload{otherSVID, x509bundle.NewSet(otherCA.Bundle(), bundle)}, f.server),
			true, []string{"client certificate rejected", "client " + otherID.String() + " is not in trust domain cluster.local"}},
		{"client of a rogue CA",
			f.serverTLS, ClientTLS(staticWorkload{rogueClient, bundle}, f.server),
			true, []string{"client certificate rejected", "certificate signed by unknown authority"}},
		{"expired client certificate",
			f.serverTLS, ClientTLS(staticWorkload{expiredClient, bundle}, f.server),
			true, []string{"client certificate rejected", "expired"}},
		{"client without certificate",
			f.serverTLS, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13, NextProtos: []string{"h2"}},
			true, []string{"client didn't provide a certificate"}},
		{"server presenting the wrong identity",
			f.serverTLS, ClientTLS(f.src.Workload(f.client), f.server2),
			false, []string{"server certificate rejected", "server is " + f.server.String() + ", want " + f.server2.String()}},
		{"server of a rogue CA",
			ServerTLS(staticServer{map[spiffeid.ID]*x509svid.SVID{f.server: rogueServer}, bundle}, testTD, f.pick), goodClient,
			false, []string{"server certificate rejected", "certificate signed by unknown authority"}},
		{"expired server certificate",
			ServerTLS(staticServer{map[spiffeid.ID]*x509svid.SVID{f.server: expiredServer}, bundle}, testTD, f.pick), goodClient,
			false, []string{"server certificate rejected", "expired"}},
		{"server of another trust domain",
			ServerTLS(staticServer{map[spiffeid.ID]*x509svid.SVID{f.server: otherSVID}, bundle}, testTD, f.pick), goodClient,
			false, []string{"server certificate rejected", "other.example"}},
		{"no local workload for the address",
			ServerTLS(f.src, testTD, func(netip.Addr) (spiffeid.ID, bool) { return spiffeid.ID{}, false }), goodClient,
			true, []string{"no local workload serves 127.0.0.1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv, cli := handshake(t, "127.0.0.1:0", tt.server, tt.client)
			rejecting, other := srv.err, cli.err
			if !tt.serverRejects {
				rejecting, other = cli.err, srv.err
			}
			t.Logf("rejected with: %v", rejecting)
			wantErr(t, "rejecting side", rejecting, tt.want...)
			if other == nil {
				t.Error("the other side saw no error")
			}
		})
	}
}

// TestTLSRenewalKeepsConnections checks that configurations built once pick
// up renewed SVIDs at the next handshake while connections made with the old
// SVIDs keep working.
func TestTLSRenewalKeepsConnections(t *testing.T) {
	const ttl = 2 * time.Second
	ca := openCA(t, t.TempDir(), testTD, ttl)
	src, updates := newTestSource(t, ca, ca)
	client, server := mustID(t, testTD, "ns", "client"), mustID(t, testTD, "ns", "server")
	for _, id := range []spiffeid.ID{client, server} {
		if err := src.Add(context.Background(), id); err != nil {
			t.Fatal(err)
		}
		nextUpdate(t, updates, time.Second)
	}
	serverTLS := ServerTLS(src, testTD, func(netip.Addr) (spiffeid.ID, bool) { return server, true })
	clientTLS := ClientTLS(src.Workload(client), server)

	ln, err := tls.Listen("tcp", "127.0.0.1:0", serverTLS)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				io.Copy(c, c)
			}()
		}
	}()
	dial := func() *tls.Conn {
		t.Helper()
		c, err := tls.Dial("tcp", ln.Addr().String(), clientTLS)
		if err != nil {
			t.Fatalf("dial: %v", err)
		}
		return c
	}
	echo := func(c *tls.Conn, msg string) {
		t.Helper()
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatalf("write: %v", err)
		}
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
			t.Fatalf("echo: got %q, %v; want %q", buf, err, msg)
		}
	}
	old := dial()
	defer old.Close()
	echo(old, "before renewal")
	oldServerSerial := old.ConnectionState().PeerCertificates[0].SerialNumber

	renewed := map[spiffeid.ID]*x509svid.SVID{}
	for len(renewed) < 2 {
		u := nextUpdate(t, updates, 3*ttl)
		renewed[u.id] = u.svid
	}
	echo(old, "after renewal, same connection")

	fresh := dial()
	defer fresh.Close()
	echo(fresh, "new connection")
	got := fresh.ConnectionState().PeerCertificates[0].SerialNumber
	if got.Cmp(oldServerSerial) == 0 {
		t.Error("new connection still got the old server certificate")
	}
	if want := renewed[server].Certificates[0].SerialNumber; got.Cmp(want) != 0 {
		// A second renewal may have happened meanwhile; it must at least
		// be the Source's current one.
		cur, _ := src.SVID(server)
		if got.Cmp(cur.Certificates[0].SerialNumber) != 0 {
			t.Errorf("new connection got server serial %s, want the renewed %s", got, want)
		}
	}
}

func mustSVID(t *testing.T, src *Source, id spiffeid.ID) *x509svid.SVID {
	t.Helper()
	svid, err := src.SVID(id)
	if err != nil {
		t.Fatal(err)
	}
	return svid
}
