package identity

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"
)

// ImpersonatedIdentityKey is the field of a certificate request's metadata
// that names the identity a node proxy asks for on behalf of a workload,
// as ztunnel sends it to istiod.
const ImpersonatedIdentityKey = "ImpersonatedIdentity"

// Files of a node credential directory (written by `meshtun ca issue-node`).
const (
	NodeCertFile  = "cert.pem"  // the node's certificate (its NodeID)
	NodeKeyFile   = "key.pem"   // its key, mode 0600
	NodeRootsFile = "roots.pem" // the CA's roots when the credential was issued
)

// RemoteConfig configures DialCA.
type RemoteConfig struct {
	// Address is host:port of the certificate service.
	Address string
	// TrustDomain is the mesh's trust domain.
	TrustDomain spiffeid.TrustDomain
	// Bundle verifies the service's certificate. Every response replaces
	// its roots with those the service sends. Required.
	Bundle *TrustBundle
	// ServerID is the SPIFFE ID the service must present; CAServerID if
	// zero and ServerName is empty.
	ServerID spiffeid.ID
	// ServerName, if set, is the DNS name the service's certificate must
	// carry instead of a SPIFFE ID: istiod's serving certificate names
	// its Service (istiod.istio-system.svc), not a SPIFFE identity.
	ServerName string
	// ClusterID, if set, is sent as the "ClusterID" request header, as
	// Istio's agents do: istiod reviews the bearer token with that
	// cluster's API server.
	ClusterID string
	// Credential, if set, returns the node's client certificate.
	Credential func() (*tls.Certificate, error)
	// Token, if set, returns a bearer token sent as "authorization".
	Token func() (string, error)
	// TTL is the validity asked for; the service may shorten it. Zero
	// leaves it to the service.
	TTL time.Duration
	// Timeout bounds one request; 10 s if zero.
	Timeout time.Duration
	// Dial, if set, opens the connection to Address (tests dial from inside
	// a network namespace).
	Dial   func(ctx context.Context, addr string) (net.Conn, error)
	Logger zerolog.Logger
}

// RemoteIssuer is an Issuer that asks a certificate service speaking
// Istio's IstioCertificateService (`meshtun ca`, or istiod) for SVIDs: the
// key is made here and never leaves the node; the CSR names the identity,
// which is also sent as ImpersonatedIdentity, as ztunnel does.
type RemoteIssuer struct {
	cfg  RemoteConfig
	opts []grpc.DialOption
	used atomic.Pointer[tls.Certificate] // credential of the last handshake

	mu     sync.Mutex
	conn   *grpc.ClientConn
	client pb.IstioCertificateServiceClient
}

// DialCA returns a RemoteIssuer for cfg. It does not connect yet.
func DialCA(cfg RemoteConfig) (*RemoteIssuer, error) {
	switch {
	case cfg.Address == "":
		return nil, errors.New("identity: certificate service: no address")
	case cfg.TrustDomain.IsZero():
		return nil, errors.New("identity: certificate service: no trust domain")
	case cfg.Bundle == nil:
		return nil, errors.New("identity: certificate service: no trust bundle to verify it with")
	}
	if cfg.ServerID.IsZero() && cfg.ServerName == "" {
		cfg.ServerID = CAServerID(cfg.TrustDomain)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	tc := &tls.Config{
		MinVersion: tls.VersionTLS13,
		// Verified below against the bundle and by SPIFFE ID, not host name.
		InsecureSkipVerify: true,
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			return verifyServer(raw, cfg.Bundle, cfg.ServerID, cfg.ServerName)
		},
	}
	r := &RemoteIssuer{cfg: cfg}
	if cfg.Credential != nil {
		tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			c, err := cfg.Credential()
			if err != nil {
				cfg.Logger.Error().Err(err).Msg("node credential unavailable; asking the certificate service without one")
				return &tls.Certificate{}, nil
			}
			r.used.Store(c)
			return c, nil
		}
	}
	// Reconnect soon after the service comes back: gRPC's default backoff
	// grows to two minutes, longer than a short-lived SVID's renewal
	// window; the Source paces the requests themselves.
	opts := []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(tc)),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{
			BaseDelay: 200 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 3 * time.Second,
		}, MinConnectTimeout: 5 * time.Second})}
	if cfg.Dial != nil {
		opts = append(opts, grpc.WithContextDialer(cfg.Dial))
	}
	r.opts = opts
	if err := r.connect(); err != nil {
		return nil, err
	}
	return r, nil
}

