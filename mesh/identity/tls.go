package identity

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// ALPN is the only application protocol HBONE negotiates.
const ALPN = "h2"

// WorkloadSource is what ClientTLS needs: the SVID of the workload the client
// speaks for, read at every handshake, and the trust bundles to verify the
// server with. (*Source).Workload returns one; go-spiffe's
// workloadapi.X509Source is one too.
type WorkloadSource interface {
	x509svid.Source
	x509bundle.Source
}

// ServerSource is what ServerTLS needs: the current SVID of each local
// identity and the trust bundles to verify clients with. *Source is one.
type ServerSource interface {
	SVID(id spiffeid.ID) (*x509svid.SVID, error)
	x509bundle.Source
}

// ClientTLS returns the TLS configuration of an HBONE client that speaks for
// src's workload and accepts only a server whose SVID is want: TLS 1.3 only,
// ALPN h2, no SNI (ServerName stays empty; the server is verified by its
// SPIFFE ID against src's trust bundle, never by host name), src's current
// SVID presented at each handshake, and no session cache (resumed sessions
// would skip the SPIFFE checks).
func ClientTLS(src WorkloadSource, want spiffeid.ID) *tls.Config {
	cfg := &tls.Config{}
	tlsconfig.HookMTLSClientConfig(cfg, src, src, authorizeServer(want))
	cfg.MinVersion = tls.VersionTLS13
	cfg.MaxVersion = tls.VersionTLS13
	cfg.NextProtos = []string{ALPN}
	cfg.ServerName = ""
	cfg.ClientSessionCache = nil
	verify := cfg.VerifyPeerCertificate
	cfg.VerifyPeerCertificate = func(raw [][]byte, chains [][]*x509.Certificate) error {
		if err := verify(raw, chains); err != nil {
			return fmt.Errorf("identity: server certificate rejected: %w", err)
		}
		if err := checkEKU(raw, x509.ExtKeyUsageServerAuth); err != nil {
			return fmt.Errorf("identity: server certificate rejected: %w", err)
		}
		return nil
	}
	return cfg
}

func authorizeServer(want spiffeid.ID) tlsconfig.Authorizer {
	authorize := tlsconfig.AuthorizeID(want)
	return func(id spiffeid.ID, chains [][]*x509.Certificate) error {
		if err := authorize(id, chains); err != nil {
			return fmt.Errorf("server is %s, want %s", id, want)
		}
		return nil
	}
}

// ServerTLS returns the TLS configuration of an HBONE server on a node that
// serves many workloads: TLS 1.3 only, ALPN h2, a client certificate required
// and verified against src's trust bundle, any client of trust domain td
// accepted (authorization by identity is left to the caller, who reads the
// peer with PeerID), and session tickets disabled. The server certificate is
// chosen per handshake: pick maps the local address the client connected to
// (the destination pod IP) to the local identity that serves it, and that
// identity's current SVID is presented.
func ServerTLS(src ServerSource, td spiffeid.TrustDomain, pick func(local netip.Addr) (spiffeid.ID, bool)) *tls.Config {
	verify := tlsconfig.VerifyPeerCertificate(src, authorizeClient(td))
	return &tls.Config{
		MinVersion:             tls.VersionTLS13,
		MaxVersion:             tls.VersionTLS13,
		NextProtos:             []string{ALPN},
		ClientAuth:             tls.RequireAnyClientCert,
		SessionTicketsDisabled: true,
		GetCertificate: func(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
			if hello.Conn == nil {
				return nil, errors.New("identity: cannot choose a server certificate: no connection in ClientHello")
			}
			local, err := addrOf(hello.Conn.LocalAddr())
			if err != nil {
				return nil, fmt.Errorf("identity: cannot choose a server certificate: %w", err)
			}
			id, ok := pick(local.Addr())
			if !ok {
				return nil, fmt.Errorf("identity: no local workload serves %s", local.Addr())
			}
			svid, err := src.SVID(id)
			if err != nil {
				return nil, err
			}
			return certificate(svid), nil
		},
		VerifyPeerCertificate: func(raw [][]byte, chains [][]*x509.Certificate) error {
			if err := verify(raw, chains); err != nil {
				return fmt.Errorf("identity: client certificate rejected: %w", err)
			}
			if err := checkEKU(raw, x509.ExtKeyUsageClientAuth); err != nil {
				return fmt.Errorf("identity: client certificate rejected: %w", err)
			}
			return nil
		},
	}
}

// checkEKU requires the peer's leaf certificate to name want in its
// extended key usage: server auth for a server, client auth for a client.
// go-spiffe verifies the chain for any usage; a certificate issued for one
// purpose must not serve the other, and "any" or no usage at all is not
// enough.
func checkEKU(raw [][]byte, want x509.ExtKeyUsage) error {
	if len(raw) == 0 {
		return errors.New("no certificate")
	}
	leaf, err := x509.ParseCertificate(raw[0])
	if err != nil {
		return fmt.Errorf("leaf certificate: %w", err)
	}
	if !slices.Contains(leaf.ExtKeyUsage, want) {
		return fmt.Errorf("leaf certificate lacks the %s extended key usage", ekuName(want))
	}
	return nil
}

func ekuName(u x509.ExtKeyUsage) string {
	if u == x509.ExtKeyUsageServerAuth {
		return "server auth"
	}
	return "client auth"
}

func authorizeClient(td spiffeid.TrustDomain) tlsconfig.Authorizer {
	authorize := tlsconfig.AuthorizeMemberOf(td)
	return func(id spiffeid.ID, chains [][]*x509.Certificate) error {
		if err := authorize(id, chains); err != nil {
			return fmt.Errorf("client %s is not in trust domain %s", id, td)
		}
		return nil
	}
}

// PeerID returns the SPIFFE ID of the peer of a completed handshake made with
// a ClientTLS or ServerTLS configuration, which have verified the peer's
// certificate chain; PeerID itself only reads the leaf's URI SAN.
func PeerID(cs tls.ConnectionState) (spiffeid.ID, error) {
	if !cs.HandshakeComplete {
		return spiffeid.ID{}, errors.New("identity: peer ID: TLS handshake not complete")
	}
	if len(cs.PeerCertificates) == 0 {
		return spiffeid.ID{}, errors.New("identity: peer ID: peer presented no certificate")
	}
	id, err := x509svid.IDFromCert(cs.PeerCertificates[0])
	if err != nil {
		return spiffeid.ID{}, fmt.Errorf("identity: peer ID: %w", err)
	}
	return id, nil
}

// addrOf converts a TCP or UDP net.Addr to a netip.AddrPort, with IPv4-mapped
// IPv6 addresses unmapped.
func addrOf(a net.Addr) (netip.AddrPort, error) {
	switch a := a.(type) {
	case nil:
		return netip.AddrPort{}, errors.New("no address")
	case *net.TCPAddr:
		ap := a.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
	case *net.UDPAddr:
		ap := a.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
	}
	ap, err := netip.ParseAddrPort(a.String())
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("address %q of network %q is not ip:port", a.String(), a.Network())
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
}

func certificate(svid *x509svid.SVID) *tls.Certificate {
	cert := &tls.Certificate{
		Certificate: make([][]byte, 0, len(svid.Certificates)),
		PrivateKey:  svid.PrivateKey,
		Leaf:        svid.Certificates[0],
	}
	for _, c := range svid.Certificates {
		cert.Certificate = append(cert.Certificate, c.Raw)
	}
	return cert
}
