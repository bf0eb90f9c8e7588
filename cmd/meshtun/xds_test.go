package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// TestIstiodIssuerFlags checks that --ca-address's settings are refused
// with an error naming the flag and the file, before anything is asked.
func TestIstiodIssuerFlags(t *testing.T) {
	dir := t.TempDir()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(dir, "root-cert.pem")
	token := filepath.Join(dir, "istio-token")
	garbage := filepath.Join(dir, "garbage.pem")
	for p, b := range map[string][]byte{
		root:    pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		token:   []byte("tok"),
		garbage: []byte("not PEM"),
	} {
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	good := xdsFlags{caAddress: "istiod.istio-system.svc:15012", caRootCert: root, token: token, clusterID: "Kubernetes"}
	for _, tc := range []struct {
		name string
		edit func(f *xdsFlags)
		want string // "" for success
	}{
		{"good", func(*xdsFlags) {}, ""},
		{"no port", func(f *xdsFlags) { f.caAddress = "istiod.istio-system.svc" }, "--ca-address"},
		{"no root file", func(f *xdsFlags) { f.caRootCert = filepath.Join(dir, "missing.pem") }, "--ca-root-cert"},
		{"root not PEM", func(f *xdsFlags) { f.caRootCert = garbage }, "garbage.pem"},
		{"no token", func(f *xdsFlags) { f.token = filepath.Join(dir, "missing-token") }, "--xds-token"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := good
			tc.edit(&f)
			r, err := istiodIssuer(f, td, 0, zerolog.Nop())
			if tc.want == "" {
				if err != nil {
					t.Fatalf("istiodIssuer: %v", err)
				}
				r.Close()
				return
			}
			if err == nil {
				r.Close()
				t.Fatalf("accepted; want an error naming %s", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not name %s", err, tc.want)
			}
		})
	}
}
