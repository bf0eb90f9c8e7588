package xds

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"unique"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/protobuf/reflect/protoreflect"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// policyLabelPrefix prefixes the label that ties a workload to an
// authorization policy of workload-selector scope: istiod lists, on each
// workload, the keys of the selector policies that select it (the WDS
// workload carries no labels), and the policy selects that label.
const policyLabelPrefix = "xds.meshtun.io/authz:"

// policyLabel is the label a workload carries when the workload-selector
// policy key ("namespace/name") applies to it.
func policyLabel(key string) string { return policyLabelPrefix + key }

// workload is one converted istio.workload.Workload: the registry's
// workload and the services (keyed "namespace/hostname") it is an
// endpoint of, with their ports.
type workload struct {
	w        *registry.Workload
	services []membership
	pod      bool // a Kubernetes pod (istiod's uid <cluster>//Pod/…)
}

// membership is a service a workload is an endpoint of: its key
// ("namespace/hostname", interned) and the target port of each of its
// ports the workload lists. It is what is kept of the decoded resource's
// services map (a map of protobuf messages, ~500 bytes a workload).
type membership struct {
	key   string
	ports []portPair
}

// portPair is a service port and the workload's target port for it.
type portPair struct{ service, target uint32 }

// service is one converted istio.workload.Service.
type service struct {
	s   *registry.Service
	key string // namespace/hostname
	// ports with an unknown target port (0): the endpoints' port lists
	// say.
	unknownTarget map[uint16]bool
}

// converter turns WDS resources into registry objects, checking what
// meshtun can honour. Each method converts one resource, so that a
// resource meshtun cannot apply is rejected on its own.
type converter struct {
	td      spiffeid.TrustDomain
	network string
	root    string
	peer    registry.PeerAuth
}

// refusal is why meshtun refuses a resource it understands: a feature it
// does not implement. reason is a short category for metrics.
type refusal struct {
	reason string
	msg    string
}

func (r *refusal) Error() string { return r.msg }

// Reasons of refusals (registry.Workload.Refused).
const (
	RefusedWaypoint       = "waypoint"
	RefusedNetwork        = "network"
	RefusedTrustDomain    = "trust_domain"
	RefusedExtensions     = "extensions"
	RefusedTunnelProtocol = "tunnel_protocol"
)

func refuse(reason, format string, args ...any) error {
	return &refusal{reason: reason, msg: fmt.Sprintf(format, args...)}
}

