// Package caserver is `meshtun ca`: a certificate service that speaks
// Istio's IstioCertificateService (istio.io/api security/v1alpha1), so that
// meshtun nodes and ztunnel-style clients can use it, and that issues a
// workload identity only to the node proxy of the node the workload runs
// on.
//
// A request is authenticated (who is the caller, and which node does it
// speak for: a node credential, or a Kubernetes service-account token), its
// CSR is checked (signature, key, a single URI SAN equal to the identity
// asked for), and the identity is authorized for the caller's node. Every
// refusal is logged with who asked for what and why not.
package caserver

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshtun/meshtun/mesh/identity"
)

// DefaultPort is the port of the service (istiod serves its CA there too).
const DefaultPort = 15012

// ReadyMessage is the log message `meshtun ca serve` writes once it
// accepts requests.
const ReadyMessage = "certificate service ready"

// RefusedMessage is the log message of every refused request.
const RefusedMessage = "certificate request refused"

// IssuedMessage is the log message of every certificate issued.
const IssuedMessage = "certificate issued"

// Caller is an authenticated client.
type Caller struct {
	// Node is the node the caller speaks for.
	Node string
	// Who describes the caller's credential for logs.
	Who string
}

// Authenticator finds out who made a request. It returns ErrNoCredential
// when the request carries no credential of its kind.
type Authenticator interface {
	Authenticate(ctx context.Context) (Caller, error)
}

// ErrNoCredential is returned by an Authenticator when the request carries
// none of the credentials it understands.
var ErrNoCredential = errors.New("no credential of this kind")

// Authorizer decides whether caller may have a certificate for id.
type Authorizer interface {
	Authorize(ctx context.Context, caller Caller, id spiffeid.ID) error
}

// Config configures New.
type Config struct {
	// CA signs the certificates. Required.
	CA *identity.CA
	// Authenticators are tried in order; the first that finds its kind of
	// credential decides. At least one is required.
	Authenticators []Authenticator
	// Authorizer decides what each node may have. Required.
	Authorizer Authorizer
	// MaxTTL caps the validity a client asks for; the CA's SVID TTL caps
	// it too.
	MaxTTL time.Duration
	// Limits bound connections, streams and message sizes.
	Limits Limits
	Logger zerolog.Logger
}

// Server is the certificate service.
type Server struct {
	pb.UnimplementedIstioCertificateServiceServer
	cfg Config

	mu   sync.Mutex
	cert *tls.Certificate // the service's own certificate
	root *x509.Certificate
	grpc *grpc.Server
	lis  *limitListener
}

// New returns a Server for cfg.
func New(cfg Config) (*Server, error) {
	switch {
	case cfg.CA == nil:
		return nil, errors.New("caserver: no CA")
	case len(cfg.Authenticators) == 0:
		return nil, errors.New("caserver: no authenticator")
	case cfg.Authorizer == nil:
		return nil, errors.New("caserver: no authorizer")
	}
	cfg.Limits = cfg.Limits.withDefaults()
	return &Server{cfg: cfg}, nil
}

// serverCertTTL is the lifetime of the service's own certificate; it is
// replaced at half-life and whenever the CA's signing root changes.
const serverCertTTL = 24 * time.Hour

// certificate returns the service's TLS certificate, made anew when the
// signing root changed or half of its life is over.
func (s *Server) certificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	root := s.cfg.CA.Root()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cert != nil && s.root.Equal(root) && time.Until(s.cert.Leaf.NotAfter) > serverCertTTL/2 {
		return s.cert, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	chain, err := s.cfg.CA.Sign(&key.PublicKey, identity.CAServerID(s.cfg.CA.TrustDomain()), serverCertTTL)
	if err != nil {
		return nil, fmt.Errorf("caserver: own certificate: %w", err)
	}
	s.cert = &tls.Certificate{Certificate: [][]byte{chain[0].Raw}, PrivateKey: key, Leaf: chain[0]}
	s.root = root
	return s.cert, nil
}

