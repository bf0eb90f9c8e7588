// Package registry is the proxy's model of the mesh: workloads, services
// and authorization policies, held as an immutable Snapshot that is swapped
// atomically on every change. Readers on the packet path load the current
// snapshot without locks and look up addresses without allocating; a
// reload never stalls traffic.
package registry

import (
	"fmt"
	"net/netip"
	"sync/atomic"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// PeerAuth is a workload's peer-authentication mode.
type PeerAuth uint8

const (
	// Permissive accepts HBONE from mesh peers and plaintext from anyone.
	Permissive PeerAuth = iota
	// Strict accepts only HBONE with a verified identity; plaintext
	// connections to the workload are refused.
	Strict
)

func (m PeerAuth) String() string {
	if m == Strict {
		return "STRICT"
	}
	return "PERMISSIVE"
}

// Workload is a pod (or any addressable endpoint) the mesh knows.
type Workload struct {
	Name           string
	Namespace      string
	ServiceAccount string
	// Node is the name of the node the workload runs on.
	Node string
	// Addresses are the workload's IPv4 and IPv6 addresses.
	Addresses []netip.Addr
	Labels    map[string]string
	// InMesh: the workload's traffic is captured by a meshtun (or
	// ztunnel) node proxy and reachable over HBONE. A workload outside the
	// mesh is known (for services and policy) but reached in plaintext.
	InMesh   bool
	PeerAuth PeerAuth
	// Identity is spiffe://<trust domain>/ns/<Namespace>/sa/<ServiceAccount>;
	// filled in by NewSnapshot.
	Identity spiffeid.ID
}

// String returns namespace/name.
func (w *Workload) String() string { return w.Namespace + "/" + w.Name }

// Snapshot is one immutable version of the mesh model. Never modify a
// Snapshot or anything it points to after NewSnapshot.
type Snapshot struct {
	TrustDomain spiffeid.TrustDomain
	Workloads   []*Workload

	byAddr map[netip.Addr]*Workload
}

// NewSnapshot indexes workloads and fills in their identities. Two
// workloads may not share an address.
func NewSnapshot(td spiffeid.TrustDomain, workloads []*Workload) (*Snapshot, error) {
	s := &Snapshot{TrustDomain: td, Workloads: workloads, byAddr: make(map[netip.Addr]*Workload)}
	for _, w := range workloads {
		id, err := spiffeid.FromSegments(td, "ns", w.Namespace, "sa", w.ServiceAccount)
		if err != nil {
			return nil, fmt.Errorf("registry: workload %s: identity: %w", w, err)
		}
		w.Identity = id
		for _, a := range w.Addresses {
			a = a.Unmap()
			if other, dup := s.byAddr[a]; dup {
				return nil, fmt.Errorf("registry: address %s belongs to both %s and %s", a, other, w)
			}
			s.byAddr[a] = w
		}
	}
	return s, nil
}

// Workload returns the workload with address a, or nil.
func (s *Snapshot) Workload(a netip.Addr) *Workload {
	return s.byAddr[a.Unmap()]
}

// Registry holds the current Snapshot.
type Registry struct {
	cur atomic.Pointer[Snapshot]
}

// New returns a registry holding s.
func New(s *Snapshot) *Registry {
	r := &Registry{}
	r.cur.Store(s)
	return r
}

// Load returns the current snapshot. It never blocks.
func (r *Registry) Load() *Snapshot { return r.cur.Load() }

// Store makes s the current snapshot.
func (r *Registry) Store(s *Snapshot) { r.cur.Store(s) }