// workload converts a WDS workload. A nil result with a nil error is a
// workload meshtun does not model (host-network pods: their addresses are
// their node's). A workload meshtun understands but refuses (a waypoint on
// another network, …) is returned with a *refusal error: what is known of
// it (name, node, addresses) lets the node capture it and deny it rather
// than leave it open.
func (c *converter) workload(in *workloadapi.Workload) (*workload, error) {
	if in.Name == "" || in.Namespace == "" {
		return nil, errors.New("workload without name or namespace")
	}
	if in.NetworkMode == workloadapi.NetworkMode_HOST_NETWORK {
		return nil, nil
	}
	// The strings many workloads share (namespace, account, node,
	// owner…) are interned: istiod repeats them in every resource.
	w := &registry.Workload{
		Name: in.Name, Namespace: intern(in.Namespace), ServiceAccount: intern(in.ServiceAccount), Node: intern(in.Node),
		InMesh: in.TunnelProtocol == workloadapi.TunnelProtocol_HBONE,
		// A workload with a native tunnel (a waypoint) terminates HBONE
		// itself: its clients reach it over HBONE, and no node proxy
		// captures it or holds its certificate (istio-cni leaves it
		// alone: istio.io/dataplane-mode=none).
		NativeTunnel: in.NativeTunnel,
		PeerAuth:     c.peer,
		UID:          in.Uid, WorkloadName: intern(in.WorkloadName), WorkloadType: workloadType(in.WorkloadType),
		CanonicalName: intern(in.CanonicalName), CanonicalRevision: intern(in.CanonicalRevision), Cluster: intern(in.ClusterId),
	}
	if len(in.Addresses) > 0 {
		w.Addresses = make([]netip.Addr, 0, len(in.Addresses))
	}
	for i, b := range in.Addresses {
		a, ok := netip.AddrFromSlice(b)
		if !ok {
			return nil, fmt.Errorf("workload %s/%s: addresses[%d] is %d bytes, not an IPv4 or IPv6 address", in.Namespace, in.Name, i, len(b))
		}
		w.Addresses = append(w.Addresses, a.Unmap())
	}
	// A pod's address is the cluster network's, routed to it; anything
	// else (a WorkloadEntry, a ServiceEntry's endpoint) is declared, and
	// loses an address conflict against a pod.
	out := &workload{w: w, pod: strings.Contains(in.Uid, "//Pod/")}
	refused := func(reason, format string, args ...any) (*workload, error) {
		// Known only to be captured and denied: no labels, no services.
		w.InMesh = in.TunnelProtocol != workloadapi.TunnelProtocol_NONE
		w.Refused = reason
		return out, refuse(reason, format, args...)
	}
	if in.Waypoint != nil {
		wp, err := c.waypoint(in.Waypoint)
		if err != nil {
			// Reaching the workload directly would bypass its L7 policy.
			return refused(RefusedWaypoint, "workload %s/%s: %v", in.Namespace, in.Name, err)
		}
		w.Waypoint = wp
	}
	if in.NetworkGateway != nil {
		return refused(RefusedNetwork, "workload %s/%s is reached through network gateway %s: multi-network meshes are not supported", in.Namespace, in.Name, gatewayString(in.NetworkGateway))
	}
	if in.Network != c.network {
		return refused(RefusedNetwork, "workload %s/%s is on network %q, this node on %q: multi-network meshes are not supported", in.Namespace, in.Name, in.Network, c.network)
	}
	if in.TrustDomain != "" && in.TrustDomain != c.td.Name() {
		return refused(RefusedTrustDomain, "workload %s/%s has trust domain %q, the mesh %q: one trust domain is supported", in.Namespace, in.Name, in.TrustDomain, c.td.Name())
	}
	if len(in.Extensions) > 0 {
		return refused(RefusedExtensions, "workload %s/%s has extensions (%s), which meshtun does not understand", in.Namespace, in.Name, extNames(in.Extensions))
	}
	if in.TunnelProtocol == workloadapi.TunnelProtocol_LEGACY_ISTIO_MTLS {
		return refused(RefusedTunnelProtocol, "workload %s/%s uses tunnel protocol LEGACY_ISTIO_MTLS (a sidecar's mTLS), which meshtun does not speak", in.Namespace, in.Name)
	}
	if in.Status == workloadapi.WorkloadStatus_UNHEALTHY {
		w.Health = registry.Unhealthy
	}
	if l := in.Locality; l != nil {
		w.Locality = registry.Locality{Region: l.Region, Zone: l.Zone, Subzone: l.Subzone}
	}
	if len(w.Addresses) == 0 {
		// A ServiceEntry endpoint of resolution DNS: reached by name.
		// The proxy resolves it on demand, as ztunnel does.
		w.Hostname = in.Hostname
	}
	// Capacity 0: no share of its services' connections (ztunnel never
	// picks it), so it is no endpoint at all.
	endpoint := in.Capacity == nil || in.Capacity.Value > 0
	if endpoint && in.Capacity != nil {
		w.Capacity = in.Capacity.Value
	}
	if len(in.AuthorizationPolicies) > 0 {
		w.Labels = make(map[string]string, len(in.AuthorizationPolicies))
		for _, k := range in.AuthorizationPolicies {
			w.Labels[policyLabel(k)] = "true"
		}
	}
	if len(in.Services) > 0 && endpoint {
		out.services = make([]membership, 0, len(in.Services))
		for k, pl := range in.Services {
			m := membership{key: intern(k)}
			if ps := pl.GetPorts(); len(ps) > 0 {
				m.ports = make([]portPair, len(ps))
				for i, p := range ps {
					m.ports[i] = portPair{service: p.GetServicePort(), target: p.GetTargetPort()}
				}
			}
			out.services = append(out.services, m)
		}
	}
	return out, nil
}

