package identity

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// istiodLikeChain returns a root and a serving certificate issued by it
// for the DNS names, as istiod's :15012 certificate is (no SPIFFE ID).
func istiodLikeChain(t *testing.T, names ...string) (root, leaf *x509.Certificate) {
	t.Helper()
	rk, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	rt := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{Organization: []string{"cluster.local"}},
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	rder, err := x509.CreateCertificate(rand.Reader, rt, rt, &rk.PublicKey, rk)
	if err != nil {
		t.Fatal(err)
	}
	root, _ = x509.ParseCertificate(rder)
	lk, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	lt := &x509.Certificate{SerialNumber: big.NewInt(2), DNSNames: names,
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	lder, err := x509.CreateCertificate(rand.Reader, lt, root, &lk.PublicKey, rk)
	if err != nil {
		t.Fatal(err)
	}
	leaf, _ = x509.ParseCertificate(lder)
	return root, leaf
}

func TestVerifyServerByName(t *testing.T) {
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	root, leaf := istiodLikeChain(t, "istiod.istio-system.svc")
	bundle := NewTrustBundle(td, []*x509.Certificate{root})
	raw := [][]byte{leaf.Raw}
	if err := verifyServer(raw, bundle, spiffeid.ID{}, "istiod.istio-system.svc"); err != nil {
		t.Errorf("istiod's certificate by its name: %v", err)
	}
	if err := verifyServer(raw, bundle, spiffeid.ID{}, "other.istio-system.svc"); err == nil {
		t.Error("a certificate for another name was accepted")
	}
	// Without a name the service must present the CA's SPIFFE ID, which
	// a DNS-only certificate does not carry.
	if err := verifyServer(raw, bundle, CAServerID(td), ""); err == nil {
		t.Error("a certificate without the CA's SPIFFE ID was accepted")
	}
	other, _ := istiodLikeChain(t, "istiod.istio-system.svc")
	if err := verifyServer(raw, NewTrustBundle(td, []*x509.Certificate{other}), spiffeid.ID{}, "istiod.istio-system.svc"); err == nil {
		t.Error("a certificate from another root was accepted")
	}
}

func TestTokenFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "istio-token")
	tok := TokenFile(path)
	if _, err := tok(); err == nil || !strings.Contains(err.Error(), "istio-token") {
		t.Errorf("missing token file: %v, want an error naming it", err)
	}
	if err := os.WriteFile(path, []byte("  \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := tok(); err == nil || !strings.Contains(err.Error(), "empty") {
		t.Errorf("empty token file: %v, want an error", err)
	}
	// Rotated in place: read again on every call.
	for _, want := range []string{"first", "second"} {
		if err := os.WriteFile(path, []byte(want+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if got, err := tok(); err != nil || got != want {
			t.Errorf("token = %q, %v; want %q", got, err, want)
		}
	}
}