func (r *RemoteIssuer) connect() error {
	conn, err := grpc.NewClient("passthrough:///"+r.cfg.Address, r.opts...)
	if err != nil {
		return fmt.Errorf("identity: certificate service %s: %w", r.cfg.Address, err)
	}
	r.conn, r.client = conn, pb.NewIstioCertificateServiceClient(conn)
	return nil
}

// current returns the client to use. The service authenticates the node
// credential presented at the TLS handshake: when the credential changed
// (an operator issued a new one), it reconnects so that the new one is
// presented.
func (r *RemoteIssuer) current() pb.IstioCertificateServiceClient {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cfg.Credential != nil {
		if used := r.used.Load(); used != nil {
			if cur, err := r.cfg.Credential(); err == nil && cur != used {
				r.cfg.Logger.Info().Msg("node credential changed; reconnecting to the certificate service")
				old := r.conn
				if err := r.connect(); err == nil {
					r.used.Store(nil)
					old.Close()
				}
			}
		}
	}
	return r.client
}

// Bundle returns the trust bundle the issuer keeps current.
func (r *RemoteIssuer) Bundle() *TrustBundle { return r.cfg.Bundle }

// Close closes the connection to the service.
func (r *RemoteIssuer) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.conn.Close()
}

// verifyServer verifies the service's chain against the bundle, and its
// leaf by DNS name if name is set, else by SPIFFE ID.
func verifyServer(raw [][]byte, bundle *TrustBundle, want spiffeid.ID, name string) error {
	if len(raw) == 0 {
		return errors.New("identity: certificate service presented no certificate")
	}
	certs := make([]*x509.Certificate, len(raw))
	for i, r := range raw {
		c, err := x509.ParseCertificate(r)
		if err != nil {
			return fmt.Errorf("identity: certificate service: %w", err)
		}
		certs[i] = c
	}
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	if _, err := certs[0].Verify(x509.VerifyOptions{Roots: bundle.Pool(), Intermediates: inter, DNSName: name,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		return fmt.Errorf("identity: certificate service not trusted: %w", err)
	}
	if name != "" {
		return nil
	}
	id, err := x509svid.IDFromCert(certs[0])
	if err != nil || id != want {
		return fmt.Errorf("identity: certificate service is %v, want %s", id, want)
	}
	return nil
}

// Issue makes a new P-256 key, sends a CSR for id and returns the SVID. The
// roots in the response become the bundle's roots.
func (r *RemoteIssuer) Issue(ctx context.Context, id spiffeid.ID) (*x509svid.SVID, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate key: %w", err)
	}
	csr, err := NewCSR(key, id)
	if err != nil {
		return nil, err
	}
	md, err := structpb.NewStruct(map[string]any{ImpersonatedIdentityKey: id.String()})
	if err != nil {
		return nil, err
	}
	req := &pb.IstioCertificateRequest{Csr: string(csr), ValidityDuration: int64(r.cfg.TTL / time.Second), Metadata: md}
	if r.cfg.Token != nil {
		tok, err := r.cfg.Token()
		if err != nil {
			return nil, fmt.Errorf("bearer token: %w", err)
		}
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	if r.cfg.ClusterID != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "ClusterID", r.cfg.ClusterID)
	}
	ctx, cancel := context.WithTimeout(ctx, r.cfg.Timeout)
	defer cancel()
	resp, err := r.current().CreateCertificate(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("certificate service %s: %w", r.cfg.Address, err)
	}
	leaf, inter, roots, err := SplitChain(resp.GetCertChain())
	if err != nil {
		return nil, fmt.Errorf("certificate service %s: %w", r.cfg.Address, err)
	}
	if len(roots) > 0 && r.cfg.Bundle.Set(roots) {
		r.cfg.Logger.Info().Int("roots", len(roots)).Msg("trust bundle updated from the certificate service")
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	raw := leaf.Raw
	for _, c := range inter {
		raw = append(raw, c.Raw...)
	}
	svid, err := x509svid.ParseRaw(raw, keyDER)
	if err != nil {
		return nil, fmt.Errorf("certificate service %s: %w", r.cfg.Address, err)
	}
	if svid.ID != id {
		return nil, fmt.Errorf("certificate service %s returned a certificate for %s, asked for %s", r.cfg.Address, svid.ID, id)
	}
	return svid, nil
}