// service converts a WDS service. A nil result with a nil error is a
// service meshtun does not model (no address on this network: headless
// services, hostname-only ServiceEntries).
func (c *converter) service(in *workloadapi.Service) (*service, error) {
	if in.Hostname == "" || in.Namespace == "" {
		return nil, errors.New("service without hostname or namespace")
	}
	key := in.Namespace + "/" + in.Hostname
	var wp *registry.Waypoint
	if in.Waypoint != nil {
		var err error
		if wp, err = c.waypoint(in.Waypoint); err != nil {
			return nil, fmt.Errorf("service %s: %w", key, err)
		}
	}
	var weighted []registry.WeightedWaypoint
	for i, ww := range in.WeightedWaypoints {
		if ww.GetDestination() == nil {
			return nil, fmt.Errorf("service %s: weighted_waypoints[%d] has no destination", key, i)
		}
		d, err := c.waypoint(ww.Destination)
		if err != nil {
			return nil, fmt.Errorf("service %s: weighted_waypoints[%d]: %w", key, i, err)
		}
		weighted = append(weighted, registry.WeightedWaypoint{Waypoint: *d, Weight: ww.Weight})
	}
	if len(in.Extensions) > 0 {
		return nil, fmt.Errorf("service %s has extensions (%s), which meshtun does not understand", key, extNames(in.Extensions))
	}
	s := &registry.Service{Name: in.Name, Namespace: in.Namespace, Hostname: in.Hostname, Waypoint: wp, WeightedWaypoints: weighted}
	if s.Name == "" {
		s.Name = in.Hostname
	}
	for i, na := range in.Addresses {
		if na.Network != c.network {
			continue
		}
		a, ok := netip.AddrFromSlice(na.Address)
		if !ok {
			return nil, fmt.Errorf("service %s: addresses[%d] is %d bytes, not an IPv4 or IPv6 address", key, i, len(na.Address))
		}
		a = a.Unmap()
		if na.Length != nil && int(*na.Length) != a.BitLen() {
			// A VIP range: connections to any of its addresses (that
			// is no workload's or VIP) are the service's.
			p, err := a.Prefix(int(*na.Length))
			if err != nil || int(*na.Length) > a.BitLen() {
				return nil, fmt.Errorf("service %s: addresses[%d] %s/%d is not a valid range", key, i, a, *na.Length)
			}
			s.CIDRs = append(s.CIDRs, p)
			continue
		}
		s.VIPs = append(s.VIPs, a)
	}
	if len(s.VIPs)+len(s.CIDRs) == 0 {
		return nil, nil
	}
	out := &service{s: s, key: key}
	for i, p := range in.Ports {
		if p.ServicePort == 0 || p.ServicePort > 65535 || p.TargetPort > 65535 {
			return nil, fmt.Errorf("service %s: ports[%d]: port %d → %d out of range", key, i, p.ServicePort, p.TargetPort)
		}
		sp := registry.ServicePort{Port: uint16(p.ServicePort), TargetPort: uint16(p.TargetPort)}
		if slices.ContainsFunc(s.Ports, func(q registry.ServicePort) bool { return q.Port == sp.Port }) {
			// WDS ports carry no protocol, and istiod lists a port once
			// per protocol (kube-dns: 53/UDP and 53/TCP). The first
			// listing is kept, as a service it is the same port; a
			// second target for it could only be another protocol's.
			continue
		}
		if p.TargetPort == 0 {
			if out.unknownTarget == nil {
				out.unknownTarget = map[uint16]bool{}
			}
			out.unknownTarget[sp.Port] = true
		}
		s.Ports = append(s.Ports, sp)
	}
	s.Canonical = in.Canonical
	if lb := in.LoadBalancing; lb != nil {
		if err := loadBalancing(s, lb); err != nil {
			return nil, fmt.Errorf("service %s: %w", key, err)
		}
	}
	return out, nil
}

