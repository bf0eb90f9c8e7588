package identity

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// issueWithEKU issues an SVID for id signed by ca's root with exactly the
// extended key usages eku (none if empty).
func issueWithEKU(t *testing.T, ca *CA, id spiffeid.ID, eku ...x509.ExtKeyUsage) *x509svid.SVID {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		URIs:         []*url.URL{id.URL()},
		NotBefore:    time.Now().Add(-time.Minute),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  eku,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.root, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalPKCS8PrivateKey(key)
	svid, err := x509svid.ParseRaw(der, keyDER)
	if err != nil {
		t.Fatal(err)
	}
	return svid
}

// TestTLSExtKeyUsage: a server must present a certificate for server
// auth, a client one for client auth; a certificate for the other purpose,
// for "any", or without extended key usage is refused, though its chain
// and identity are right.
func TestTLSExtKeyUsage(t *testing.T) {
	f := newTLSFixture(t)
	bundle := f.ca.Bundle()
	goodClient := ClientTLS(f.src.Workload(f.client), f.server)
	server := func(svid *x509svid.SVID) *tls.Config {
		return ServerTLS(staticServer{map[spiffeid.ID]*x509svid.SVID{f.server: svid}, bundle}, testTD, f.pick)
	}
	client := func(svid *x509svid.SVID) *tls.Config {
		return ClientTLS(staticWorkload{svid, bundle}, f.server)
	}
	tests := []struct {
		name           string
		server, client *tls.Config
		serverRejects  bool
		want           string
	}{
		{"server with a client-auth certificate", server(issueWithEKU(t, f.ca, f.server, x509.ExtKeyUsageClientAuth)), goodClient,
			false, "server certificate rejected: leaf certificate lacks the server auth extended key usage"},
		{"server with an any-usage certificate", server(issueWithEKU(t, f.ca, f.server, x509.ExtKeyUsageAny)), goodClient,
			false, "server certificate rejected: leaf certificate lacks the server auth extended key usage"},
		{"server without extended key usage", server(issueWithEKU(t, f.ca, f.server)), goodClient,
			false, "server certificate rejected: leaf certificate lacks the server auth extended key usage"},
		{"client with a server-auth certificate", f.serverTLS, client(issueWithEKU(t, f.ca, f.client, x509.ExtKeyUsageServerAuth)),
			true, "client certificate rejected: leaf certificate lacks the client auth extended key usage"},
		{"client without extended key usage", f.serverTLS, client(issueWithEKU(t, f.ca, f.client)),
			true, "client certificate rejected: leaf certificate lacks the client auth extended key usage"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv, cli := handshake(t, "127.0.0.1:0", tt.server, tt.client)
			rejecting, other := srv.err, cli.err
			if !tt.serverRejects {
				rejecting, other = cli.err, srv.err
			}
			wantErr(t, "rejecting side", rejecting, tt.want)
			if other == nil {
				t.Error("the other side saw no error")
			}
		})
	}
	// Both usages (what the CA issues): accepted both ways.
	both := issueWithEKU(t, f.ca, f.server, x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth)
	srv, cli := handshake(t, "127.0.0.1:0", server(both), goodClient)
	if srv.err != nil || cli.err != nil {
		t.Errorf("server and client auth: server %v, client %v", srv.err, cli.err)
	}
}

// TestCARootTrustDomainUnreadable: a root whose trust domain cannot be
// read from its URI SAN (none, two, or not a trust domain) is refused.
func TestCARootTrustDomainUnreadable(t *testing.T) {
	for _, tc := range []struct {
		name string
		uris []string
		want string
	}{
		{"no URI SAN", nil, "has 0 URI SANs, want exactly one naming its trust domain"},
		{"two URI SANs", []string{"spiffe://cluster.local", "spiffe://other.example"}, "has 2 URI SANs"},
		{"a workload ID", []string{"spiffe://cluster.local/ns/default/sa/x"}, "names spiffe://cluster.local/ns/default/sa/x, not a trust domain"},
		{"not SPIFFE", []string{"https://cluster.local"}, "not a trust domain"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			ca := openCA(t, dir, testTD, 0)
			var uris []*url.URL
			for _, u := range tc.uris {
				pu, err := url.Parse(u)
				if err != nil {
					t.Fatal(err)
				}
				uris = append(uris, pu)
			}
			tmpl := &x509.Certificate{
				SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "root"}, URIs: uris,
				NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
				KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
			}
			der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &ca.key.PublicKey, ca.key)
			if err != nil {
				t.Fatal(err)
			}
			cert := filepath.Join(dir, RootCertFile)
			if err := os.WriteFile(cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err = OpenCA(CAConfig{Dir: dir, TrustDomain: testTD})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), cert) {
				t.Errorf("OpenCA: %v, want an error naming %s that says %q", err, cert, tc.want)
			}
		})
	}
}
