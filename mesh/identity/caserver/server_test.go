package caserver

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/registry"
	testfixture "github.com/meshtun/meshtun/test/fixture"
)

var td = spiffeid.RequireTrustDomainFromString("cluster.local")

// syncBuffer is the shared log sink of test/fixture.
type syncBuffer = testfixture.SyncBuffer

func wid(ns, sa string) spiffeid.ID { return spiffeid.RequireFromSegments(td, "ns", ns, "sa", sa) }

func workloads() []*registry.Workload {
	return []*registry.Workload{
		{Name: "a", Node: "n1", InMesh: true, Identity: wid("default", "a")},
		{Name: "b", Node: "n2", InMesh: true, Identity: wid("default", "b")},
		{Name: "out", Node: "n1", InMesh: false, Identity: wid("default", "out")},
	}
}

type fixture struct {
	ca   *identity.CA
	file *FileMode
	addr string
	logs *syncBuffer
	dir  string
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{logs: &syncBuffer{}, dir: t.TempDir()}
	var err error
	f.ca, err = identity.OpenCA(identity.CAConfig{Dir: f.dir + "/ca", TrustDomain: td, SVIDTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	f.file = NewFileMode(td, f.ca.Roots)
	f.file.Update([]string{"n1", "n2"}, workloads(), nil)
	srv, err := New(Config{CA: f.ca, Authenticators: []Authenticator{f.file}, Authorizer: f.file,
		Logger: zerolog.New(f.logs)})
	if err != nil {
		t.Fatal(err)
	}
	f.addr = serveLoopback(t, srv)
	return f
}

// serveLoopback serves srv on a loopback port until the test ends.
func serveLoopback(t testing.TB, srv *Server) string {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// credential issues a node credential for node, valid for ttl.
func (f *fixture) credential(t *testing.T, node string, ttl time.Duration) string {
	return f.credentialTB(t, node, ttl)
}

func (f *fixture) credentialTB(t testing.TB, node string, ttl time.Duration) string {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	id, err := identity.NodeID(td, node)
	if err != nil {
		t.Fatal(err)
	}
	chain, err := f.ca.Sign(&key.PublicKey, id, ttl)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := identity.WriteNodeCredential(dir, chain[0], key, f.ca.Roots()); err != nil {
		t.Fatal(err)
	}
	return dir
}

func (f *fixture) client(t *testing.T, credDir string) *identity.RemoteIssuer {
	t.Helper()
	cfg := identity.RemoteConfig{Address: f.addr, TrustDomain: td, Bundle: identity.NewTrustBundle(td, f.ca.Roots())}
	if credDir != "" {
		cred, err := identity.OpenNodeCredential(credDir)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Credential = cred.Get
	}
	r, err := identity.DialCA(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func TestIssueToTheNodeOfTheWorkload(t *testing.T) {
	f := newFixture(t)
	r := f.client(t, f.credential(t, "n1", time.Hour))
	svid, err := r.Issue(context.Background(), wid("default", "a"))
	if err != nil {
		t.Fatalf("n1 asking for its own workload: %v\nlogs: %s", err, f.logs)
	}
	if svid.ID != wid("default", "a") {
		t.Errorf("SVID for %s", svid.ID)
	}
	if _, err := svid.Certificates[0].Verify(x509.VerifyOptions{Roots: identity.NewTrustBundle(td, f.ca.Roots()).Pool(),
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Errorf("issued SVID does not verify against the CA: %v", err)
	}
	if !strings.Contains(f.logs.String(), IssuedMessage) {
		t.Errorf("no %q log line: %s", IssuedMessage, f.logs)
	}
}

func TestRefusals(t *testing.T) {
	f := newFixture(t)
	n1 := f.credential(t, "n1", time.Hour)
	expired := f.credential(t, "n1", time.Hour)
	f.file.now = func() time.Time { return time.Now() } // reset below per case
	revoked := f.credential(t, "n2", time.Hour)
	revokedCert, _ := identity.OpenNodeCredential(revoked)
	rc, _ := revokedCert.Get()
	gone := f.credential(t, "n9", time.Hour)
	// A node ID of another CA: its own root, not trusted here.
	other := newFixture(t)
	foreign := other.credential(t, "n1", time.Hour)
	f.file.Update([]string{"n1", "n2"}, workloads(), []string{rc.Leaf.SerialNumber.Text(16)})

	for _, c := range []struct {
		name   string
		cred   string
		clock  time.Duration
		id     spiffeid.ID
		code   codes.Code
		reason string
	}{
		{"another node's workload", n1, 0, wid("default", "b"), codes.PermissionDenied, "node n1 may not have spiffe://cluster.local/ns/default/sa/b: its workloads run on node(s) n2, not on n1"},
		{"unknown identity", n1, 0, wid("default", "zz"), codes.PermissionDenied, "no mesh workload in the config file has that identity"},
		{"workload outside the mesh", n1, 0, wid("default", "out"), codes.PermissionDenied, "no mesh workload"},
		{"expired credential", expired, 2 * time.Hour, wid("default", "a"), codes.Unauthenticated, "expired at"},
		{"revoked credential", revoked, 0, wid("default", "b"), codes.Unauthenticated, "is revoked"},
		{"node removed from the config", gone, 0, wid("default", "a"), codes.PermissionDenied, "node n9 is not in the config file"},
		{"credential of another CA", foreign, 0, wid("default", "a"), codes.Unauthenticated, "not trusted"},
		{"no credential", "", 0, wid("default", "a"), codes.Unauthenticated, "no credential"},
	} {
		t.Run(c.name, func(t *testing.T) {
			f.file.now = func() time.Time { return time.Now().Add(c.clock) }
			_, err := f.client(t, c.cred).Issue(context.Background(), c.id)
			if status.Code(unwrap(err)) != c.code || !strings.Contains(err.Error(), c.reason) {
				t.Fatalf("got %v, want %s with %q", err, c.code, c.reason)
			}
			if !logged(f.logs.String(), c.id.String(), c.reason) {
				t.Errorf("no %q log line naming %s and %q:\n%s", RefusedMessage, c.id, c.reason, f.logs)
			}
		})
	}
	f.file.now = time.Now
}

func unwrap(err error) error {
	for err != nil {
		if _, ok := status.FromError(err); ok {
			return err
		}
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			return err
		}
		err = u.Unwrap()
	}
	return err
}

func logged(logs, id, reason string) bool {
	for _, l := range strings.Split(logs, "\n") {
		if strings.Contains(l, RefusedMessage) && strings.Contains(l, id) && strings.Contains(l, reason) {
			return true
		}
	}
	return false
}

// A CSR whose SAN is not the identity in ImpersonatedIdentity is refused:
// sent by hand, since RemoteIssuer always asks for its CSR's SAN.
func TestCSRSANMustMatch(t *testing.T) {
	f := newFixture(t)
	cred, _ := identity.OpenNodeCredential(f.credential(t, "n1", time.Hour))
	c, err := dialRaw(f, cred)
	if err != nil {
		t.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	csr, _ := identity.NewCSR(key, wid("default", "b"))
	_, err = c.create(string(csr), wid("default", "a").String())
	want := "CSR SAN spiffe://cluster.local/ns/default/sa/b differs from the identity asked for spiffe://cluster.local/ns/default/sa/a"
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), want) {
		t.Fatalf("got %v, want PermissionDenied %q", err, want)
	}
	if !logged(f.logs.String(), wid("default", "a").String(), want) {
		t.Errorf("no log line: %s", f.logs)
	}
	// Without ImpersonatedIdentity the CSR's SAN is what is asked for.
	csr, _ = identity.NewCSR(key, wid("default", "a"))
	if _, err := c.create(string(csr), ""); err != nil {
		t.Errorf("CSR for its own workload without metadata: %v", err)
	}
	if _, err := c.create("garbage", ""); status.Code(err) != codes.InvalidArgument {
		t.Errorf("garbage CSR: %v, want InvalidArgument", err)
	}
}

// The response orders the chain as Istio clients expect: leaf first,
// signing root last; during a rotation every trusted root is in it.
func TestResponseCarriesRotationBundle(t *testing.T) {
	f := newFixture(t)
	if _, err := identity.PrepareRoot(f.dir+"/ca", td, 0); err != nil {
		t.Fatal(err)
	}
	if err := f.ca.Reload(); err != nil {
		t.Fatal(err)
	}
	cred, _ := identity.OpenNodeCredential(f.credential(t, "n1", time.Hour))
	c, err := dialRaw(f, cred)
	if err != nil {
		t.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	csr, _ := identity.NewCSR(key, wid("default", "a"))
	chain, err := c.create(string(csr), "")
	if err != nil {
		t.Fatal(err)
	}
	leaf, _, roots, err := identity.SplitChain(chain)
	if err != nil || len(roots) != 2 {
		t.Fatalf("chain: %v, %d roots, want 2", err, len(roots))
	}
	last, _ := identity.ParseCertsPEM([]byte(chain[len(chain)-1]))
	if err := leaf.CheckSignatureFrom(last[0]); err != nil {
		t.Errorf("last element is not the signing root: %v", err)
	}
	// Activate: the next root signs, the old one stays trusted.
	if err := identity.ActivateRoot(f.dir + "/ca"); err != nil {
		t.Fatal(err)
	}
	if err := f.ca.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.create(string(csr), ""); err != nil {
		t.Fatalf("after activation, the old node credential (old root, still trusted): %v", err)
	}
	if err := identity.RetireRoots(f.dir + "/ca"); err != nil {
		t.Fatal(err)
	}
	if err := f.ca.Reload(); err != nil {
		t.Fatal(err)
	}
	if got := len(f.ca.Roots()); got != 1 {
		t.Errorf("after retirement %d roots, want 1", got)
	}
}