// loadBalancing sets s's endpoint selection from istiod's: the mode
// (PASSTHROUGH: no endpoint selection, the original destination, as
// ztunnel does; STRICT and FAILOVER: ranked by the routing preferences),
// the scopes, and the health policy (ALLOW_ALL: unhealthy endpoints too).
// A value this meshtun does not know is refused rather than ignored: a
// STRICT preference ignored would send traffic where it must not go.
func loadBalancing(s *registry.Service, lb *workloadapi.LoadBalancing) error {
	switch lb.Mode {
	case workloadapi.LoadBalancing_UNSPECIFIED_MODE:
		s.LB.Mode = registry.LBAny
	case workloadapi.LoadBalancing_FAILOVER:
		s.LB.Mode = registry.LBFailover
	case workloadapi.LoadBalancing_STRICT:
		s.LB.Mode = registry.LBStrict
	case workloadapi.LoadBalancing_PASSTHROUGH:
		s.Passthrough = true
	default:
		return fmt.Errorf("load balancing mode %v is not known to this meshtun", lb.Mode)
	}
	for i, p := range lb.RoutingPreference {
		var sc registry.Scope
		switch p {
		case workloadapi.LoadBalancing_REGION:
			sc = registry.ScopeRegion
		case workloadapi.LoadBalancing_ZONE:
			sc = registry.ScopeZone
		case workloadapi.LoadBalancing_SUBZONE:
			sc = registry.ScopeSubzone
		case workloadapi.LoadBalancing_NODE:
			sc = registry.ScopeNode
		case workloadapi.LoadBalancing_CLUSTER:
			sc = registry.ScopeCluster
		case workloadapi.LoadBalancing_NETWORK:
			sc = registry.ScopeNetwork
		default:
			return fmt.Errorf("load balancing routing_preference[%d] %v is not known to this meshtun", i, p)
		}
		s.LB.Scopes = append(s.LB.Scopes, sc)
	}
	switch lb.HealthPolicy {
	case workloadapi.LoadBalancing_ONLY_HEALTHY:
	case workloadapi.LoadBalancing_ALLOW_ALL:
		s.AllowUnhealthy = true
	default:
		return fmt.Errorf("load balancing health policy %v is not known to this meshtun", lb.HealthPolicy)
	}
	return nil
}

// authorization converts an istio.security.Authorization. A dry-run
// policy is converted too, marked DryRun: it is evaluated and its matches
// logged, not enforced.
func (c *converter) authorization(in *security.Authorization) (*policy.Policy, error) {
	key := in.Namespace + "/" + in.Name
	if hasUnknownFields(in.ProtoReflect()) {
		// A newer istiod's field: it may restrict what the policy
		// matches, or whom it applies to; ignoring it could allow what
		// the policy denies.
		return nil, fmt.Errorf("authorization %s has fields this meshtun does not know (sent by a newer istiod?)", key)
	}
	if len(in.Extensions) > 0 {
		return nil, fmt.Errorf("authorization %s has extensions (%s), which meshtun does not understand", key, extNames(in.Extensions))
	}
	p := policy.Istio{Name: in.Name, Namespace: in.Namespace, DryRun: in.DryRun}
	switch in.Action {
	case security.Action_ALLOW, security.Action_DENY:
		p.Action = in.Action.String()
	default:
		return nil, fmt.Errorf("authorization %s: action %v is not supported", key, in.Action)
	}
	switch in.Scope {
	case security.Scope_GLOBAL:
		if in.Namespace != c.root {
			return nil, fmt.Errorf("authorization %s has global scope outside the root namespace %s", key, c.root)
		}
	case security.Scope_NAMESPACE:
		if in.Namespace == c.root {
			return nil, fmt.Errorf("authorization %s has namespace scope in the root namespace (meshtun would apply it mesh-wide)", key)
		}
	case security.Scope_WORKLOAD_SELECTOR:
		p.Selector = map[string]string{policyLabel(key): "true"}
	default:
		return nil, fmt.Errorf("authorization %s: scope %v is not supported", key, in.Scope)
	}
	for gi, g := range in.Groups {
		r, err := rule(g)
		if err != nil {
			return nil, fmt.Errorf("authorization %s: groups[%d]: %w", key, gi, err)
		}
		p.Rules = append(p.Rules, r)
	}
	built, probs := policy.FromIstio(p)
	if built == nil {
		var errs []error
		for _, pr := range probs {
			errs = append(errs, pr)
		}
		return nil, fmt.Errorf("authorization %s: %w", key, errors.Join(errs...))
	}
	return built, nil
}