// TLSConfig returns the service's TLS configuration: TLS 1.3, its own
// certificate, client certificates requested but verified by the
// authenticators (so that a refusal is logged with its reason).
func (s *Server) TLSConfig() *tls.Config {
	return &tls.Config{
		MinVersion:             tls.VersionTLS13,
		GetCertificate:         s.certificate,
		ClientAuth:             tls.RequestClientCert,
		SessionTicketsDisabled: true,
	}
}

// Serve serves gRPC over TLS on lis until Stop, within the Limits.
func (s *Server) Serve(lis net.Listener) error {
	l := s.cfg.Limits
	g := grpc.NewServer(grpc.Creds(credentials.NewTLS(s.TLSConfig())),
		grpc.ConnectionTimeout(l.HandshakeTimeout),
		grpc.MaxConcurrentStreams(l.MaxConcurrentStreams),
		grpc.MaxRecvMsgSize(l.MaxRecvMsgSize),
		grpc.MaxHeaderListSize(l.MaxHeaderListSize),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: l.IdleTimeout}))
	pb.RegisterIstioCertificateServiceServer(g, s)
	ll := newLimitListener(lis, l.MaxConnections, l.MaxConnectionsPerSource, s.cfg.Logger)
	s.mu.Lock()
	s.grpc, s.lis = g, ll
	s.mu.Unlock()
	return g.Serve(ll)
}

// OpenConnections returns the number of connections open (0 before Serve).
func (s *Server) OpenConnections() int {
	s.mu.Lock()
	ll := s.lis
	s.mu.Unlock()
	if ll == nil {
		return 0
	}
	return ll.Open()
}

// RefusedConnections returns the number of connections refused by the
// connection limits.
func (s *Server) RefusedConnections() uint64 {
	s.mu.Lock()
	ll := s.lis
	s.mu.Unlock()
	if ll == nil {
		return 0
	}
	return ll.refused.Load()
}

// Stop stops serving and closes open connections.
func (s *Server) Stop() {
	s.mu.Lock()
	g := s.grpc
	s.mu.Unlock()
	if g != nil {
		g.Stop()
	}
}

// CreateCertificate implements IstioCertificateService.
func (s *Server) CreateCertificate(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
	log := s.cfg.Logger
	from := "unknown"
	if p, ok := peer.FromContext(ctx); ok {
		from = p.Addr.String()
	}
	asked := ""
	if md := req.GetMetadata(); md != nil {
		if v, ok := md.GetFields()[identity.ImpersonatedIdentityKey]; ok {
			asked = v.GetStringValue()
		}
	}
	refuse := func(code codes.Code, caller Caller, reason string) error {
		ev := log.Warn().Str("from", from).Str("asked_for", clip(asked)).Str("reason", clip(reason))
		if caller.Who != "" {
			ev = ev.Str("caller", clip(caller.Who)).Str("node", clip(caller.Node))
		}
		ev.Msg(RefusedMessage)
		return status.Error(code, clip(reason))
	}

	// The checks that need nothing but the request come first: a malformed
	// request costs no TokenReview.
	if len(asked) > maxIDLen {
		return nil, refuse(codes.InvalidArgument, Caller{}, fmt.Sprintf("identity asked for is %d bytes; a SPIFFE ID has at most %d", len(asked), maxIDLen))
	}
	csr, err := parseCSR(req.GetCsr())
	if err != nil {
		return nil, refuse(codes.InvalidArgument, Caller{}, err.Error())
	}
	if len(csr.URIs) != 1 || len(csr.DNSNames)+len(csr.IPAddresses)+len(csr.EmailAddresses) > 0 {
		return nil, refuse(codes.InvalidArgument, Caller{}, fmt.Sprintf("CSR must have exactly one URI SAN and no other SAN (has %d URI, %d DNS, %d IP, %d e-mail)",
			len(csr.URIs), len(csr.DNSNames), len(csr.IPAddresses), len(csr.EmailAddresses)))
	}
	san := csr.URIs[0].String()
	if asked == "" {
		asked = san // no impersonation: the CSR names the identity
	}
	if len(asked) > maxIDLen {
		return nil, refuse(codes.InvalidArgument, Caller{}, fmt.Sprintf("CSR SAN is %d bytes; a SPIFFE ID has at most %d", len(asked), maxIDLen))
	}
	id, err := spiffeid.FromString(asked)
	if err != nil {
		return nil, refuse(codes.InvalidArgument, Caller{}, fmt.Sprintf("identity asked for is not a SPIFFE ID: %v", err))
	}
	if san != id.String() {
		return nil, refuse(codes.PermissionDenied, Caller{}, fmt.Sprintf("CSR SAN %s differs from the identity asked for %s", san, id))
	}
	caller, err := s.authenticate(ctx)
	if err != nil {
		return nil, refuse(codes.Unauthenticated, Caller{}, err.Error())
	}
	if err := s.cfg.Authorizer.Authorize(ctx, caller, id); err != nil {
		return nil, refuse(codes.PermissionDenied, caller, err.Error())
	}
	ttl := time.Duration(req.GetValidityDuration()) * time.Second
	if s.cfg.MaxTTL > 0 && (ttl <= 0 || ttl > s.cfg.MaxTTL) {
		ttl = s.cfg.MaxTTL
	}
	chain, err := s.cfg.CA.Sign(csr.PublicKey, id, ttl)
	if err != nil {
		log.Error().Err(err).Str("caller", clip(caller.Who)).Str("asked_for", clip(asked)).Msg("certificate signing failed")
		return nil, status.Error(codes.Internal, "signing failed")
	}
	log.Info().Str("caller", caller.Who).Str("node", caller.Node).Str("identity", id.String()).
		Str("serial", chain[0].SerialNumber.Text(16)).Time("not_after", chain[0].NotAfter).Msg(IssuedMessage)
	return &pb.IstioCertificateResponse{CertChain: responseChain(chain)}, nil
}

