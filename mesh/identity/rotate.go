package identity

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// Files of a root rotation inside CAConfig.Dir. A rotation has three
// steps, each of which must reach every node before the next (nodes learn
// the CA's roots with every certificate they get, so waiting one SVID
// lifetime is enough):
//
//  1. PrepareRoot creates the next root (NextRootKeyFile, NextRootCertFile).
//     It is trusted from now on but signs nothing yet.
//  2. ActivateRoot makes the next root the signing root; the old root moves
//     to PreviousRootsFile and stays trusted.
//  3. RetireRoots drops the previous roots from the trust bundle.
//
// Established connections are never touched by any step: TLS verifies a
// peer once, at the handshake.
const (
	NextRootKeyFile   = "next-root-key.pem"
	NextRootCertFile  = "next-root-cert.pem"
	PreviousRootsFile = "previous-roots.pem"
)

// loadTrusted sets ca.trusted from the signing root and the rotation files.
func (ca *CA) loadTrusted() error {
	next, err := readCerts(filepath.Join(ca.dir, NextRootCertFile))
	if err != nil {
		return err
	}
	trusted := append([]*x509.Certificate{ca.root}, next...)
	prev, err := readCerts(filepath.Join(ca.dir, PreviousRootsFile))
	if err != nil {
		return err
	}
	now := ca.now()
	for _, c := range prev {
		if now.Before(c.NotAfter) && !c.Equal(ca.root) {
			trusted = append(trusted, c)
		}
	}
	ca.trusted = trusted
	return nil
}

// Reload reads the CA directory again: after ActivateRoot it signs with the
// new root, and its bundle follows PrepareRoot and RetireRoots. On error
// the CA keeps its current roots.
func (ca *CA) Reload() error {
	unlock, err := lockDir(ca.dir)
	if err != nil {
		return err
	}
	defer unlock()
	keyPath := filepath.Join(ca.dir, RootKeyFile)
	certPath := filepath.Join(ca.dir, RootCertFile)
	tmp := &CA{td: ca.td, dir: ca.dir, ttl: ca.ttl, now: ca.now}
	if tmp.key, err = readKey(keyPath); err != nil {
		return err
	}
	if tmp.root, err = tmp.readRoot(certPath, keyPath); err != nil {
		return err
	}
	if err := tmp.loadTrusted(); err != nil {
		return err
	}
	ca.mu.Lock()
	changed := !ca.root.Equal(tmp.root) || len(ca.trusted) != len(tmp.trusted)
	ca.key, ca.root, ca.trusted = tmp.key, tmp.root, tmp.trusted
	ca.mu.Unlock()
	if changed {
		ca.log.Info().Str("signing_root_serial", tmp.root.SerialNumber.Text(16)).Int("trusted_roots", len(tmp.trusted)).
			Msg("CA roots reloaded")
	}
	return nil
}

// PrepareRoot creates the next root of the CA in dir (step 1 of a
// rotation), valid for ttl (DefaultRootTTL if zero). It fails if a next
// root is already prepared.
func PrepareRoot(dir string, td spiffeid.TrustDomain, ttl time.Duration) (*x509.Certificate, error) {
	if ttl <= 0 {
		ttl = DefaultRootTTL
	}
	unlock, err := lockDir(dir)
	if err != nil {
		return nil, err
	}
	defer unlock()
	keyPath := filepath.Join(dir, NextRootKeyFile)
	if ok, err := exists(keyPath); err != nil {
		return nil, err
	} else if ok {
		return nil, fmt.Errorf("identity: a next root is already prepared in %s; activate it first", dir)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("identity: generate next root key: %w", err)
	}
	ca := &CA{td: td, key: key, now: time.Now}
	// The certificate first: a key without a certificate would be taken
	// for a half-finished preparation.
	root, err := ca.createRoot(filepath.Join(dir, NextRootCertFile), ttl)
	if err != nil {
		return nil, err
	}
	if err := writeKey(keyPath, key); err != nil {
		os.Remove(filepath.Join(dir, NextRootCertFile))
		return nil, err
	}
	return root, nil
}

// ActivateRoot makes the prepared next root the signing root of the CA in
// dir (step 2 of a rotation) and keeps the old root trusted in
// PreviousRootsFile.
func ActivateRoot(dir string) error {
	unlock, err := lockDir(dir)
	if err != nil {
		return err
	}
	defer unlock()
	nextKey, nextCert := filepath.Join(dir, NextRootKeyFile), filepath.Join(dir, NextRootCertFile)
	if ok, err := exists(nextKey); err != nil {
		return err
	} else if !ok {
		return fmt.Errorf("identity: no next root prepared in %s (%s missing)", dir, NextRootKeyFile)
	}
	if _, err := readKey(nextKey); err != nil {
		return err
	}
	old, err := os.ReadFile(filepath.Join(dir, RootCertFile))
	if err != nil {
		return fmt.Errorf("identity: read the current root: %w", err)
	}
	prevPath := filepath.Join(dir, PreviousRootsFile)
	prev, err := os.ReadFile(prevPath)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("identity: read previous roots: %w", err)
	}
	if err := writeFileAtomic(prevPath, append(prev, old...), 0o644); err != nil {
		return err
	}
	// Key first: between the two renames the new key sits next to the old
	// certificate, which OpenCA refuses (mismatch) rather than misusing.
	if err := os.Rename(nextKey, filepath.Join(dir, RootKeyFile)); err != nil {
		return fmt.Errorf("identity: activate next root key: %w", err)
	}
	if err := os.Rename(nextCert, filepath.Join(dir, RootCertFile)); err != nil {
		return fmt.Errorf("identity: activate next root certificate: %w", err)
	}
	return nil
}

// RetireRoots removes the previous roots of the CA in dir from its trust
// bundle (step 3 of a rotation).
func RetireRoots(dir string) error {
	unlock, err := lockDir(dir)
	if err != nil {
		return err
	}
	defer unlock()
	if err := os.Remove(filepath.Join(dir, PreviousRootsFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("identity: retire previous roots: %w", err)
	}
	return nil
}

// readCerts reads the PEM certificates of path; a missing file holds none.
func readCerts(path string) ([]*x509.Certificate, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("identity: read %s: %w", path, err)
	}
	certs, err := ParseCertsPEM(data)
	if err != nil {
		return nil, fmt.Errorf("identity: %s: %w", path, err)
	}
	return certs, nil
}

// ParseCertsPEM parses every CERTIFICATE block of data; other blocks are an
// error, and so is data without any certificate.
func ParseCertsPEM(data []byte) ([]*x509.Certificate, error) {
	var certs []*x509.Certificate
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			return nil, fmt.Errorf("PEM block %d is %q, want CERTIFICATE", len(certs)+1, b.Type)
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("certificate %d: %w", len(certs)+1, err)
		}
		certs = append(certs, c)
	}
	if len(certs) == 0 {
		return nil, errors.New("no PEM certificate")
	}
	return certs, nil
}

// EncodeCertsPEM encodes certs as PEM CERTIFICATE blocks.
func EncodeCertsPEM(certs []*x509.Certificate) []byte {
	var out []byte
	for _, c := range certs {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})...)
	}
	return out
}