// denyAll is what stands for an authorization meshtun cannot apply
// (policy.DenyAll): a DENY policy in the same scope whose one empty rule
// matches every request.
func (c *converter) denyAll(in *security.Authorization) *policy.Policy {
	var sel map[string]string
	if in.Scope == security.Scope_WORKLOAD_SELECTOR {
		sel = map[string]string{policyLabel(in.Namespace + "/" + in.Name): "true"}
	}
	name, ns := in.Name, in.Namespace
	if name == "" {
		name = "unnamed"
	}
	if ns == "" {
		ns = c.root // mesh-wide: nothing better is known
	}
	out := policy.DenyAll(name, ns, sel)
	if out == nil { // cannot happen: name and namespace are set
		panic("xds: no deny-all policy for " + ns + "/" + name)
	}
	return out
}

// rule converts a group (its rules AND-ed, the matches of each rule
// OR-ed) into a policy rule: a rule whose matches are all about the
// source becomes From, one whose matches are all about destination ports
// becomes To, and any other rule with a single match becomes When
// conditions (the form istiod gives `when`).
func rule(g *security.Group) (policy.Rule, error) {
	var r policy.Rule
	var haveFrom, haveTo bool
	for ri, rs := range g.Rules {
		if len(rs.Matches) == 0 {
			return r, fmt.Errorf("rules[%d] has no match (it would match nothing)", ri)
		}
		srcOnly, portOnly := true, true
		for _, m := range rs.Matches {
			if len(m.Extensions) > 0 {
				return r, fmt.Errorf("rules[%d] has match extensions (%s), which meshtun does not understand", ri, extNames(m.Extensions))
			}
			hasSrc := len(m.Namespaces)+len(m.NotNamespaces)+len(m.ServiceAccounts)+len(m.NotServiceAccounts)+
				len(m.Principals)+len(m.NotPrincipals)+len(m.SourceIps)+len(m.NotSourceIps) > 0
			hasPorts := len(m.DestinationPorts)+len(m.NotDestinationPorts) > 0
			hasDstIP := len(m.DestinationIps)+len(m.NotDestinationIps) > 0
			if hasPorts || hasDstIP {
				srcOnly = false
			}
			if hasSrc || hasDstIP {
				portOnly = false
			}
		}
		switch {
		case portOnly && !haveTo:
			haveTo = true
			for _, m := range rs.Matches {
				op := policy.Operation{}
				var err error
				if op.Ports, err = ports(m.DestinationPorts); err != nil {
					return r, fmt.Errorf("rules[%d]: %w", ri, err)
				}
				if op.NotPorts, err = ports(m.NotDestinationPorts); err != nil {
					return r, fmt.Errorf("rules[%d]: %w", ri, err)
				}
				r.To = append(r.To, op)
			}
		case srcOnly && !haveFrom:
			haveFrom = true
			for mi, m := range rs.Matches {
				src, err := source(m)
				if err != nil {
					return r, fmt.Errorf("rules[%d].matches[%d]: %w", ri, mi, err)
				}
				r.From = append(r.From, src)
			}
		case len(rs.Matches) == 1:
			cs, err := conditions(rs.Matches[0])
			if err != nil {
				return r, fmt.Errorf("rules[%d]: %w", ri, err)
			}
			r.When = append(r.When, cs...)
		default:
			return r, fmt.Errorf("rules[%d] mixes source and destination attributes across %d matches, which meshtun's rules cannot express", ri, len(rs.Matches))
		}
	}
	return r, nil
}

func source(m *security.Match) (policy.Source, error) {
	var s policy.Source
	var err error
	s.Principals = stringMatches(m.Principals)
	s.NotPrincipals = stringMatches(m.NotPrincipals)
	s.Namespaces = stringMatches(m.Namespaces)
	s.NotNamespaces = stringMatches(m.NotNamespaces)
	s.ServiceAccounts = serviceAccounts(m.ServiceAccounts)
	s.NotServiceAccounts = serviceAccounts(m.NotServiceAccounts)
	if s.IPBlocks, err = ipBlocks(m.SourceIps); err != nil {
		return s, err
	}
	if s.NotIPBlocks, err = ipBlocks(m.NotSourceIps); err != nil {
		return s, err
	}
	return s, nil
}