// NewCSR returns a PEM certificate request signed by key with id as its
// only URI SAN.
func NewCSR(key *ecdsa.PrivateKey, id spiffeid.ID) ([]byte, error) {
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{id.URL()}}, key)
	if err != nil {
		return nil, fmt.Errorf("create CSR for %s: %w", id, err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}), nil
}

// SplitChain parses a certificate response: the leaf first, then
// intermediates, then self-signed roots (one or more: during a rotation the
// service sends every root it trusts).
func SplitChain(chain []string) (leaf *x509.Certificate, inter, roots []*x509.Certificate, err error) {
	if len(chain) == 0 {
		return nil, nil, nil, errors.New("empty certificate chain")
	}
	for i, p := range chain {
		certs, err := ParseCertsPEM([]byte(p))
		if err != nil {
			return nil, nil, nil, fmt.Errorf("chain element %d: %w", i, err)
		}
		for _, c := range certs {
			switch {
			case leaf == nil:
				leaf = c
			case c.IsCA && c.CheckSignatureFrom(c) == nil:
				roots = append(roots, c)
			default:
				inter = append(inter, c)
			}
		}
	}
	return leaf, inter, roots, nil
}

// NodeCredential reads a node credential directory (NodeCertFile,
// NodeKeyFile) and reads it again when the files change, so that an
// operator can replace the credential of a running node.
type NodeCredential struct {
	dir string

	mu    sync.Mutex
	mtime time.Time
	cert  *tls.Certificate
}

// OpenNodeCredential loads the credential in dir.
func OpenNodeCredential(dir string) (*NodeCredential, error) {
	c := &NodeCredential{dir: dir}
	if _, err := c.Get(); err != nil {
		return nil, err
	}
	return c, nil
}

// Get returns the current credential.
func (c *NodeCredential) Get() (*tls.Certificate, error) {
	certPath, keyPath := filepath.Join(c.dir, NodeCertFile), filepath.Join(c.dir, NodeKeyFile)
	fi, err := os.Stat(certPath)
	if err != nil {
		return nil, fmt.Errorf("identity: node credential: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cert != nil && fi.ModTime().Equal(c.mtime) {
		return c.cert, nil
	}
	if ki, err := os.Stat(keyPath); err != nil {
		return nil, fmt.Errorf("identity: node credential: %w", err)
	} else if ki.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("identity: node credential key %s has mode %#o, readable beyond its owner; want 0600", keyPath, ki.Mode().Perm())
	}
	cert, err := tls.LoadX509KeyPair(certPath, keyPath)
	if err != nil {
		return nil, fmt.Errorf("identity: node credential in %s: %w", c.dir, err)
	}
	c.cert, c.mtime = &cert, fi.ModTime()
	return c.cert, nil
}

// Roots returns the roots stored with the credential (NodeRootsFile).
func (c *NodeCredential) Roots() ([]*x509.Certificate, error) {
	certs, err := readCerts(filepath.Join(c.dir, NodeRootsFile))
	if err == nil && len(certs) == 0 {
		err = fmt.Errorf("identity: node credential: %s missing", filepath.Join(c.dir, NodeRootsFile))
	}
	return certs, err
}

// WriteNodeCredential writes a node credential directory: the chain's
// leaf as NodeCertFile, key as NodeKeyFile (0600) and roots as
// NodeRootsFile.
func WriteNodeCredential(dir string, leaf *x509.Certificate, key *ecdsa.PrivateKey, roots []*x509.Certificate) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("identity: node credential: %w", err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	if err := writeFileAtomic(filepath.Join(dir, NodeKeyFile), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		return err
	}
	if err := writeFileAtomic(filepath.Join(dir, NodeRootsFile), EncodeCertsPEM(roots), 0o644); err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(dir, NodeCertFile), EncodeCertsPEM([]*x509.Certificate{leaf}), 0o644)
}

// TokenFile returns a RemoteConfig.Token that reads the bearer token in
// path on every request: the kubelet rotates projected tokens in place.
func TokenFile(path string) func() (string, error) {
	return func() (string, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return "", fmt.Errorf("service-account token: %w", err)
		}
		tok := strings.TrimSpace(string(b))
		if tok == "" {
			return "", fmt.Errorf("service-account token: %s is empty", path)
		}
		return tok, nil
	}
}
