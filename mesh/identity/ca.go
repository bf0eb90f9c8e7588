package identity

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"golang.org/x/sys/unix"
)

// File names of the CA root inside CAConfig.Dir.
const (
	RootKeyFile  = "root-key.pem"
	RootCertFile = "root-cert.pem"
)

// Defaults used when the corresponding CAConfig field is zero.
const (
	DefaultSVIDTTL = 4 * time.Hour
	DefaultRootTTL = 10 * 365 * 24 * time.Hour
)

// backdate is how far before the issuing time certificates start to be
// valid, so that peers whose clocks run slightly behind accept them.
const backdate = time.Minute

// CAConfig configures OpenCA.
type CAConfig struct {
	// Dir holds the root key (RootKeyFile, mode 0600) and certificate
	// (RootCertFile). It is created with mode 0700 if missing.
	Dir string
	// TrustDomain is the trust domain the CA issues for.
	TrustDomain spiffeid.TrustDomain
	// SVIDTTL is the lifetime of issued SVIDs; DefaultSVIDTTL if zero.
	SVIDTTL time.Duration
	// RootTTL is the lifetime of a newly created root; DefaultRootTTL if
	// zero. It has no effect when an existing root is loaded.
	RootTTL time.Duration
	// Now is the CA's clock; time.Now if nil.
	Now func() time.Time
	// Logger receives one line when a root is created or loaded.
	Logger zerolog.Logger
}

// CA is a built-in certificate authority: a self-signed ECDSA P-256 root that
// issues X509-SVIDs for one trust domain. It implements Issuer. It is safe for
// concurrent use.
type CA struct {
	td  spiffeid.TrustDomain
	dir string
	ttl time.Duration
	now func() time.Time
	log zerolog.Logger

	mu      sync.RWMutex
	key     *ecdsa.PrivateKey
	root    *x509.Certificate   // signs
	trusted []*x509.Certificate // root first, then the next and previous roots (rotation)
}

// OpenCA loads the CA root from cfg.Dir, or creates and stores a new one when
// the directory holds neither file. An existing key without a certificate
// gets a new self-signed certificate for the same key; a certificate without
// its key is an error, as are unreadable, corrupt or mismatched files, a key
// file readable by group or others, and a root of another trust domain.
func OpenCA(cfg CAConfig) (*CA, error) {
	if cfg.TrustDomain.IsZero() {
		return nil, errors.New("identity: CA needs a trust domain")
	}
	if cfg.Dir == "" {
		return nil, fmt.Errorf("identity: CA for %s needs a directory", cfg.TrustDomain)
	}
	ca := &CA{td: cfg.TrustDomain, dir: cfg.Dir, ttl: cfg.SVIDTTL, now: cfg.Now, log: cfg.Logger}
	if ca.ttl <= 0 {
		ca.ttl = DefaultSVIDTTL
	}
	if ca.now == nil {
		ca.now = time.Now
	}
	rootTTL := cfg.RootTTL
	if rootTTL <= 0 {
		rootTTL = DefaultRootTTL
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("identity: CA directory: %w", err)
	}
	// Node proxies sharing the directory may start together: hold an
	// exclusive lock while looking for the root and creating it, so that
	// exactly one creates it and the others load that one.
	unlock, err := lockDir(cfg.Dir)
	if err != nil {
		return nil, err
	}
	defer unlock()
	keyPath := filepath.Join(cfg.Dir, RootKeyFile)
	certPath := filepath.Join(cfg.Dir, RootCertFile)
	keyExists, err := exists(keyPath)
	if err != nil {
		return nil, err
	}
	certExists, err := exists(certPath)
	if err != nil {
		return nil, err
	}
	switch {
	case !keyExists && certExists:
		return nil, fmt.Errorf("identity: CA root certificate %s exists but its key %s is missing; restore the key or remove the certificate to create a new root (peers trusting the old root will then reject this node)", certPath, keyPath)
	case !keyExists:
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, fmt.Errorf("identity: generate CA root key: %w", err)
		}
		if err := writeKey(keyPath, key); err != nil {
			return nil, err
		}
		ca.key = key
		if ca.root, err = ca.createRoot(certPath, rootTTL); err != nil {
			return nil, err
		}
		cfg.Logger.Info().Str("dir", cfg.Dir).Str("trust_domain", ca.td.String()).
			Time("not_after", ca.root.NotAfter).Msg("created CA root")
		return ca.withTrusted()
	}
	if ca.key, err = readKey(keyPath); err != nil {
		return nil, err
	}
	if !certExists {
		if ca.root, err = ca.createRoot(certPath, rootTTL); err != nil {
			return nil, err
		}
		cfg.Logger.Warn().Str("dir", cfg.Dir).Str("cert", certPath).
			Msg("CA root key had no certificate; created a new self-signed certificate for it")
		return ca.withTrusted()
	}
	if ca.root, err = ca.readRoot(certPath, keyPath); err != nil {
		return nil, err
	}
	cfg.Logger.Info().Str("dir", cfg.Dir).Str("trust_domain", ca.td.String()).
		Time("not_after", ca.root.NotAfter).Msg("loaded CA root")
	return ca.withTrusted()
}