// conditions turns one match (its fields AND-ed) into when conditions.
func conditions(m *security.Match) ([]policy.Condition, error) {
	if len(m.ServiceAccounts)+len(m.NotServiceAccounts) > 0 {
		return nil, errors.New("service accounts in a when-style match are not supported")
	}
	var out []policy.Condition
	add := func(key string, vals, not []string) {
		if len(vals)+len(not) > 0 {
			out = append(out, policy.Condition{Key: key, Values: vals, NotValues: not})
		}
	}
	add("source.namespace", stringMatches(m.Namespaces), stringMatches(m.NotNamespaces))
	add("source.principal", stringMatches(m.Principals), stringMatches(m.NotPrincipals))
	for _, f := range []struct {
		key      string
		vals     []*security.Address
		not      []*security.Address
		portVals []uint32
		portNot  []uint32
	}{
		{key: "source.ip", vals: m.SourceIps, not: m.NotSourceIps},
		{key: "destination.ip", vals: m.DestinationIps, not: m.NotDestinationIps},
	} {
		vals, err := cidrStrings(f.vals)
		if err != nil {
			return nil, err
		}
		not, err := cidrStrings(f.not)
		if err != nil {
			return nil, err
		}
		add(f.key, vals, not)
	}
	add("destination.port", portStrings(m.DestinationPorts), portStrings(m.NotDestinationPorts))
	return out, nil
}

// stringMatches writes Istio's string matches in meshtun's (and Istio's
// YAML) wildcard form: exact, "prefix*", "*suffix", "*" for presence.
func stringMatches(ms []*security.StringMatch) []string {
	var out []string
	for _, m := range ms {
		switch t := m.MatchType.(type) {
		case *security.StringMatch_Exact:
			out = append(out, t.Exact)
		case *security.StringMatch_Prefix:
			out = append(out, t.Prefix+"*")
		case *security.StringMatch_Suffix:
			out = append(out, "*"+t.Suffix)
		case *security.StringMatch_Presence:
			out = append(out, "*")
		}
	}
	return out
}

func serviceAccounts(ms []*security.ServiceAccountMatch) []string {
	var out []string
	for _, m := range ms {
		out = append(out, m.Namespace+"/"+m.ServiceAccount)
	}
	return out
}

func ipBlocks(as []*security.Address) ([]policy.IPBlock, error) {
	var out []policy.IPBlock
	for _, a := range as {
		p, err := prefix(a)
		if err != nil {
			return nil, err
		}
		out = append(out, policy.IPBlock{CIDR: p})
	}
	return out, nil
}

func cidrStrings(as []*security.Address) ([]string, error) {
	var out []string
	for _, a := range as {
		p, err := prefix(a)
		if err != nil {
			return nil, err
		}
		out = append(out, p.String())
	}
	return out, nil
}

func prefix(a *security.Address) (netip.Prefix, error) {
	ip, ok := netip.AddrFromSlice(a.Address)
	if !ok {
		return netip.Prefix{}, fmt.Errorf("address of %d bytes is not an IPv4 or IPv6 address", len(a.Address))
	}
	p, err := ip.Prefix(int(a.Length))
	if err != nil || int(a.Length) > ip.BitLen() {
		return netip.Prefix{}, fmt.Errorf("%s/%d is not a valid CIDR", ip, a.Length)
	}
	if ip.Is4In6() && a.Length >= 96 {
		p = netip.PrefixFrom(ip.Unmap(), int(a.Length)-96)
	}
	return p.Masked(), nil
}

func ports(ps []uint32) ([]uint16, error) {
	var out []uint16
	for _, p := range ps {
		if p == 0 || p > 65535 {
			return nil, fmt.Errorf("port %d out of range", p)
		}
		out = append(out, uint16(p))
	}
	return out, nil
}

