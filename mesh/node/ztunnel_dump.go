package node

import (
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/proxy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// The ztunnel shape of /config_dump (/config_dump?format=ztunnel): the
// JSON ztunnel's admin server writes, with its field names, so that tools
// written against ztunnel's admin endpoint (istioctl ztunnel-config, and
// scripts reading workloads, services, policies and certificates) read
// meshtun's. These are meshtun's own types, filled from the registry
// snapshot and the identity source; fields meshtun has no value for are
// left out, as ztunnel leaves out its defaults.

// ztDump is the top level: ztunnel's proxy state (workloads, services,
// policies) and its certificates.
type ztDump struct {
	Workloads    []ztWorkload `json:"workloads"`
	Services     []ztService  `json:"services"`
	Policies     []ztPolicy   `json:"policies"`
	Certificates []ztCerts    `json:"certificates"`
	// WorkloadState is ztunnel's per local workload state with its open
	// connections, by workload UID (istioctl ztunnel-config connections).
	WorkloadState map[string]ztWorkloadState `json:"workloadState"`
}

type ztWorkloadState struct {
	Connections ztConnections  `json:"connections"`
	Info        ztWorkloadInfo `json:"info"`
}

type ztConnections struct {
	Inbound  []ztConn `json:"inbound"`
	Outbound []ztConn `json:"outbound"`
}

type ztConn struct {
	Src         string `json:"src"`
	OriginalDst string `json:"originalDst"`
	ActualDst   string `json:"actualDst"`
	Protocol    string `json:"protocol"`
}

type ztWorkloadInfo struct {
	Name           string `json:"name"`
	Namespace      string `json:"namespace"`
	TrustDomain    string `json:"trustDomain"`
	ServiceAccount string `json:"serviceAccount"`
}

// maxListedConns bounds the connections /config_dump lists.
const maxListedConns = 10000

// ztWorkloadStates is workloadState: every mesh workload of node, with
// the open connections it is an end of (inbound: its server side;
// outbound: its client side), as ztunnel lists them.
func ztWorkloadStates(snap *registry.Snapshot, node string, conns []proxy.OpenConn) map[string]ztWorkloadState {
	states := map[string]ztWorkloadState{}
	for _, w := range snap.Workloads {
		if !w.CapturedBy(node) {
			continue
		}
		states[ztUID(w)] = ztWorkloadState{
			Connections: ztConnections{Inbound: []ztConn{}, Outbound: []ztConn{}},
			Info: ztWorkloadInfo{Name: w.Name, Namespace: w.Namespace, TrustDomain: w.Identity.TrustDomain().Name(),
				ServiceAccount: w.ServiceAccount},
		}
	}
	for _, c := range conns {
		zc := ztConn{Src: c.Src.String(), OriginalDst: c.Dst.String(), ActualDst: c.Actual, Protocol: c.Protocol}
		if w := c.DstWorkload; c.Direction == "inbound" && w != nil {
			if st, ok := states[ztUID(w)]; ok {
				st.Connections.Inbound = append(st.Connections.Inbound, zc)
				states[ztUID(w)] = st
			}
		}
		if w := c.SrcWorkload; c.Direction == "outbound" && w != nil {
			if st, ok := states[ztUID(w)]; ok {
				st.Connections.Outbound = append(st.Connections.Outbound, zc)
				states[ztUID(w)] = st
			}
		}
	}
	return states
}

type ztWorkload struct {
	UID                   string       `json:"uid,omitempty"`
	WorkloadIPs           []netip.Addr `json:"workloadIps"`
	Protocol              string       `json:"protocol"`
	NetworkMode           string       `json:"networkMode"`
	Name                  string       `json:"name"`
	Namespace             string       `json:"namespace"`
	TrustDomain           string       `json:"trustDomain,omitempty"`
	ServiceAccount        string       `json:"serviceAccount,omitempty"`
	WorkloadName          string       `json:"workloadName,omitempty"`
	WorkloadType          string       `json:"workloadType,omitempty"`
	CanonicalName         string       `json:"canonicalName,omitempty"`
	CanonicalRevision     string       `json:"canonicalRevision,omitempty"`
	Node                  string       `json:"node,omitempty"`
	AuthorizationPolicies []string     `json:"authorizationPolicies,omitempty"`
	Status                string       `json:"status"`
	ClusterID             string       `json:"clusterId"`
	Locality              *ztLocality  `json:"locality,omitempty"`
	Services              []string     `json:"services,omitempty"`
	Capacity              int          `json:"capacity"`
	Waypoint              *ztGateway   `json:"waypoint,omitempty"`
}

// ztGateway is ztunnel's GatewayAddress: its destination is
// "network/address" or "namespace/hostname".
type ztGateway struct {
	Destination   string `json:"destination"`
	HboneMtlsPort uint16 `json:"hboneMtlsPort"`
}

// ztWeightedWaypoint is one of a service's weighted waypoints.
type ztWeightedWaypoint struct {
	Destination ztGateway `json:"destination"`
	Weight      uint32    `json:"weight"`
}

// ztGatewayOf renders a waypoint as ztunnel does (the network, one, is
// empty, as in the VIPs); nil for none.
func ztGatewayOf(wp *registry.Waypoint) *ztGateway {
	if wp == nil {
		return nil
	}
	g := &ztGateway{Destination: wp.Namespace + "/" + wp.Hostname, HboneMtlsPort: wp.Port}
	if wp.Addr.IsValid() {
		g.Destination = "/" + wp.Addr.String()
	}
	if g.HboneMtlsPort == 0 {
		g.HboneMtlsPort = registry.DefaultWaypointPort
	}
	return g
}

// ztLocality is a workload's locality; ztunnel leaves it out when empty.
type ztLocality struct {
	Region  string `json:"region"`
	Zone    string `json:"zone"`
	Subzone string `json:"subzone"`
}

type ztService struct {
	Name      string `json:"name"`
	Namespace string `json:"namespace"`
	Hostname  string `json:"hostname"`
	// VIPs are "network/address", as ztunnel writes them.
	VIPs []string `json:"vips"`
	// Ports maps each service port to its target port (0: the
	// endpoint's own).
	Ports map[string]uint16 `json:"ports"`
	// Endpoints are keyed by workload uid.
	Endpoints map[string]ztEndpoint `json:"endpoints"`
	// SubjectAltNames are the identities of the endpoints.
	SubjectAltNames   []string             `json:"subjectAltNames,omitempty"`
	IPFamilies        string               `json:"ipFamilies,omitempty"`
	Waypoint          *ztGateway           `json:"waypoint,omitempty"`
	WeightedWaypoints []ztWeightedWaypoint `json:"weightedWaypoints,omitempty"`
}

type ztEndpoint struct {
	WorkloadUID string            `json:"workloadUid"`
	Service     string            `json:"service"`
	Port        map[string]uint16 `json:"port"`
}

// ztPolicy is ztunnel's Authorization: rules (OR) of clauses (AND) of
// matches (OR), the nesting istiod sends in the Authorization resource.
type ztPolicy struct {
	Name      string        `json:"name"`
	Namespace string        `json:"namespace"`
	Scope     string        `json:"scope"`
	Action    string        `json:"action"`
	Rules     [][][]ztMatch `json:"rules"`
	DryRun    bool          `json:"dryRun"`
}

// ztMatch is ztunnel's RbacMatch: its fields are AND-ed, the values of one
// field OR-ed; empty fields are left out.
type ztMatch struct {
	Namespaces          []ztString     `json:"namespaces,omitempty"`
	NotNamespaces       []ztString     `json:"notNamespaces,omitempty"`
	ServiceAccounts     []ztSAMatch    `json:"serviceAccounts,omitempty"`
	NotServiceAccounts  []ztSAMatch    `json:"notServiceAccounts,omitempty"`
	Principals          []ztString     `json:"principals,omitempty"`
	NotPrincipals       []ztString     `json:"notPrincipals,omitempty"`
	SourceIPs           []netip.Prefix `json:"sourceIps,omitempty"`
	NotSourceIPs        []netip.Prefix `json:"notSourceIps,omitempty"`
	DestinationIPs      []netip.Prefix `json:"destinationIps,omitempty"`
	NotDestinationIPs   []netip.Prefix `json:"notDestinationIps,omitempty"`
	DestinationPorts    []uint16       `json:"destinationPorts,omitempty"`
	NotDestinationPorts []uint16       `json:"notDestinationPorts,omitempty"`
}

// ztString is ztunnel's StringMatch, serialized as serde writes a Rust
// enum: {"Exact":"v"}, {"Prefix":"v"}, {"Suffix":"v"} or {"Presence":[]}.
type ztString map[string]any

// ztStrings turns Istio patterns ("v", "v*", "*v", "*") into StringMatches.
func ztStrings(patterns []string) []ztString {
	var out []ztString
	for _, p := range patterns {
		switch {
		case p == "*":
			out = append(out, ztString{"Presence": []any{}})
		case strings.HasSuffix(p, "*"):
			out = append(out, ztString{"Prefix": p[:len(p)-1]})
		case strings.HasPrefix(p, "*"):
			out = append(out, ztString{"Suffix": p[1:]})
		default:
			out = append(out, ztString{"Exact": p})
		}
	}
	return out
}

// ztSAMatch is ztunnel's ServiceAccountMatch.
type ztSAMatch struct {
	Namespace      string `json:"namespace"`
	ServiceAccount string `json:"serviceAccount"`
}

func ztServiceAccounts(nsSA []string) []ztSAMatch {
	var out []ztSAMatch
	for _, v := range nsSA {
		ns, sa, _ := strings.Cut(v, "/")
		out = append(out, ztSAMatch{Namespace: ns, ServiceAccount: sa})
	}
	return out
}

// ztSourceMatches renders one source. ztunnel's match has no exceptions
// to an IP block (Istio's policies have none; meshtun's file form does):
// a block with exceptions gets a match of its own whose not-list holds
// them, the other fields repeated, which keeps the meaning. A not-block's
// exceptions are not shown: "not (block except e)" is not one match.
func ztSourceMatches(f policy.Source) []ztMatch {
	m := ztMatch{
		Namespaces: ztStrings(f.Namespaces), NotNamespaces: ztStrings(f.NotNamespaces),
		Principals: ztStrings(f.Principals), NotPrincipals: ztStrings(f.NotPrincipals),
		ServiceAccounts: ztServiceAccounts(f.ServiceAccounts), NotServiceAccounts: ztServiceAccounts(f.NotServiceAccounts),
	}
	for _, b := range f.NotIPBlocks {
		m.NotSourceIPs = append(m.NotSourceIPs, b.CIDR)
	}
	var plain []netip.Prefix
	var out []ztMatch
	for _, b := range f.IPBlocks {
		if len(b.Except) == 0 {
			plain = append(plain, b.CIDR)
			continue
		}
		e := m
		e.SourceIPs = []netip.Prefix{b.CIDR}
		e.NotSourceIPs = append(slices.Clone(m.NotSourceIPs), b.Except...)
		out = append(out, e)
	}
	if len(plain) > 0 || len(out) == 0 {
		m.SourceIPs = plain
		out = append([]ztMatch{m}, out...)
	}
	return out
}

func ztPrefixes(vs []string) []netip.Prefix {
	var out []netip.Prefix
	for _, v := range vs {
		if p, err := policy.ParsePrefix(v); err == nil {
			out = append(out, p)
		}
	}
	return out
}

func ztPorts(vs []string) []uint16 {
	var out []uint16
	for _, v := range vs {
		if p, err := strconv.ParseUint(v, 10, 16); err == nil {
			out = append(out, uint16(p))
		}
	}
	return out
}

// ztRules nests a policy's rules as istiod does for ztunnel: per rule a
// clause of the from-sources, a clause of the to-operations, and one
// clause per when-condition. HTTP fields (which an L4 proxy cannot match,
// and which the policy package has already made match nothing or kept the
// L4 part of) are not rendered. A when-key the dump cannot express keeps
// its clause empty (ztunnel's "matches anything": the dump is a view;
// enforcement is meshtun's).
func ztRules(rules []policy.Rule) [][][]ztMatch {
	out := [][][]ztMatch{}
	for _, r := range rules {
		var clauses [][]ztMatch
		if len(r.From) > 0 {
			var c []ztMatch
			for _, f := range r.From {
				c = append(c, ztSourceMatches(f)...)
			}
			clauses = append(clauses, c)
		}
		if len(r.To) > 0 {
			var c []ztMatch
			for _, t := range r.To {
				c = append(c, ztMatch{DestinationPorts: t.Ports, NotDestinationPorts: t.NotPorts})
			}
			clauses = append(clauses, c)
		}
		for _, w := range r.When {
			var m ztMatch
			switch w.Key {
			case "source.ip":
				m.SourceIPs, m.NotSourceIPs = ztPrefixes(w.Values), ztPrefixes(w.NotValues)
			case "source.namespace":
				m.Namespaces, m.NotNamespaces = ztStrings(w.Values), ztStrings(w.NotValues)
			case "source.principal":
				m.Principals, m.NotPrincipals = ztStrings(w.Values), ztStrings(w.NotValues)
			case "destination.ip":
				m.DestinationIPs, m.NotDestinationIPs = ztPrefixes(w.Values), ztPrefixes(w.NotValues)
			case "destination.port":
				m.DestinationPorts, m.NotDestinationPorts = ztPorts(w.Values), ztPorts(w.NotValues)
			default:
				continue
			}
			clauses = append(clauses, []ztMatch{m})
		}
		if clauses == nil {
			clauses = [][]ztMatch{}
		}
		out = append(out, clauses)
	}
	return out
}

// ztCerts and ztCert are ztunnel's certificate dump: camelCase, the chain
// (leaf first) in certChain and the trust roots in rootCerts, which is what
// istioctl ztunnel-config reads (ztunnel releases before its camelCase
// rename wrote ca_cert and cert_chain).
type ztCerts struct {
	Identity  string   `json:"identity"`
	State     string   `json:"state"`
	CertChain []ztCert `json:"certChain"`
	RootCerts []ztCert `json:"rootCerts"`
}

type ztCert struct {
	// PEM is the base64 of the PEM text, as ztunnel writes it.
	PEM            string `json:"pem"`
	SerialNumber   string `json:"serialNumber"`
	ValidFrom      string `json:"validFrom"`
	ExpirationTime string `json:"expirationTime"`
}

// ztUID is a workload's uid: istiod's, or one of the same form.
func ztUID(w *registry.Workload) string {
	if w.UID != "" {
		return w.UID
	}
	return w.Cluster + "//Pod/" + w.Namespace + "/" + w.Name
}

// ztunnelDump renders the snapshot and the certificates in ztunnel's shape.
func ztunnelDump(snap *registry.Snapshot, svids *identity.Source) ztDump {
	d := ztDump{Workloads: []ztWorkload{}, Services: []ztService{}, Policies: []ztPolicy{}, Certificates: []ztCerts{}}
	svcsOf := map[*registry.Workload][]string{}
	for _, s := range snap.Services {
		key := s.Namespace + "/" + s.Hostname
		zs := ztService{Name: s.Name, Namespace: s.Namespace, Hostname: s.Hostname, VIPs: []string{},
			Ports: map[string]uint16{}, Endpoints: map[string]ztEndpoint{}, Waypoint: ztGatewayOf(s.Waypoint)}
		for i := range s.WeightedWaypoints {
			ww := &s.WeightedWaypoints[i]
			zs.WeightedWaypoints = append(zs.WeightedWaypoints, ztWeightedWaypoint{Destination: *ztGatewayOf(&ww.Waypoint), Weight: ww.Weight})
		}
		ports := map[string]uint16{}
		for _, p := range s.Ports {
			ports[strconv.Itoa(int(p.Port))] = p.TargetPort
			zs.Ports[strconv.Itoa(int(p.Port))] = p.TargetPort
		}
		var v4, v6 bool
		for _, vip := range s.VIPs {
			zs.VIPs = append(zs.VIPs, "/"+vip.String())
			v4, v6 = v4 || vip.Is4(), v6 || !vip.Is4()
		}
		for _, vip := range s.Families() {
			for _, ep := range s.Endpoints(vip) {
				uid := ztUID(ep.Workload)
				if _, seen := zs.Endpoints[uid]; seen {
					continue
				}
				zs.Endpoints[uid] = ztEndpoint{WorkloadUID: uid, Service: key, Port: ports}
				svcsOf[ep.Workload] = append(svcsOf[ep.Workload], key)
				if ep.Workload.InMesh {
					zs.SubjectAltNames = append(zs.SubjectAltNames, ep.Workload.Identity.String())
				}
			}
		}
		slices.Sort(zs.SubjectAltNames)
		zs.SubjectAltNames = slices.Compact(zs.SubjectAltNames)
		switch {
		case v4 && v6:
			zs.IPFamilies = "Dual"
		case v4:
			zs.IPFamilies = "IPv4"
		case v6:
			zs.IPFamilies = "IPv6"
		}
		d.Services = append(d.Services, zs)
	}
	for _, w := range snap.Workloads {
		zw := ztWorkload{UID: ztUID(w), WorkloadIPs: w.Addresses, Protocol: "TCP", NetworkMode: "Standard",
			Name: w.Name, Namespace: w.Namespace, ServiceAccount: w.ServiceAccount,
			WorkloadName: w.WorkloadName, WorkloadType: w.WorkloadType, Node: w.Node,
			Status: "Healthy", ClusterID: w.Cluster, Services: svcsOf[w], Capacity: 1, Waypoint: ztGatewayOf(w.Waypoint)}
		if w.Capacity > 0 {
			zw.Capacity = int(w.Capacity)
		}
		zw.CanonicalName, zw.CanonicalRevision = w.Canonical()
		if l := w.Locality; l != (registry.Locality{}) {
			zw.Locality = &ztLocality{Region: l.Region, Zone: l.Zone, Subzone: l.Subzone}
		}
		if zw.WorkloadIPs == nil {
			zw.WorkloadIPs = []netip.Addr{}
		}
		if w.InMesh {
			zw.Protocol = "HBONE"
			zw.TrustDomain = w.Identity.TrustDomain().Name()
		}
		if w.Health == registry.Unhealthy {
			zw.Status = "Unhealthy"
		}
		deny, allow, _ := w.Policies()
		for _, p := range append(slices.Clone(deny), allow...) {
			zw.AuthorizationPolicies = append(zw.AuthorizationPolicies, p.Namespace+"/"+p.Name)
		}
		d.Workloads = append(d.Workloads, zw)
	}
	for _, p := range snap.Policies {
		zp := ztPolicy{Name: p.Name, Namespace: p.Namespace, Scope: "Namespace", Action: ztAction(p.Action), Rules: ztRules(p.Rules)}
		switch {
		case len(p.Selector) > 0:
			zp.Scope = "WorkloadSelector"
		case p.Namespace == snap.RootNamespace:
			zp.Scope = "Global"
		}
		d.Policies = append(d.Policies, zp)
	}
	if svids != nil {
		var roots []*x509.Certificate
		if b, err := svids.GetX509BundleForTrustDomain(snap.TrustDomain); err == nil {
			roots = b.X509Authorities()
		}
		for _, id := range svids.IDs() {
			d.Certificates = append(d.Certificates, ztCertsOf(id, svids, roots))
		}
	}
	return d
}

func ztAction(a policy.Action) string {
	s := strings.ToLower(a.String())
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// ztCertsOf is the certificate state of one local identity: Available
// with its chain, Initializing while the first is being issued, or
// Unavailable with the reason.
func ztCertsOf(id spiffeid.ID, svids *identity.Source, roots []*x509.Certificate) ztCerts {
	c := ztCerts{Identity: id.String(), CertChain: []ztCert{}, RootCerts: []ztCert{}}
	svid, err := svids.SVID(id)
	switch {
	case err != nil && strings.Contains(err.Error(), "still being issued"):
		c.State = "Initializing"
		return c
	case err != nil:
		c.State = "Unavailable: " + err.Error()
		return c
	}
	c.State = "Available"
	for _, cert := range svid.Certificates {
		c.CertChain = append(c.CertChain, ztCertOf(cert))
	}
	for _, cert := range roots {
		c.RootCerts = append(c.RootCerts, ztCertOf(cert))
	}
	return c
}

func ztCertOf(c *x509.Certificate) ztCert {
	p := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
	return ztCert{PEM: base64.StdEncoding.EncodeToString(p), SerialNumber: c.SerialNumber.String(),
		ValidFrom: c.NotBefore.UTC().Format(time.RFC3339), ExpirationTime: c.NotAfter.UTC().Format(time.RFC3339)}
}

// writeZtunnelDump answers /config_dump in ztunnel's shape.
func (n *node) writeZtunnelDump(w http.ResponseWriter) {
	snap := n.reg.Load()
	d := ztunnelDump(snap, n.svids)
	var conns []proxy.OpenConn
	if n.px != nil {
		conns = n.px.OpenConns(maxListedConns)
	}
	d.WorkloadState = ztWorkloadStates(snap, n.cfg.Name, conns)
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(d)
}
