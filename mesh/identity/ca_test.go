package identity

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

var testTD = spiffeid.RequireTrustDomainFromString("cluster.local")

func testLogger(t *testing.T) zerolog.Logger {
	return zerolog.New(zerolog.NewTestWriter(t)).With().Timestamp().Logger()
}

func openCA(t *testing.T, dir string, td spiffeid.TrustDomain, ttl time.Duration) *CA {
	t.Helper()
	ca, err := OpenCA(CAConfig{Dir: dir, TrustDomain: td, SVIDTTL: ttl, Logger: testLogger(t)})
	if err != nil {
		t.Fatalf("OpenCA(%s): %v", dir, err)
	}
	return ca
}

func mustID(t *testing.T, td spiffeid.TrustDomain, ns, sa string) spiffeid.ID {
	t.Helper()
	id, err := WorkloadID(td, ns, sa)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func TestWorkloadID(t *testing.T) {
	id, err := WorkloadID(testTD, "default", "bookinfo-productpage")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := id.String(), "spiffe://cluster.local/ns/default/sa/bookinfo-productpage"; got != want {
		t.Errorf("WorkloadID = %s, want %s", got, want)
	}
	ns, sa, err := ParseWorkloadID(id)
	if err != nil || ns != "default" || sa != "bookinfo-productpage" {
		t.Errorf("ParseWorkloadID(%s) = %q, %q, %v", id, ns, sa, err)
	}
	for _, bad := range []struct{ ns, sa string }{{"", "sa"}, {"ns", ""}, {"a/b", "sa"}, {"ns", "UP PER"}} {
		if id, err := WorkloadID(testTD, bad.ns, bad.sa); err == nil {
			t.Errorf("WorkloadID(%q, %q) = %s, want an error", bad.ns, bad.sa, id)
		} else if !strings.Contains(err.Error(), bad.ns) {
			t.Errorf("WorkloadID(%q, %q) error %q does not name the input", bad.ns, bad.sa, err)
		}
	}
	if _, err := WorkloadID(spiffeid.TrustDomain{}, "ns", "sa"); err == nil {
		t.Error("WorkloadID with an empty trust domain: no error")
	}
	for _, path := range []string{"/ns/a", "/ns/a/sa/b/c", "/x/a/sa/b", "/ns/a/x/b"} {
		other := spiffeid.RequireFromPath(testTD, path)
		if _, _, err := ParseWorkloadID(other); err == nil {
			t.Errorf("ParseWorkloadID(%s): no error", other)
		}
	}
}

func TestCAPersistsRoot(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ca")
	first := openCA(t, dir, testTD, 0)

	st, err := os.Stat(filepath.Join(dir, RootKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	if perm := st.Mode().Perm(); perm != 0o600 {
		t.Errorf("key file mode %#o, want 0600", perm)
	}
	st, err = os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	if perm := st.Mode().Perm(); perm != 0o700 {
		t.Errorf("CA directory mode %#o, want 0700", perm)
	}
	root := first.Root()
	if !root.IsCA || len(root.URIs) != 1 || root.URIs[0].String() != "spiffe://cluster.local" {
		t.Errorf("root: CA %t, URIs %v; want a CA with URI SAN spiffe://cluster.local", root.IsCA, root.URIs)
	}
	if _, ok := root.PublicKey.(*ecdsa.PublicKey); !ok {
		t.Errorf("root key is %T, want ECDSA", root.PublicKey)
	}
	leftovers, _ := filepath.Glob(filepath.Join(dir, ".*tmp*"))
	if len(leftovers) != 0 {
		t.Errorf("temporary files left behind: %v", leftovers)
	}

	second := openCA(t, dir, testTD, 0)
	if !bytes.Equal(first.Root().Raw, second.Root().Raw) {
		t.Fatal("second start created a new root instead of reusing the stored one")
	}
	// An SVID of the second start verifies against the first start's bundle.
	id := mustID(t, testTD, "ns1", "sa1")
	svid, err := second.Issue(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := x509svid.Verify(svid.Certificates, first.Bundle()); err != nil {
		t.Errorf("SVID of the reopened CA does not verify against the first root: %v", err)
	}
}

func TestCAKeyWithoutCertGetsNewCert(t *testing.T) {
	dir := t.TempDir()
	first := openCA(t, dir, testTD, 0)
	if err := os.Remove(filepath.Join(dir, RootCertFile)); err != nil {
		t.Fatal(err)
	}
	second := openCA(t, dir, testTD, 0)
	if !first.Root().PublicKey.(*ecdsa.PublicKey).Equal(second.Root().PublicKey) {
		t.Error("new root certificate is not for the stored key")
	}
}

func TestCALoadErrors(t *testing.T) {
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	rsaDER, _ := x509.MarshalPKCS8PrivateKey(rsaKey)
	p384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	p384DER, _ := x509.MarshalPKCS8PrivateKey(p384)
	sec1DER, _ := x509.MarshalECPrivateKey(p384)

	otherDir := t.TempDir()
	openCA(t, otherDir, testTD, 0)
	otherCert, _ := os.ReadFile(filepath.Join(otherDir, RootCertFile))

	tests := []struct {
		name  string
		setup func(t *testing.T, key, cert string)
		want  []string // substrings of the error
		file  string   // RootKeyFile or RootCertFile: the error names it
	}{
		{"corrupt key", func(t *testing.T, key, cert string) { write(t, key, []byte("not a key"), 0o600) },
			[]string{"corrupt", "no PEM block"}, RootKeyFile},
		{"truncated key", func(t *testing.T, key, cert string) {
			write(t, key, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: []byte{0x30, 0x03, 0x01}}), 0o600)
		}, []string{"corrupt"}, RootKeyFile},
		{"RSA key", func(t *testing.T, key, cert string) {
			write(t, key, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: rsaDER}), 0o600)
		}, []string{"*rsa.PrivateKey", "want an ECDSA P-256 key"}, RootKeyFile},
		{"P-384 key", func(t *testing.T, key, cert string) {
			write(t, key, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: p384DER}), 0o600)
		}, []string{"P-384", "want P-256"}, RootKeyFile},
		{"SEC1 key block", func(t *testing.T, key, cert string) {
			write(t, key, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: sec1DER}), 0o600)
		}, []string{`"EC PRIVATE KEY"`, `want "PRIVATE KEY"`}, RootKeyFile},
		{"key readable by others", func(t *testing.T, key, cert string) {
			if err := os.Chmod(key, 0o644); err != nil {
				t.Fatal(err)
			}
		}, []string{"mode 0644", "want 0600"}, RootKeyFile},
		{"key is a directory", func(t *testing.T, key, cert string) {
			os.Remove(key)
			if err := os.Mkdir(key, 0o700); err != nil {
				t.Fatal(err)
			}
		}, []string{"not a regular file"}, RootKeyFile},
		{"corrupt cert", func(t *testing.T, key, cert string) { write(t, cert, []byte("garbage"), 0o644) },
			[]string{"corrupt", "no PEM block"}, RootCertFile},
		{"cert of bad DER", func(t *testing.T, key, cert string) {
			write(t, cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: []byte{1, 2, 3}}), 0o644)
		}, []string{"corrupt"}, RootCertFile},
		{"key in cert file", func(t *testing.T, key, cert string) {
			data, _ := os.ReadFile(key)
			write(t, cert, data, 0o644)
		}, []string{`"PRIVATE KEY"`, `want "CERTIFICATE"`}, RootCertFile},
		{"cert of another key", func(t *testing.T, key, cert string) { write(t, cert, otherCert, 0o644) },
			[]string{"does not match the key"}, RootCertFile},
		{"cert is a directory", func(t *testing.T, key, cert string) {
			os.Remove(cert)
			if err := os.Mkdir(cert, 0o700); err != nil {
				t.Fatal(err)
			}
		}, []string{"is a directory"}, RootCertFile},
		{"cert without key", func(t *testing.T, key, cert string) { os.Remove(key) },
			[]string{"key", "is missing"}, RootCertFile},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			openCA(t, dir, testTD, 0)
			key, cert := filepath.Join(dir, RootKeyFile), filepath.Join(dir, RootCertFile)
			tt.setup(t, key, cert)
			_, err := OpenCA(CAConfig{Dir: dir, TrustDomain: testTD})
			if err == nil {
				t.Fatal("OpenCA succeeded, want an error")
			}
			msg := err.Error()
			if !strings.Contains(msg, filepath.Join(dir, tt.file)) {
				t.Errorf("error %q does not name the file %s", msg, tt.file)
			}
			for _, w := range tt.want {
				if !strings.Contains(msg, w) {
					t.Errorf("error %q does not say %q", msg, w)
				}
			}
		})
	}

	t.Run("other trust domain", func(t *testing.T) {
		dir := t.TempDir()
		openCA(t, dir, spiffeid.RequireTrustDomainFromString("other.example"), 0)
		_, err := OpenCA(CAConfig{Dir: dir, TrustDomain: testTD})
		if err == nil || !strings.Contains(err.Error(), "spiffe://other.example") || !strings.Contains(err.Error(), "want trust domain cluster.local") {
			t.Fatalf("OpenCA of another trust domain's root: %v", err)
		}
	})
}