// withTrusted loads the rotation roots of the CA's directory and returns
// the CA.
func (ca *CA) withTrusted() (*CA, error) {
	if err := ca.loadTrusted(); err != nil {
		return nil, err
	}
	return ca, nil
}

// TrustDomain returns the trust domain the CA issues for.
func (ca *CA) TrustDomain() spiffeid.TrustDomain { return ca.td }

// Root returns the CA's signing root certificate.
func (ca *CA) Root() *x509.Certificate {
	ca.mu.RLock()
	defer ca.mu.RUnlock()
	return ca.root
}

// Roots returns every root the CA's trust bundle holds: the signing root
// first, then a prepared next root and the previous roots of a rotation.
func (ca *CA) Roots() []*x509.Certificate {
	ca.mu.RLock()
	defer ca.mu.RUnlock()
	return slices.Clone(ca.trusted)
}

// Bundle returns a trust bundle holding the CA's roots (see Roots).
func (ca *CA) Bundle() *x509bundle.Bundle {
	return x509bundle.FromX509Authorities(ca.td, ca.Roots())
}

// Issue returns a new X509-SVID for id: a fresh ECDSA P-256 key and a leaf
// certificate signed by the root, with id as its only URI SAN, valid from
// one minute before now for the configured TTL (cut at the root's expiry).
func (ca *CA) Issue(ctx context.Context, id spiffeid.ID) (*x509svid.SVID, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("identity: issue SVID for %s: %w", id, err)
	}
	if !id.MemberOf(ca.td) {
		return nil, fmt.Errorf("identity: CA of trust domain %s cannot issue an SVID for %s", ca.td, id)
	}
	if id.Path() == "" {
		return nil, fmt.Errorf("identity: cannot issue an SVID for %s: the SPIFFE ID has no path", id)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("identity: issue SVID for %s: generate key: %w", id, err)
	}
	chain, err := ca.Sign(&key.PublicKey, id, 0)
	if err != nil {
		return nil, fmt.Errorf("identity: issue SVID for %s: %w", id, err)
	}
	der := chain[0].Raw
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("identity: issue SVID for %s: marshal key: %w", id, err)
	}
	svid, err := x509svid.ParseRaw(der, keyDER)
	if err != nil {
		return nil, fmt.Errorf("identity: issue SVID for %s: %w", id, err)
	}
	return svid, nil
}

// Sign issues a certificate for pub with id as its only URI SAN, valid from
// one minute before now for ttl (the CA's SVID TTL if ttl is zero or longer;
// cut at the root's expiry), signed by the signing root. It returns the
// leaf followed by the roots of the CA's trust bundle, signing root first.
// The caller has checked that whoever holds pub may be id.
func (ca *CA) Sign(pub crypto.PublicKey, id spiffeid.ID, ttl time.Duration) ([]*x509.Certificate, error) {
	if !id.MemberOf(ca.td) {
		return nil, fmt.Errorf("CA of trust domain %s cannot issue a certificate for %s", ca.td, id)
	}
	if id.Path() == "" {
		return nil, fmt.Errorf("cannot issue a certificate for %s: the SPIFFE ID has no path", id)
	}
	if ttl <= 0 || ttl > ca.ttl {
		ttl = ca.ttl
	}
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	ca.mu.RLock()
	key, root, trusted := ca.key, ca.root, ca.trusted
	ca.mu.RUnlock()
	now := ca.now()
	notAfter := now.Add(ttl)
	if notAfter.After(root.NotAfter) {
		notAfter = root.NotAfter
	}
	if !notAfter.After(now) {
		return nil, fmt.Errorf("CA root expired at %s", root.NotAfter.Format(time.RFC3339))
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{Organization: []string{"meshtun"}},
		URIs:                  []*url.URL{id.URL()},
		NotBefore:             now.Add(-backdate),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, root, pub, key)
	if err != nil {
		return nil, fmt.Errorf("sign certificate: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse new certificate: %w", err)
	}
	return append([]*x509.Certificate{leaf}, trusted...), nil
}

func (ca *CA) createRoot(certPath string, ttl time.Duration) (*x509.Certificate, error) {
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	now := ca.now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{Organization: []string{"meshtun"}, CommonName: "meshtun root CA " + ca.td.Name()},
		URIs:                  []*url.URL{ca.td.ID().URL()},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(ttl),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &ca.key.PublicKey, ca.key)
	if err != nil {
		return nil, fmt.Errorf("identity: create CA root certificate: %w", err)
	}
	root, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("identity: parse new CA root certificate: %w", err)
	}
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if err := writeFileAtomic(certPath, pemBytes, 0o644); err != nil {
		return nil, err
	}
	return root, nil
}

