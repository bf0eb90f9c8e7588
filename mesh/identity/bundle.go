package identity

import (
	"crypto/x509"
	"slices"
	"sync"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// TrustBundle is the changing set of root certificates of one trust
// domain: a node's remote CA client replaces it with the roots of every
// certificate response, so that a root rotation reaches the node with its
// next renewal. It implements x509bundle.Source and is safe for concurrent
// use; handshakes read the roots current at the time.
type TrustBundle struct {
	td spiffeid.TrustDomain

	mu     sync.RWMutex
	roots  []*x509.Certificate
	bundle *x509bundle.Bundle
}

// NewTrustBundle returns a bundle of td holding roots.
func NewTrustBundle(td spiffeid.TrustDomain, roots []*x509.Certificate) *TrustBundle {
	b := &TrustBundle{td: td}
	b.Set(roots)
	return b
}

// Set replaces the roots and reports whether they changed.
func (b *TrustBundle) Set(roots []*x509.Certificate) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if slices.EqualFunc(b.roots, roots, (*x509.Certificate).Equal) {
		return false
	}
	b.roots = slices.Clone(roots)
	b.bundle = x509bundle.FromX509Authorities(b.td, b.roots)
	return true
}

// Roots returns the current roots.
func (b *TrustBundle) Roots() []*x509.Certificate {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.roots
}

// Pool returns the current roots as a certificate pool.
func (b *TrustBundle) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	for _, r := range b.Roots() {
		p.AddCert(r)
	}
	return p
}

// GetX509BundleForTrustDomain implements x509bundle.Source.
func (b *TrustBundle) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	// The bundle answers for other trust domains with go-spiffe's own
	// error, which the logs and tests know.
	return b.bundle.GetX509BundleForTrustDomain(td)
}
