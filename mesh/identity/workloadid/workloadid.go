// Package workloadid is the one definition of the SPIFFE ID of a mesh
// workload, spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>
// (Kubernetes' and Istio's form): New builds it, Split takes its path
// apart. It imports nothing of meshtun, so that every package that names
// a workload identity (identity, registry, policy) can use it.
package workloadid

import (
	"strings"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// New returns spiffe://<td>/ns/<ns>/sa/<sa>, or an error if a segment is
// not a valid SPIFFE path segment (empty, ".", "..", a '/' or a character
// SPIFFE does not allow).
func New(td spiffeid.TrustDomain, ns, sa string) (spiffeid.ID, error) {
	return spiffeid.FromSegments(td, "ns", ns, "sa", sa)
}

// Split returns the namespace and service account of a workload ID's
// path, "/ns/<ns>/sa/<sa>"; ok is false for any other path. It does not
// allocate (the policy engine calls it per connection).
func Split(path string) (ns, sa string, ok bool) {
	rest, ok := strings.CutPrefix(path, "/ns/")
	if !ok {
		return "", "", false
	}
	i := strings.IndexByte(rest, '/')
	if i <= 0 {
		return "", "", false
	}
	ns, rest = rest[:i], rest[i:]
	sa, ok = strings.CutPrefix(rest, "/sa/")
	if !ok || sa == "" || strings.IndexByte(sa, '/') >= 0 {
		return "", "", false
	}
	return ns, sa, true
}