// responseChain orders a CA chain (leaf, signing root, other roots) as
// Istio clients expect it: the leaf first and the signing root last; the
// other trusted roots of a rotation in between, where a client that takes
// the last element as its root ignores them and Go's verifier skips them.
func responseChain(chain []*x509.Certificate) []string {
	out := []string{pemCert(chain[0])}
	for _, c := range chain[2:] {
		out = append(out, pemCert(c))
	}
	return append(out, pemCert(chain[1]))
}

func pemCert(c *x509.Certificate) string {
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw}))
}

func (s *Server) authenticate(ctx context.Context) (Caller, error) {
	for _, a := range s.cfg.Authenticators {
		c, err := a.Authenticate(ctx)
		if errors.Is(err, ErrNoCredential) {
			continue
		}
		return c, err
	}
	return Caller{}, errors.New("no credential: neither a node certificate nor a bearer token")
}

// maxIDLen is the longest SPIFFE ID (the SPIFFE specification's URI
// limit).
const maxIDLen = 2048

func parseCSR(p string) (*x509.CertificateRequest, error) {
	b, _ := pem.Decode([]byte(p))
	if b == nil || b.Type != "CERTIFICATE REQUEST" {
		return nil, errors.New("CSR is not a PEM CERTIFICATE REQUEST")
	}
	csr, err := x509.ParseCertificateRequest(b.Bytes)
	if err != nil {
		return nil, fmt.Errorf("CSR: %w", err)
	}
	switch k := csr.PublicKey.(type) {
	case *ecdsa.PublicKey:
		if !slices.Contains([]elliptic.Curve{elliptic.P256(), elliptic.P384()}, k.Curve) {
			return nil, fmt.Errorf("CSR key on curve %s; want P-256 or P-384", k.Curve.Params().Name)
		}
	case *rsa.PublicKey:
		if k.N.BitLen() < 2048 || k.N.BitLen() > 4096 {
			return nil, fmt.Errorf("CSR RSA key of %d bits; want 2048 to 4096", k.N.BitLen())
		}
	default:
		return nil, fmt.Errorf("CSR key %T; want ECDSA or RSA", k)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fmt.Errorf("CSR signature: %w", err)
	}
	return csr, nil
}