func portStrings(ps []uint32) []string {
	var out []string
	for _, p := range ps {
		out = append(out, strconv.FormatUint(uint64(p), 10))
	}
	return out
}

// waypoint converts a waypoint's GatewayAddress: an address on this
// node's network (a workload's or a service VIP), or a service's hostname
// and namespace, and the HBONE port (15008 when istiod leaves it 0). A
// waypoint meshtun cannot reach (on another network) or that names
// nothing is an error: what it guards must then not be reached at all.
func (c *converter) waypoint(g *workloadapi.GatewayAddress) (*registry.Waypoint, error) {
	if g.HboneMtlsPort > 65535 {
		return nil, fmt.Errorf("waypoint %s: HBONE port %d out of range", gatewayString(g), g.HboneMtlsPort)
	}
	wp := &registry.Waypoint{Port: uint16(g.HboneMtlsPort)}
	switch d := g.Destination.(type) {
	case *workloadapi.GatewayAddress_Address:
		na := d.Address
		a, ok := netip.AddrFromSlice(na.GetAddress())
		if !ok {
			return nil, fmt.Errorf("waypoint address of %d bytes is not an IPv4 or IPv6 address", len(na.GetAddress()))
		}
		if na.GetNetwork() != c.network {
			return nil, fmt.Errorf("waypoint %s is on network %q, this node on %q: multi-network meshes are not supported", gatewayString(g), na.GetNetwork(), c.network)
		}
		wp.Addr = a.Unmap()
	case *workloadapi.GatewayAddress_Hostname:
		if d.Hostname.GetHostname() == "" || d.Hostname.GetNamespace() == "" {
			return nil, fmt.Errorf("waypoint hostname %q in namespace %q: both are required", d.Hostname.GetHostname(), d.Hostname.GetNamespace())
		}
		wp.Hostname, wp.Namespace = intern(d.Hostname.Hostname), intern(d.Hostname.Namespace)
	default:
		return nil, errors.New("waypoint without an address or a hostname")
	}
	if wp.Port == 0 {
		wp.Port = registry.DefaultWaypointPort
	}
	return wp, nil
}

func gatewayString(g *workloadapi.GatewayAddress) string {
	if g == nil {
		return "(weighted)"
	}
	switch d := g.Destination.(type) {
	case *workloadapi.GatewayAddress_Hostname:
		return d.Hostname.GetNamespace() + "/" + d.Hostname.GetHostname()
	case *workloadapi.GatewayAddress_Address:
		if a, ok := netip.AddrFromSlice(d.Address.GetAddress()); ok {
			return netip.AddrPortFrom(a.Unmap(), uint16(g.HboneMtlsPort)).String()
		}
	}
	return "(unknown)"
}

func extNames(es []*workloadapi.Extension) string {
	names := make([]string, len(es))
	for i, e := range es {
		names[i] = e.Name
	}
	return strings.Join(names, ", ")
}

// workloadType names a WDS workload type as ztunnel reports it
// ("deployment", "cronjob", "pod", "job").
func workloadType(t workloadapi.WorkloadType) string {
	return intern(strings.ToLower(t.String()))
}

// intern returns s's canonical copy: one string for all equal ones, kept
// while anything uses it (package unique), so that a value every
// workload repeats is held once.
func intern(s string) string {
	if s == "" {
		return ""
	}
	return unique.Make(s).Value()
}

// hasUnknownFields reports whether m or any message in it carries fields
// its schema (the istio.io/istio version meshtun was built with) does not
// have.
func hasUnknownFields(m protoreflect.Message) bool {
	if len(m.GetUnknown()) > 0 {
		return true
	}
	found := false
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsList() && fd.Message() != nil:
			l := v.List()
			for i := 0; i < l.Len() && !found; i++ {
				found = hasUnknownFields(l.Get(i).Message())
			}
		case fd.IsMap():
			if fd.MapValue().Message() != nil {
				v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
					found = hasUnknownFields(mv.Message())
					return !found
				})
			}
		case fd.Message() != nil:
			found = hasUnknownFields(v.Message())
		}
		return !found
	})
	return found
}