func write(t *testing.T, path string, data []byte, perm os.FileMode) {
	t.Helper()
	if err := os.WriteFile(path, data, perm); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, perm); err != nil {
		t.Fatal(err)
	}
}

func TestIssue(t *testing.T) {
	dir := t.TempDir()
	ca := openCA(t, dir, testTD, time.Hour)
	id := mustID(t, testTD, "prod", "frontend")
	before := time.Now()
	svid, err := ca.Issue(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	leaf := svid.Certificates[0]
	if svid.ID != id {
		t.Errorf("SVID ID %s, want %s", svid.ID, id)
	}
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != id.String() {
		t.Errorf("URI SANs %v, want exactly [%s]", leaf.URIs, id)
	}
	if len(leaf.DNSNames)+len(leaf.IPAddresses)+len(leaf.EmailAddresses) != 0 {
		t.Errorf("leaf has other SANs: %v %v %v", leaf.DNSNames, leaf.IPAddresses, leaf.EmailAddresses)
	}
	if leaf.IsCA {
		t.Error("leaf is a CA")
	}
	pub, ok := leaf.PublicKey.(*ecdsa.PublicKey)
	if !ok || pub.Curve != elliptic.P256() {
		t.Errorf("leaf key %T, want ECDSA P-256", leaf.PublicKey)
	}
	if d := leaf.NotAfter.Sub(before); d < time.Hour-time.Minute || d > time.Hour+time.Minute {
		t.Errorf("leaf valid for %s after issue, want about 1h", d)
	}
	if !leaf.NotBefore.Before(before) {
		t.Errorf("NotBefore %s is not before the issue time %s", leaf.NotBefore, before)
	}
	gotID, chains, err := x509svid.Verify(svid.Certificates, ca.Bundle())
	if err != nil || gotID != id || len(chains) == 0 {
		t.Fatalf("Verify against the CA bundle: %s, %d chains, %v", gotID, len(chains), err)
	}

	// PEM round trip through files, as another process would load it.
	certPEM, keyPEM, err := svid.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := filepath.Join(dir, "svid.pem"), filepath.Join(dir, "svid-key.pem")
	write(t, certFile, certPEM, 0o644)
	write(t, keyFile, keyPEM, 0o600)
	loaded, err := x509svid.Load(certFile, keyFile)
	if err != nil {
		t.Fatalf("x509svid.Load: %v", err)
	}
	if loaded.ID != id || !bytes.Equal(loaded.Certificates[0].Raw, leaf.Raw) {
		t.Error("loaded SVID differs from the issued one")
	}

	// Two issues give two different keys and serials.
	again, err := ca.Issue(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if again.Certificates[0].SerialNumber.Cmp(leaf.SerialNumber) == 0 {
		t.Error("two SVIDs share a serial number")
	}

	other := mustID(t, spiffeid.RequireTrustDomainFromString("other.example"), "prod", "frontend")
	if _, err := ca.Issue(context.Background(), other); err == nil || !strings.Contains(err.Error(), "other.example") {
		t.Errorf("Issue for another trust domain: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := ca.Issue(ctx, id); err == nil {
		t.Error("Issue with a cancelled context succeeded")
	}
}

// TestCAConcurrentOpen: proxies starting together on one directory end up
// with one root.
func TestCAConcurrentOpen(t *testing.T) {
	dir := t.TempDir()
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	const n = 8
	roots := make([]*x509.Certificate, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			ca, err := OpenCA(CAConfig{Dir: dir, TrustDomain: td})
			errs[i] = err
			if err == nil {
				roots[i] = ca.Root()
			}
		})
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("open %d: %v", i, errs[i])
		}
		if !roots[i].Equal(roots[0]) {
			t.Fatalf("open %d got a different root than open 0", i)
		}
	}
}
