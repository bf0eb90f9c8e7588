// Package istioid reads a peer's identity from its certificate the way
// Istio does, for the interop tests and cmd/istio-hbone-peer.
package istioid

import (
	"crypto/x509"
	"fmt"

	istiospiffe "istio.io/istio/pkg/spiffe"
	istiopki "istio.io/istio/security/pkg/pki/util"
)

// PeerID returns the identity in the DER certificate raw as Istio reads
// it: its one URI SAN, which must parse as a SPIFFE identity.
func PeerID(raw []byte) (string, error) {
	leaf, err := x509.ParseCertificate(raw)
	if err != nil {
		return "", err
	}
	ids, err := istiopki.ExtractIDs(leaf.Extensions)
	if err != nil {
		return "", err
	}
	if len(ids) != 1 {
		return "", fmt.Errorf("certificate carries %d identities %q, want 1", len(ids), ids)
	}
	if _, err := istiospiffe.ParseIdentity(ids[0]); err != nil {
		return "", fmt.Errorf("%q: %w", ids[0], err)
	}
	return ids[0], nil
}
