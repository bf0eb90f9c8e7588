package caserver

import (
	"context"
	"crypto/x509"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/registry"
)

// FileMode authenticates nodes by their node credential (a client
// certificate for identity.NodeID issued by the CA) and authorizes from
// the mesh config file: a node may have the identities of the mesh
// workloads the file puts on it, nothing else. Update it with every new
// version of the file.
type FileMode struct {
	td    spiffeid.TrustDomain
	roots func() []*x509.Certificate
	now   func() time.Time
	state atomic.Pointer[fileState]
}

type fileState struct {
	nodes   map[string]bool
	revoked map[string]bool                     // serial numbers, lower-case hex
	byID    map[spiffeid.ID]map[string][]string // identity → node → workload names
}

// NewFileMode returns a FileMode for trust domain td; roots returns the
// CA's current roots, against which node credentials are verified.
func NewFileMode(td spiffeid.TrustDomain, roots func() []*x509.Certificate) *FileMode {
	f := &FileMode{td: td, roots: roots, now: time.Now}
	f.state.Store(&fileState{})
	return f
}

// Update replaces the nodes, the workload placement and the revoked
// node-credential serial numbers (hexadecimal).
func (f *FileMode) Update(nodes []string, workloads []*registry.Workload, revoked []string) {
	st := &fileState{nodes: map[string]bool{}, revoked: map[string]bool{}, byID: map[spiffeid.ID]map[string][]string{}}
	for _, n := range nodes {
		st.nodes[n] = true
	}
	for _, s := range revoked {
		st.revoked[normalizeSerial(s)] = true
	}
	for _, w := range workloads {
		if !w.InMesh {
			continue
		}
		m := st.byID[w.Identity]
		if m == nil {
			m = map[string][]string{}
			st.byID[w.Identity] = m
		}
		m[w.Node] = append(m[w.Node], w.Name)
	}
	f.state.Store(st)
}

func normalizeSerial(s string) string {
	s = strings.ToLower(strings.ReplaceAll(strings.TrimPrefix(strings.TrimPrefix(s, "0x"), "0X"), ":", ""))
	return strings.TrimLeft(s, "0")
}

// Authenticate implements Authenticator: the TLS client certificate must
// chain to one of the CA's roots, be valid now, be a node ID of the trust
// domain and not be revoked.
func (f *FileMode) Authenticate(ctx context.Context) (Caller, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return Caller{}, ErrNoCredential
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.PeerCertificates) == 0 {
		return Caller{}, ErrNoCredential
	}
	return f.verify(ti.State.PeerCertificates)
}

func (f *FileMode) verify(certs []*x509.Certificate) (Caller, error) {
	leaf := certs[0]
	who := fmt.Sprintf("node credential serial %s", leaf.SerialNumber.Text(16))
	id, err := x509svid.IDFromCert(leaf)
	if err == nil {
		who = fmt.Sprintf("node credential %s serial %s", id, leaf.SerialNumber.Text(16))
	}
	pool := x509.NewCertPool()
	for _, r := range f.roots() {
		pool.AddCert(r)
	}
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	now := f.now()
	if now.After(leaf.NotAfter) {
		return Caller{}, fmt.Errorf("%s expired at %s", who, leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		return Caller{}, fmt.Errorf("%s not trusted: %v", who, err)
	}
	if err != nil {
		return Caller{}, fmt.Errorf("%s: %v", who, err)
	}
	if !id.MemberOf(f.td) {
		return Caller{}, fmt.Errorf("%s is not of trust domain %s", who, f.td)
	}
	node, err := identity.ParseNodeID(id)
	if err != nil {
		return Caller{}, fmt.Errorf("%s is not a node credential: %v", who, err)
	}
	if f.state.Load().revoked[normalizeSerial(leaf.SerialNumber.Text(16))] {
		return Caller{}, fmt.Errorf("%s is revoked (ca.revokedNodeCredentials)", who)
	}
	return Caller{Node: node, Who: who}, nil
}

// Authorize implements Authorizer: id must be the identity of a mesh
// workload that the config file places on caller's node.
func (f *FileMode) Authorize(_ context.Context, caller Caller, id spiffeid.ID) error {
	return f.state.Load().authorize(caller.Node, id)
}

func (st *fileState) authorize(node string, id spiffeid.ID) error {
	if !st.nodes[node] {
		return fmt.Errorf("node %s is not in the config file (removed?), so it may have no identity", node)
	}
	where := st.byID[id]
	if names, ok := where[node]; ok && len(names) > 0 {
		return nil
	}
	if len(where) == 0 {
		return fmt.Errorf("node %s may not have %s: no mesh workload in the config file has that identity", node, id)
	}
	on := slices.Sorted(maps.Keys(where))
	return fmt.Errorf("node %s may not have %s: its workloads run on node(s) %s, not on %s", node, id, strings.Join(on, ", "), node)
}