func (ca *CA) readRoot(certPath, keyPath string) (*x509.Certificate, error) {
	data, err := os.ReadFile(certPath)
	if err != nil {
		return nil, fmt.Errorf("identity: read CA root certificate: %w", err)
	}
	block, _ := pem.Decode(data)
	if block == nil {
		return nil, fmt.Errorf("identity: CA root certificate %s is corrupt: no PEM block", certPath)
	}
	if block.Type != "CERTIFICATE" {
		return nil, fmt.Errorf("identity: CA root certificate %s holds a %q PEM block, want \"CERTIFICATE\"", certPath, block.Type)
	}
	root, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("identity: CA root certificate %s is corrupt: %w", certPath, err)
	}
	if !root.IsCA || root.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, fmt.Errorf("identity: %s is not a CA certificate (CA flag %t, key usage %#x)", certPath, root.IsCA, root.KeyUsage)
	}
	pub, ok := root.PublicKey.(*ecdsa.PublicKey)
	if !ok || !pub.Equal(&ca.key.PublicKey) {
		return nil, fmt.Errorf("identity: CA root certificate %s does not match the key in %s", certPath, keyPath)
	}
	// The root names its trust domain in its one URI SAN; a root that
	// does not (none, several, or not a SPIFFE trust domain) could be any
	// trust domain's, and is refused.
	if len(root.URIs) != 1 {
		return nil, fmt.Errorf("identity: CA root certificate %s has %d URI SANs, want exactly one naming its trust domain (spiffe://%s); cannot read its trust domain", certPath, len(root.URIs), ca.td)
	}
	td, err := spiffeid.TrustDomainFromURI(root.URIs[0])
	if err != nil || td.ID().URL().String() != root.URIs[0].String() {
		return nil, fmt.Errorf("identity: CA root certificate %s names %s, not a trust domain (want spiffe://%s); cannot read its trust domain", certPath, root.URIs[0], ca.td)
	}
	if td != ca.td {
		return nil, fmt.Errorf("identity: CA root certificate %s is for %s, want trust domain %s", certPath, root.URIs[0], ca.td)
	}
	if now := ca.now(); now.After(root.NotAfter) {
		return nil, fmt.Errorf("identity: CA root certificate %s expired at %s", certPath, root.NotAfter.Format(time.RFC3339))
	}
	return root, nil
}

func readKey(path string) (*ecdsa.PrivateKey, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("identity: CA root key: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("identity: CA root key %s is not a regular file", path)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("identity: CA root key %s has mode %#o, readable beyond its owner; want 0600 (chmod 600 %s)", path, perm, path)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("identity: read CA root key: %w", err)
	}
	block, _ := pem.Decode(data)
	if block == nil {
		return nil, fmt.Errorf("identity: CA root key %s is corrupt: no PEM block", path)
	}
	if block.Type != "PRIVATE KEY" {
		return nil, fmt.Errorf("identity: CA root key %s holds a %q PEM block, want \"PRIVATE KEY\" (PKCS#8 ECDSA P-256)", path, block.Type)
	}
	k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("identity: CA root key %s is corrupt: %w", path, err)
	}
	key, ok := k.(*ecdsa.PrivateKey)
	if !ok {
		return nil, fmt.Errorf("identity: CA root key %s is a %T, want an ECDSA P-256 key", path, k)
	}
	if key.Curve != elliptic.P256() {
		return nil, fmt.Errorf("identity: CA root key %s is on curve %s, want P-256", path, key.Curve.Params().Name)
	}
	return key, nil
}

func writeKey(path string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return fmt.Errorf("identity: marshal CA root key: %w", err)
	}
	return writeFileAtomic(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600)
}

// writeFileAtomic writes data to a temporary file in the same directory,
// with mode perm from the start, and renames it over path.
func writeFileAtomic(path string, data []byte, perm fs.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("identity: write %s: %w", path, err)
	}
	tmp := f.Name()
	fail := func(err error) error {
		f.Close()
		os.Remove(tmp)
		return fmt.Errorf("identity: write %s: %w", path, err)
	}
	if err := f.Chmod(perm); err != nil {
		return fail(err)
	}
	if _, err := f.Write(data); err != nil {
		return fail(err)
	}
	if err := f.Sync(); err != nil {
		return fail(err)
	}
	if err := f.Close(); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("identity: write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("identity: write %s: %w", path, err)
	}
	return nil
}

func exists(path string) (bool, error) {
	_, err := os.Lstat(path)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	default:
		return false, fmt.Errorf("identity: CA file: %w", err)
	}
}

func newSerial() (*big.Int, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("generate serial number: %w", err)
	}
	return serial.Add(serial, big.NewInt(1)), nil
}

// LockFile is the file in a CA directory that OpenCA locks (flock) while
// it loads or creates the root.
const LockFile = ".lock"

func lockDir(dir string) (unlock func(), err error) {
	path := filepath.Join(dir, LockFile)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if errors.Is(err, unix.EROFS) {
		// A read-only directory (a Kubernetes Secret volume): nobody can
		// create a root in it, so readers need no lock.
		return func() {}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("identity: CA lock %s: %w", path, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("identity: CA lock %s: %w", path, err)
	}
	return func() {
		unix.Flock(int(f.Fd()), unix.LOCK_UN)
		f.Close()
	}, nil
}
