// Package identity gives mesh workloads their SPIFFE identities: workload IDs
// of the form spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>, a
// built-in certificate authority that persists its root in a directory and
// issues short-lived X509-SVIDs, a per-node Source that keeps the SVIDs of the
// node's local workloads renewed in the background, and the mutual-TLS
// configurations HBONE uses on both ends of a tunnel.
//
// Verification is done by go-spiffe (github.com/spiffe/go-spiffe/v2): peers
// are checked against the trust bundle and authorized by SPIFFE ID, never by
// host name. TLS session resumption is disabled on both ends because go-spiffe
// runs its checks in VerifyPeerCertificate, which Go's TLS stack skips on
// resumed sessions.
package identity

import (
	"fmt"
	"strings"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/identity/workloadid"
)

// WorkloadID returns the SPIFFE ID of the Kubernetes service account sa in
// namespace ns: spiffe://<td>/ns/<ns>/sa/<sa>.
func WorkloadID(td spiffeid.TrustDomain, ns, sa string) (spiffeid.ID, error) {
	if td.IsZero() {
		return spiffeid.ID{}, fmt.Errorf("identity: workload ID for namespace %q, service account %q: empty trust domain", ns, sa)
	}
	id, err := workloadid.New(td, ns, sa)
	if err != nil {
		return spiffeid.ID{}, fmt.Errorf("identity: workload ID for namespace %q, service account %q in %s: %w", ns, sa, td, err)
	}
	return id, nil
}

// ParseWorkloadID splits a workload SPIFFE ID into its namespace and service
// account. It fails for IDs whose path is not exactly /ns/<ns>/sa/<sa>.
func ParseWorkloadID(id spiffeid.ID) (ns, sa string, err error) {
	ns, sa, ok := workloadid.Split(id.Path())
	if !ok {
		return "", "", fmt.Errorf("identity: %q is not a workload ID of the form spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>", id.String())
	}
	return ns, sa, nil
}

// NodeID returns the SPIFFE ID of the meshtun node proxy named node, the
// identity of its node credential: spiffe://<td>/meshtun/node/<node>.
func NodeID(td spiffeid.TrustDomain, node string) (spiffeid.ID, error) {
	id, err := spiffeid.FromSegments(td, "meshtun", "node", node)
	if err != nil {
		return spiffeid.ID{}, fmt.Errorf("identity: node ID for node %q in %s: %w", node, td, err)
	}
	return id, nil
}

// ParseNodeID returns the node name of a node ID made by NodeID.
func ParseNodeID(id spiffeid.ID) (string, error) {
	parts := strings.Split(strings.TrimPrefix(id.Path(), "/"), "/")
	if len(parts) != 3 || parts[0] != "meshtun" || parts[1] != "node" || parts[2] == "" {
		return "", fmt.Errorf("identity: %q is not a node ID of the form spiffe://<trust-domain>/meshtun/node/<node>", id.String())
	}
	return parts[2], nil
}

// CAServerID returns the SPIFFE ID that the certificate service (`meshtun
// ca`) presents to its clients: spiffe://<td>/meshtun/ca.
func CAServerID(td spiffeid.TrustDomain) spiffeid.ID {
	return spiffeid.RequireFromSegments(td, "meshtun", "ca")
}
