// Package registry is the proxy's model of the mesh: workloads, services
// and authorization policies, held as an immutable Snapshot that is swapped
// atomically on every change. Readers on the packet path load the current
// snapshot without locks and look up addresses without allocating; a
// reload never stalls traffic.
//
// Everything a connection needs is precomputed when a snapshot is built:
// workloads and services by address, each service's endpoints per address
// family (with their running weights when capacities differ), and for each
// workload the authorization policies that apply to it. A lookup is one
// map access; authorizing a connection is one map access and the
// evaluation of the workload's own policies; picking an endpoint is one
// random number, plus a pass over the service's endpoints when its
// routing preferences rank them by locality (lb.go).
package registry

import (
	"fmt"
	"net/netip"
	"slices"
	"sync/atomic"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/identity/workloadid"
	"github.com/meshtun/meshtun/mesh/policy"
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

// Health is whether a workload may be picked as a service endpoint.
type Health uint8

const (
	// Healthy workloads receive new connections through services.
	Healthy Health = iota
	// Unhealthy workloads are left out of service load balancing; direct
	// connections to their addresses still work.
	Unhealthy
)

func (h Health) String() string {
	if h == Unhealthy {
		return "UNHEALTHY"
	}
	return "HEALTHY"
}

// Workload is a pod (or any addressable endpoint) the mesh knows.
type Workload struct {
	Name      string
	Namespace string
	// ServiceAccount is "default" (as in Kubernetes) when empty.
	ServiceAccount string
	// Node is the name of the node the workload runs on.
	Node string
	// Addresses are the workload's IPv4 and IPv6 addresses.
	Addresses []netip.Addr
	Labels    map[string]string
	// InMesh: the workload's traffic is captured by a meshtun (or
	// ztunnel) node proxy and reachable over HBONE. A workload outside the
	// mesh is known (for services and policy) but reached in plaintext.
	InMesh bool
	// NativeTunnel: the workload terminates HBONE itself (an Istio
	// waypoint). It is in the mesh for its clients, who reach it over
	// HBONE, but no node proxy captures it (CapturedBy).
	NativeTunnel bool
	PeerAuth     PeerAuth
	// PortPeerAuth overrides PeerAuth on some of the workload's ports
	// (port-level peer authentication).
	PortPeerAuth map[uint16]PeerAuth
	// Health decides whether services pick the workload as an endpoint.
	Health Health
	// Locality and Cluster (below) are what a service's routing
	// preferences compare with the client's.
	Locality Locality
	// Capacity is the workload's relative share of its services'
	// connections (among endpoints of equal rank); 0 means 1.
	Capacity uint32
	// Hostname, for a workload without addresses, is the DNS name it is
	// reached by (an Istio ServiceEntry with resolution DNS). The proxy
	// resolves it when a service connection is given such an endpoint
	// (Endpoint.Unresolved), and refuses the connection if it cannot.
	Hostname string
	// Refused, when not empty, says why the node proxy refuses this
	// workload (a category: "waypoint", "network", …): the control plane
	// put it in the mesh with a feature meshtun does not implement. A
	// refused workload of the node is still captured (so that it is not
	// left reachable in plaintext), but every connection to it and from it
	// is denied; it has no certificate.
	Refused string
	// Waypoint, if set, is the waypoint (L7 proxy) that connections
	// addressed to the workload's own addresses must cross: clients send
	// them over HBONE to the waypoint, with the workload's address and
	// port as the CONNECT target (ztunnel's workload waypoint).
	Waypoint *Waypoint
	// ProbePorts are the ports the workload serves health probes on: the
	// node itself reaches them directly (not proxied, not authorized),
	// even under STRICT. From anywhere else they are ordinary ports.
	ProbePorts []uint16
	// CaptureLinks are the node-side links (veth peers) the workload's
	// packets arrive on, when its source knows them (the config file's
	// captureLink): the node captures them with the workload's addresses
	// as their allowed sources. Without them, and unless the snapshot's
	// LinksKnown says there are none, the node finds the workload's link
	// from its route.
	CaptureLinks []string
	// Identity is spiffe://<trust domain>/ns/<Namespace>/sa/<ServiceAccount>;
	// filled in by NewSnapshot.
	Identity spiffeid.ID

	// What istiod's model says about the workload (empty from sources
	// that do not know it): its unique id, the name and kind of the
	// object that owns it (a Deployment "web" for pod "web-5d4f-x2x"),
	// its canonical service and revision (Istio's service.istio.io/
	// canonical-name and -revision, defaulted from the app and version
	// labels), and its cluster. Telemetry and /config_dump report them.
	UID, WorkloadName, WorkloadType           string
	CanonicalName, CanonicalRevision, Cluster string
	authz                                     policy.Set // the policies that apply to the workload; set by Build
}

// String returns namespace/name.
func (w *Workload) String() string { return w.Namespace + "/" + w.Name }

// CapturedBy reports whether the node proxy of node captures w: a mesh
// workload of that node that does not terminate HBONE itself. Such a
// workload's traffic goes through that node's proxy both ways, and the
// proxy holds its certificate.
func (w *Workload) CapturedBy(node string) bool {
	return w != nil && w.InMesh && !w.NativeTunnel && w.Node != "" && w.Node == node
}

// Workload returns the name Istio's telemetry reports for the workload:
// the owning object's (WorkloadName) when known, else the workload's own.
func (w *Workload) Workload() string {
	if w.WorkloadName != "" {
		return w.WorkloadName
	}
	return w.Name
}

// Canonical returns the workload's canonical service and revision as
// Istio derives them: istiod's values when the source gave them, else
// from the labels service.istio.io/canonical-name, app.kubernetes.io/name
// or app (falling back to the workload's name), and
// service.istio.io/canonical-revision, app.kubernetes.io/version or
// version (falling back to "latest").
func (w *Workload) Canonical() (service, revision string) {
	service, revision = w.CanonicalName, w.CanonicalRevision
	if service == "" {
		service = firstLabel(w.Labels, "service.istio.io/canonical-name", "app.kubernetes.io/name", "app")
		if service == "" {
			service = w.Workload()
		}
	}
	if revision == "" {
		revision = firstLabel(w.Labels, "service.istio.io/canonical-revision", "app.kubernetes.io/version", "version")
		if revision == "" {
			revision = "latest"
		}
	}
	return service, revision
}

func firstLabel(labels map[string]string, keys ...string) string {
	for _, k := range keys {
		if v := labels[k]; v != "" {
			return v
		}
	}
	return ""
}

// Addr returns the workload's first address of the family of like (IPv4
// or IPv6), or false if it has none.
func (w *Workload) Addr(like netip.Addr) (netip.Addr, bool) {
	v4 := like.Unmap().Is4()
	for _, a := range w.Addresses {
		if a = a.Unmap(); a.Is4() == v4 {
			return a, true
		}
	}
	return netip.Addr{}, false
}

// ProbePort reports whether port is one of the workload's ProbePorts.
func (w *Workload) ProbePort(port uint16) bool {
	for _, p := range w.ProbePorts {
		if p == port {
			return true
		}
	}
	return false
}

// Policies returns the authorization policies that apply to the workload
// (DENY ones, then ALLOW ones) and whether it requires a verified peer
// identity. Only workloads of a Snapshot have them.
func (w *Workload) Policies() (deny, allow []*policy.Policy, strict bool) {
	d, a := w.authz.Policies()
	return d, a, w.authz.Strict()
}

// Protected reports whether plaintext to the workload's port must be
// intercepted: the port requires STRICT peer authentication, or an
// authorization policy (ALLOW, DENY or AUDIT) applies to the workload.
func (w *Workload) Protected(port uint16) bool {
	d, a := w.authz.Policies()
	return w.authz.StrictOn(port) || len(d) > 0 || len(a) > 0 || len(w.authz.Audits()) > 0
}

// ServicePort is one port of a service.
type ServicePort struct {
	// Name is optional ("http", "grpc", …).
	Name string
	// Port is the port clients connect to on the service VIPs.
	Port uint16
	// TargetPort is the port of the endpoints; 0 means Port.
	TargetPort uint16
}

// Target returns the endpoint port for p.
func (p *ServicePort) Target() uint16 {
	if p.TargetPort == 0 {
		return p.Port
	}
	return p.TargetPort
}

// WorkloadRef names a workload.
type WorkloadRef struct {
	Namespace, Name string
}

// String returns namespace/name.
func (r WorkloadRef) String() string { return r.Namespace + "/" + r.Name }

// Endpoint is a service endpoint: a workload and its address of the
// family of the VIP it was picked for.
type Endpoint struct {
	Workload *Workload
	Addr     netip.Addr
}

// Service is a set of workloads reachable through virtual IPs.
type Service struct {
	Name      string
	Namespace string
	// Hostname is the service's FQDN, sent as the HBONE forwarded host;
	// Build fills in <name>.<namespace>.svc.<domain suffix> when empty.
	Hostname string
	// VIPs are the service's virtual addresses, IPv4 and IPv6.
	VIPs []netip.Addr
	// CIDRs are virtual address ranges of the service (an Istio
	// ServiceEntry address with a prefix): a connection to an address in
	// one that is no workload's and no VIP's is the service's (ServiceFor).
	CIDRs []netip.Prefix
	Ports []ServicePort
	// Selector selects the endpoints among the workloads of the service's
	// namespace by label. When it is empty, Workloads lists them.
	Selector  map[string]string
	Workloads []WorkloadRef
	// PreferSameNode: Pick chooses among the endpoints on the caller's
	// node when there are any (Kubernetes' trafficDistribution:
	// PreferSameNode). It is LB FAILOVER on NODE, and Build makes it so
	// when LB is not set.
	PreferSameNode bool
	// LB is how endpoints are chosen by locality (Istio's load_balancing
	// routing preferences and mode).
	LB LoadBalancing
	// AllowUnhealthy: unhealthy workloads are endpoints too (Istio's
	// health policy ALLOW_ALL, e.g. publishNotReadyAddresses).
	AllowUnhealthy bool
	// Canonical: among the services sharing a VIP, this one is chosen for
	// clients of a namespace none of them is in (Istio's canonical).
	Canonical bool
	// Passthrough: no endpoint is chosen; a connection to the service
	// goes to its original destination (Istio's load-balancing mode
	// PASSTHROUGH, e.g. a ServiceEntry with resolution NONE).
	Passthrough bool
	// Waypoint, if set, is the waypoint that connections to the
	// service's VIPs must cross: clients send them over HBONE to the
	// waypoint, with the VIP and port as the CONNECT target, instead of
	// picking an endpoint. WeightedWaypoints, when some have a weight,
	// take its place: one of them is chosen per connection in
	// proportion to its weight (PickWaypoint).
	Waypoint          *Waypoint
	WeightedWaypoints []WeightedWaypoint

	eps [2]endpointSet // by family: [0] IPv4, [1] IPv6
}

type endpointSet struct {
	all []Endpoint
	// cum is the running sum of the endpoints' weights, when they are
	// not all 1 (nil: uniform).
	cum []uint64
}

func family(a netip.Addr) int {
	if a.Unmap().Is4() {
		return 0
	}
	return 1
}

// String returns namespace/name.
func (s *Service) String() string { return s.Namespace + "/" + s.Name }

// Endpoints returns the endpoints of the family of vip: the healthy
// workloads (all, with AllowUnhealthy) with an address of that family,
// and the unresolved ones (Endpoint.Unresolved). Do not modify the
// result.
func (s *Service) Endpoints(vip netip.Addr) []Endpoint { return s.eps[family(vip)].all }

// Pick chooses an endpoint for a connection to vip from the workload
// from (nil if the client is no workload): among the endpoints of vip's
// family, those that share the most of the service's routing preferences
// (LB) with from — only those sharing all of them under LBStrict — and
// among these at random in proportion to their Capacity. It reports false
// when there is no endpoint. The endpoint may be Unresolved. Pick is safe
// for concurrent use and does not allocate.
func (s *Service) Pick(vip netip.Addr, from *Workload) (Endpoint, bool) {
	return s.pickFrom(&s.eps[family(vip)], from, randN)
}

func (s *Service) pick(vip netip.Addr, from *Workload, rnd func(uint64) uint64) (Endpoint, bool) {
	return s.pickFrom(&s.eps[family(vip)], from, rnd)
}

// Snapshot is one immutable version of the mesh model. Never modify a
// Snapshot or anything it points to after it is built.
type Snapshot struct {
	TrustDomain spiffeid.TrustDomain
	// RootNamespace is where policies without a selector apply mesh-wide.
	RootNamespace string
	// Workloads, Services and Policies are the snapshot's own copies of
	// the model's, in the model's order.
	Workloads []*Workload
	Services  []*Service
	Policies  []*policy.Policy
	// LinksKnown: the source knows every mesh workload's capture links
	// (Workload.CaptureLinks, possibly none); no link is looked for by
	// route. See Model.LinksKnown.
	LinksKnown bool

	byAddr    *addrTable[*Workload] // port 0
	byName    map[WorkloadRef]*Workload
	svcByDest *addrTable[svcPort]  // VIP and service port
	svcByVIP  *addrTable[*Service] // port 0
	svcByName map[WorkloadRef]*Service
	svcByHost map[string]*Service
	// shared lists, in model order, the services of each VIP that
	// several services (of different namespaces) have; svcByVIP and
	// svcByDest hold the one for clients of none of their namespaces.
	shared map[netip.Addr][]*Service
	// cidrs are the services' VIP ranges, longest prefix first.
	cidrs []cidrService
}

type cidrService struct {
	p   netip.Prefix
	svc *Service
}

type svcPort struct {
	svc  *Service
	port *ServicePort
}

// Defaults for Model fields left empty.
const (
	DefaultRootNamespace = "istio-system"
	DefaultDomainSuffix  = "cluster.local"
)

// Model is what a Snapshot is built from.
type Model struct {
	TrustDomain spiffeid.TrustDomain
	// RootNamespace is the namespace of mesh-wide policies;
	// DefaultRootNamespace if empty.
	RootNamespace string
	// DomainSuffix completes service hostnames; DefaultDomainSuffix if
	// empty.
	DomainSuffix string
	Workloads    []*Workload
	Services     []*Service
	// Policies must have been built by policy.New.
	Policies []*policy.Policy
	// LinksKnown: the workloads' CaptureLinks are all there is (the
	// config file names them); false: a node finds the links its
	// workloads lack from their routes (Kubernetes, istiod).
	LinksKnown bool
	// Reuse, if set, is a previous snapshot whose workloads may be in
	// Workloads again, unchanged (a source that keeps them rather than
	// its own copies): such a workload is shared by the new snapshot
	// instead of copied when what Build derives for it (its identity and
	// policies) is the same, so that a source's model and its snapshots
	// hold one copy of each workload, and a rebuild copies only what
	// changed.
	Reuse *Snapshot
}

// NewSnapshot builds a snapshot of workloads alone, without services or
// policies. See Build.
func NewSnapshot(td spiffeid.TrustDomain, workloads []*Workload) (*Snapshot, error) {
	return Build(Model{TrustDomain: td, Workloads: workloads})
}

// Build indexes the model into a snapshot. The snapshot holds copies of the
// model's workloads and services (with Identity and Hostname filled in) and
// shares their slices and maps, which must not change afterwards. Two
// workloads may not share an address or a name, two services not a
// name, and a VIP:port belongs to one service; a VIP is not a workload
// address.
func Build(m Model) (*Snapshot, error) {
	if m.TrustDomain.IsZero() {
		return nil, fmt.Errorf("registry: no trust domain")
	}
	if m.RootNamespace == "" {
		m.RootNamespace = DefaultRootNamespace
	}
	if m.DomainSuffix == "" {
		m.DomainSuffix = DefaultDomainSuffix
	}
	nAddrs, nVIPs, nDests := 0, 0, 0
	for _, w := range m.Workloads {
		nAddrs += len(w.Addresses)
	}
	for _, svc := range m.Services {
		nVIPs += len(svc.VIPs)
		nDests += len(svc.VIPs) * len(svc.Ports)
	}
	s := &Snapshot{
		TrustDomain:   m.TrustDomain,
		RootNamespace: m.RootNamespace,
		Policies:      m.Policies,
		LinksKnown:    m.LinksKnown,
		Workloads:     make([]*Workload, 0, len(m.Workloads)),
		Services:      make([]*Service, 0, len(m.Services)),
		byAddr:        newAddrTable[*Workload](nAddrs),
		byName:        make(map[WorkloadRef]*Workload, len(m.Workloads)),
		svcByDest:     newAddrTable[svcPort](nDests),
		svcByVIP:      newAddrTable[*Service](nVIPs),
		svcByName:     make(map[WorkloadRef]*Service, len(m.Services)),
	}
	idx, err := newPolicyIndex(m.RootNamespace, m.Policies)
	if err != nil {
		return nil, err
	}
	byNS := make(map[string][]*Workload)
	// One identity per namespace and account: thousands of workloads
	// share a few, and each would otherwise hold its own copy.
	ids := make(map[WorkloadRef]spiffeid.ID)
	for _, in := range m.Workloads {
		if in.Name == "" || in.Namespace == "" {
			return nil, fmt.Errorf("registry: workload %q: name and namespace are required", in.String())
		}
		ref := WorkloadRef{in.Namespace, in.Name}
		if _, dup := s.byName[ref]; dup {
			return nil, fmt.Errorf("registry: two workloads named %s", ref)
		}
		sa := in.ServiceAccount
		if sa == "" {
			sa = "default" // as Kubernetes does
		}
		idKey := WorkloadRef{Namespace: in.Namespace, Name: sa}
		id, ok := ids[idKey]
		if !ok {
			id, err = workloadid.New(m.TrustDomain, in.Namespace, sa)
			if err != nil {
				return nil, fmt.Errorf("registry: workload %s: identity: %w", in, err)
			}
			ids[idKey] = id
		}
		if err := in.Waypoint.check(); err != nil {
			return nil, fmt.Errorf("registry: workload %s: %w", in, err)
		}
		var authz policy.Set
		if in.Refused != "" {
			// Nothing reaches it: one policy that denies everything
			// (which also makes every port of it intercepted).
			authz, err = policy.NewSet([]*policy.Policy{refusedPolicy}, true)
		} else {
			authz, err = policy.NewSet(idx.forWorkload(in.Namespace, in.Labels), in.PeerAuth == Strict)
		}
		if err != nil {
			return nil, fmt.Errorf("registry: workload %s: %w", in, err)
		}
		if len(in.PortPeerAuth) > 0 && in.Refused == "" {
			ports := make(map[uint16]bool, len(in.PortPeerAuth))
			for p, m := range in.PortPeerAuth {
				ports[p] = m == Strict
			}
			authz = authz.WithPorts(ports)
		}
		var wp *Workload
		if m.Reuse != nil && m.Reuse.byName[ref] == in && in.Identity == id && in.authz.Same(&authz) {
			// A workload of m.Reuse given again, and built the same:
			// shared, not copied.
			wp = in
		} else {
			w := *in
			w.ServiceAccount, w.Identity, w.authz = sa, id, authz
			wp = &w
		}
		for _, a := range wp.Addresses {
			a = a.Unmap()
			if !a.IsValid() {
				return nil, fmt.Errorf("registry: workload %s has an invalid address", wp)
			}
			if other, dup := s.byAddr.get(a, 0); dup {
				return nil, fmt.Errorf("registry: address %s belongs to both %s and %s", a, other, wp)
			}
			s.byAddr.put(a, 0, wp)
		}
		s.byName[ref] = wp
		s.Workloads = append(s.Workloads, wp)
		byNS[wp.Namespace] = append(byNS[wp.Namespace], wp)
	}
	vips := make(map[netip.Addr][]*Service, nVIPs)
	var order []netip.Addr
	for _, in := range m.Services {
		svc := *in
		if err := s.addService(&svc, m.DomainSuffix, byNS, vips, &order); err != nil {
			return nil, fmt.Errorf("registry: service %s: %w", &svc, err)
		}
	}
	slices.SortStableFunc(s.cidrs, func(a, b cidrService) int { return b.p.Bits() - a.p.Bits() })
	for _, vip := range order {
		list := vips[vip]
		def := list[0]
		for _, svc := range list {
			if svc.Canonical {
				def = svc
				break
			}
		}
		s.svcByVIP.put(vip, 0, def)
		for i := range def.Ports {
			s.svcByDest.put(vip, def.Ports[i].Port, svcPort{def, &def.Ports[i]})
		}
		if len(list) > 1 {
			if s.shared == nil {
				s.shared = make(map[netip.Addr][]*Service)
			}
			s.shared[vip] = list
		}
	}
	return s, nil
}

// sameNode is the routing preference of PreferSameNode.
var sameNode = []Scope{ScopeNode}

func (s *Snapshot) addService(svc *Service, suffix string, byNS map[string][]*Workload, vips map[netip.Addr][]*Service, order *[]netip.Addr) error {
	if svc.Name == "" || svc.Namespace == "" {
		return fmt.Errorf("name and namespace are required")
	}
	ref := WorkloadRef{svc.Namespace, svc.Name}
	if _, dup := s.svcByName[ref]; dup {
		return fmt.Errorf("two services with this name")
	}
	if svc.Hostname == "" {
		svc.Hostname = svc.Name + "." + svc.Namespace + ".svc." + suffix
	}
	if err := svc.Waypoint.check(); err != nil {
		return err
	}
	for i := range svc.WeightedWaypoints {
		if err := (&svc.WeightedWaypoints[i].Waypoint).check(); err != nil {
			return fmt.Errorf("weighted waypoint %d: %w", i, err)
		}
	}
	if s.svcByHost == nil {
		s.svcByHost = make(map[string]*Service)
	}
	if _, dup := s.svcByHost[svc.Hostname]; !dup {
		s.svcByHost[svc.Hostname] = svc
	}
	for i := range svc.Ports {
		if svc.Ports[i].Port == 0 {
			return fmt.Errorf("port 0")
		}
		for j := range i {
			if svc.Ports[j].Port == svc.Ports[i].Port {
				return fmt.Errorf("port %d listed twice", svc.Ports[i].Port)
			}
		}
	}
	for _, vip := range svc.VIPs {
		vip = vip.Unmap()
		if !vip.IsValid() {
			return fmt.Errorf("invalid VIP")
		}
		if w, ok := s.byAddr.get(vip, 0); ok {
			return fmt.Errorf("VIP %s is the address of workload %s", vip, w)
		}
		for _, other := range vips[vip] {
			if other.Namespace == svc.Namespace {
				return fmt.Errorf("VIP %s is also a VIP of service %s of the same namespace", vip, other)
			}
		}
		if len(vips[vip]) == 0 {
			*order = append(*order, vip)
		}
		vips[vip] = append(vips[vip], svc)
	}
	for _, p := range svc.CIDRs {
		if !p.IsValid() || p != p.Masked() || p.Addr().Is4In6() {
			return fmt.Errorf("invalid VIP range %s", p)
		}
		s.cidrs = append(s.cidrs, cidrService{p, svc})
	}
	if svc.PreferSameNode && svc.LB.Mode == LBAny {
		svc.LB = LoadBalancing{Mode: LBFailover, Scopes: sameNode}
	}
	var members []*Workload
	if len(svc.Selector) > 0 {
		for _, w := range byNS[svc.Namespace] {
			if policy.SelectorMatches(svc.Selector, w.Labels) {
				members = append(members, w)
			}
		}
	} else {
		for _, r := range svc.Workloads {
			w := s.byName[r]
			if w == nil {
				return fmt.Errorf("endpoint %s is not a known workload", r)
			}
			members = append(members, w)
		}
	}
	svc.eps = [2]endpointSet{}
	for _, w := range members {
		if w.Health != Healthy && !svc.AllowUnhealthy {
			continue
		}
		for f, like := range [2]netip.Addr{netip.IPv4Unspecified(), netip.IPv6Unspecified()} {
			a, ok := w.Addr(like)
			if !ok && (len(w.Addresses) > 0 || w.Hostname == "") {
				continue
			}
			// An endpoint without addresses but with a hostname is one
			// of either family, unresolved (a zero Addr).
			set := &svc.eps[f]
			set.all = append(set.all, Endpoint{Workload: w, Addr: a})
		}
	}
	for f := range svc.eps {
		set := &svc.eps[f]
		uniform := true
		for _, e := range set.all {
			uniform = uniform && e.Workload.weight() == 1
		}
		if uniform {
			continue
		}
		set.cum = make([]uint64, len(set.all))
		var sum uint64
		for i, e := range set.all {
			sum += e.Workload.weight()
			set.cum[i] = sum
		}
	}
	s.svcByName[ref] = svc
	s.Services = append(s.Services, svc)
	return nil
}

// Workload returns the workload with address a, or nil.
func (s *Snapshot) Workload(a netip.Addr) *Workload {
	if !a.IsValid() {
		return nil
	}
	w, _ := s.byAddr.get(a, 0)
	return w
}

// WorkloadByName returns the workload namespace/name, or nil.
func (s *Snapshot) WorkloadByName(namespace, name string) *Workload {
	return s.byName[WorkloadRef{namespace, name}]
}

// Service returns the service with VIP dst.Addr() and the port of it that
// is dst.Port(), or nil, nil. A VIP on a port the service does not have is
// not found here; ServiceByVIP finds it.
func (s *Snapshot) Service(dst netip.AddrPort) (*Service, *ServicePort) {
	if !dst.Addr().IsValid() {
		return nil, nil
	}
	sp, _ := s.svcByDest.get(dst.Addr(), dst.Port())
	return sp.svc, sp.port
}

// ServiceFor is Service for a client of namespace ns: where several
// services (of different namespaces, e.g. ServiceEntries) share the VIP,
// the one of ns if there is one (as ztunnel chooses), else the canonical
// one, else the first in model order. An address that is no VIP and no
// workload's may be in a service's VIP range (Service.CIDRs). As with
// Service, a service without dst's port is nil, nil. It does not
// allocate.
func (s *Snapshot) ServiceFor(dst netip.AddrPort, ns string) (*Service, *ServicePort) {
	if s.shared != nil {
		if list, ok := s.shared[dst.Addr().Unmap()]; ok {
			for _, svc := range list {
				if svc.Namespace == ns {
					return svc.withPort(dst.Port())
				}
			}
		}
	}
	if len(s.cidrs) > 0 && dst.Addr().IsValid() {
		if _, vip := s.svcByVIP.get(dst.Addr(), 0); !vip && s.Workload(dst.Addr()) == nil {
			return s.serviceByCIDR(dst, ns)
		}
	}
	return s.Service(dst)
}

// serviceByCIDR finds the service of a VIP range that holds dst's
// address, as ztunnel ranks them: one of namespace ns first, then the
// longest prefix, then a canonical one, then model order.
func (s *Snapshot) serviceByCIDR(dst netip.AddrPort, ns string) (*Service, *ServicePort) {
	a := dst.Addr().Unmap()
	var best *Service
	var bestNS, bestCanon bool
	bestBits := -1
	for _, c := range s.cidrs {
		if !c.p.Contains(a) {
			continue
		}
		inNS := c.svc.Namespace == ns
		switch {
		case best == nil,
			inNS && !bestNS,
			inNS == bestNS && c.p.Bits() > bestBits,
			inNS == bestNS && c.p.Bits() == bestBits && c.svc.Canonical && !bestCanon:
			best, bestNS, bestBits, bestCanon = c.svc, inNS, c.p.Bits(), c.svc.Canonical
		}
	}
	if best == nil {
		return nil, nil
	}
	return best.withPort(dst.Port())
}

// withPort returns s and its port p, or nil, nil if s has no port p.
func (s *Service) withPort(p uint16) (*Service, *ServicePort) {
	for i := range s.Ports {
		if s.Ports[i].Port == p {
			return s, &s.Ports[i]
		}
	}
	return nil, nil
}

// ServicesByVIP returns the services with virtual address a: one, or
// several of different namespaces, in model order. Do not modify the
// result.
func (s *Snapshot) ServicesByVIP(a netip.Addr) []*Service {
	if list, ok := s.shared[a.Unmap()]; ok {
		return list
	}
	if svc := s.ServiceByVIP(a); svc != nil {
		return []*Service{svc}
	}
	return nil
}

// ServiceByVIP returns the service with virtual address a, or nil; where
// several share it, the one ServiceFor gives a client of none of their
// namespaces.
func (s *Snapshot) ServiceByVIP(a netip.Addr) *Service {
	if !a.IsValid() {
		return nil
	}
	svc, _ := s.svcByVIP.get(a, 0)
	return svc
}

// ServiceByHostname returns the service whose Hostname is host, or nil.
func (s *Snapshot) ServiceByHostname(host string) *Service {
	return s.svcByHost[host]
}

// ServiceByName returns the service namespace/name, or nil.
func (s *Snapshot) ServiceByName(namespace, name string) *Service {
	return s.svcByName[WorkloadRef{namespace, name}]
}

// Authorize decides whether r may reach the workload at r.Dest's address,
// by the policies that apply to that workload and its peer-authentication
// mode (see package policy). A destination that is no known workload is
// denied. Authorize does not allocate.
func (s *Snapshot) Authorize(r *policy.Request) policy.Decision {
	w := s.Workload(r.Dest.Addr())
	if w == nil {
		return policy.Decision{Reason: policy.UnknownDestination}
	}
	return w.authz.Evaluate(r)
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
