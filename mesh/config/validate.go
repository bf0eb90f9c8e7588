package config

import (
	"fmt"
	"math/big"
	"net"
	"net/netip"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

var (
	dnsLabelRE     = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	dnsSubdomainRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
)

// checkLabel checks a Kubernetes DNS label (namespaces, service names).
func checkLabel(s string) error {
	if len(s) > 63 || !dnsLabelRE.MatchString(s) {
		return fmt.Errorf("%q is not a valid name: at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit", s)
	}
	return nil
}

// checkSubdomain checks a Kubernetes DNS subdomain (pod, node, service
// account and policy names).
func checkSubdomain(s string) error {
	if len(s) > 253 || !dnsSubdomainRE.MatchString(s) {
		return fmt.Errorf("%q is not a valid name: lower-case letters, digits, '-' and '.', starting and ending with a letter or digit", s)
	}
	return nil
}

// checkLink checks a Linux interface name.
func checkLink(s string) error {
	if s == "" || len(s) > 15 || s == "." || s == ".." || strings.ContainsAny(s, "/: \t\n") {
		return fmt.Errorf("%q is not a valid link name (1-15 bytes, no '/', ':' or spaces)", s)
	}
	return nil
}

// checkListen checks host:port with an IP address (or nothing) as host.
func checkListen(s string) error {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return fmt.Errorf("%q is not host:port", s)
	}
	if host != "" && host != "localhost" {
		if _, err := netip.ParseAddr(host); err != nil {
			return fmt.Errorf("%q: the host must be an IP address, localhost or empty (all addresses)", s)
		}
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("%q: %q is not a port number (1-65535)", s, port)
	}
	return nil
}

func checkMode(s string) error {
	if s != "STRICT" && s != "PERMISSIVE" {
		return fmt.Errorf("unknown mode %q (want STRICT or PERMISSIVE)", s)
	}
	return nil
}

// workloadRef resolves a service's workload reference: "name" in the
// service's namespace or "namespace/name".
func workloadRef(ns, ref string) registry.WorkloadRef {
	if n, name, ok := strings.Cut(ref, "/"); ok {
		return registry.WorkloadRef{Namespace: n, Name: name}
	}
	return registry.WorkloadRef{Namespace: ns, Name: ref}
}

func (c *Config) validate(d *decoder) {
	if c.TrustDomain == "" {
		c.TrustDomain = DefaultTrustDomain
	}
	td, err := spiffeid.TrustDomainFromString(c.TrustDomain)
	if err != nil {
		d.errorf("trustDomain", "%q is not a valid trust domain: %v", c.TrustDomain, err)
	}
	c.td = td
	if c.RootNamespace == "" {
		c.RootNamespace = DefaultRootNamespace
	}
	if err := checkLabel(c.RootNamespace); err != nil {
		d.errorf("rootNamespace", "%v", err)
	}
	if c.ClusterDomain == "" {
		c.ClusterDomain = DefaultClusterDomain
	}
	if err := checkSubdomain(c.ClusterDomain); err != nil {
		d.errorf("clusterDomain", "%v", err)
	}
	if c.PeerAuthentication == "" {
		c.PeerAuthentication = "PERMISSIVE"
	}
	if err := checkMode(c.PeerAuthentication); err != nil {
		d.errorf("peerAuthentication", "%v", err)
	}
	if c.CA.Dir == "" {
		c.CA.Dir = DefaultCADir
	} else if !filepath.IsAbs(c.CA.Dir) {
		c.CA.Dir = filepath.Join(filepath.Dir(c.Path), c.CA.Dir)
	}
	if c.CA.Listen == "" {
		c.CA.Listen = DefaultCAListen
	}
	if c.CA.NodeCredentialTTL == 0 {
		c.CA.NodeCredentialTTL = DefaultNodeCredentialTTL
	}
	for i, s := range c.CA.RevokedNodeCredentials {
		if _, ok := new(big.Int).SetString(strings.ReplaceAll(strings.TrimPrefix(s, "0x"), ":", ""), 16); !ok {
			d.errorf(fmt.Sprintf("ca.revokedNodeCredentials[%d]", i), "%q is not a hexadecimal serial number", s)
		}
	}

	nodes := c.validateNodes(d)
	wls := c.validateWorkloads(d, nodes)
	c.validateServices(d, wls)
	c.validatePolicies(d)
	c.validatePeerAuthentications(d)
}

// paMode checks an Istio mTLS mode and returns it as meshtun enforces it:
// "" (inherit) for UNSET, PERMISSIVE for DISABLE (as ztunnel: a node
// proxy still accepts HBONE).
func paMode(d *decoder, path, mode string) string {
	switch mode {
	case "", "UNSET":
		return ""
	case "STRICT", "PERMISSIVE":
		return mode
	case "DISABLE":
		return "PERMISSIVE"
	}
	d.errorf(path, "unknown mode %q (want UNSET, STRICT, PERMISSIVE or DISABLE)", mode)
	return ""
}

// validatePeerAuthentications checks the peerAuthentications and resolves
// each workload's mode as Istio does: the mesh default (the top-level
// peerAuthentication), then a mesh-wide policy (root namespace, no
// selector), a namespace-wide one (no selector), a workload one (with a
// selector), each overriding the previous unless UNSET; then the
// workload's own peerAuthentication field. A workload policy's
// portLevelMtls sets modes per port. Where Istio picks the oldest of two
// policies at one level, the first in the file wins, with a warning.
func (c *Config) validatePeerAuthentications(d *decoder) {
	type pa struct {
		i     int
		mode  string
		ports map[uint16]string
	}
	var (
		mesh *pa
		ns   = map[string]*pa{}
		wl   []*pa
		seen = map[registry.WorkloadRef]int{}
	)
	for i := range c.PeerAuthentications {
		a := &c.PeerAuthentications[i]
		p := fmt.Sprintf("peerAuthentications[%d]", i)
		if a.Namespace == "" {
			a.Namespace = DefaultNamespace
		} else if err := checkLabel(a.Namespace); err != nil {
			d.errorf(p+".namespace", "%v", err)
		}
		ref := registry.WorkloadRef{Namespace: a.Namespace, Name: a.Name}
		switch first, dup := seen[ref]; {
		case a.Name == "":
			d.errorf(p+".name", "is required")
		case dup:
			d.errorf(p+".name", "peer authentication %s is already defined at line %d", ref, d.at(fmt.Sprintf("peerAuthentications[%d]", first)).line)
		default:
			if err := checkSubdomain(a.Name); err != nil {
				d.errorf(p+".name", "%v", err)
			}
			seen[ref] = i
		}
		e := &pa{i: i, mode: paMode(d, p+".mtls.mode", a.MTLS.Mode)}
		if len(a.PortLevelMTLS) > 0 {
			if len(a.Selector) == 0 {
				d.errorf(p+".portLevelMtls", "needs a selector (as in Istio)")
			}
			e.ports = map[uint16]string{}
			for k, m := range a.PortLevelMTLS {
				kp := p + ".portLevelMtls." + k
				port, err := strconv.ParseUint(k, 10, 16)
				if err != nil || port == 0 {
					d.errorf(kp, "%q is not a port number (1-65535)", k)
					continue
				}
				if mode := paMode(d, kp+".mode", m.Mode); mode != "" {
					e.ports[uint16(port)] = mode
				}
			}
		}
		var prev *pa
		switch {
		case len(a.Selector) > 0 && a.Namespace == c.RootNamespace:
			d.warnf(p+".selector", "a peer authentication with a selector in the root namespace applies to nothing (as in Istio); leave out the selector for a mesh-wide one")
			continue
		case len(a.Selector) > 0:
			wl = append(wl, e)
			continue
		case a.Namespace == c.RootNamespace:
			prev = mesh
			if prev == nil {
				mesh = e
			}
		default:
			prev = ns[a.Namespace]
			if prev == nil {
				ns[a.Namespace] = e
			}
		}
		if prev != nil {
			d.warnf(p, "ignored: %s (line %d) already sets the mode of the same scope", c.PeerAuthentications[prev.i].Name, d.at(fmt.Sprintf("peerAuthentications[%d]", prev.i)).line)
		}
	}
	for i := range c.Workloads {
		w := &c.Workloads[i]
		mode := c.PeerAuthentication
		if mesh != nil && mesh.mode != "" {
			mode = mesh.mode
		}
		if e := ns[w.Namespace]; e != nil && e.mode != "" {
			mode = e.mode
		}
		var sel *pa
		for _, e := range wl {
			a := &c.PeerAuthentications[e.i]
			if a.Namespace != w.Namespace || !policy.SelectorMatches(a.Selector, w.Labels) {
				continue
			}
			if sel != nil {
				d.warnf(fmt.Sprintf("peerAuthentications[%d].selector", e.i), "workload %s/%s is already selected by %s (line %d), which decides its mode", w.Namespace, w.Name, c.PeerAuthentications[sel.i].Name, d.at(fmt.Sprintf("peerAuthentications[%d]", sel.i)).line)
				continue
			}
			sel = e
		}
		if sel != nil && sel.mode != "" {
			mode = sel.mode
		}
		if w.PeerAuthentication != "" {
			mode = w.PeerAuthentication
		}
		w.PeerAuthentication = mode
		if sel != nil {
			for port, m := range sel.ports {
				if w.portModes == nil {
					w.portModes = map[uint16]string{}
				}
				w.portModes[port] = m
			}
		}
	}
}

func (c *Config) validateNodes(d *decoder) map[string]int {
	nodes := map[string]int{}
	for i := range c.Nodes {
		n := &c.Nodes[i]
		p := fmt.Sprintf("nodes[%d]", i)
		switch first, dup := nodes[n.Name]; {
		case n.Name == "":
			d.errorf(p+".name", "is required")
		case dup:
			d.errorf(p+".name", "node %q is already defined at line %d", n.Name, d.at(fmt.Sprintf("nodes[%d]", first)).line)
		default:
			if err := checkSubdomain(n.Name); err != nil {
				d.errorf(p+".name", "%v", err)
			}
			nodes[n.Name] = i
		}
		if n.TUN.Name == "" {
			n.TUN.Name = DefaultTUNName
		}
		if err := checkLink(n.TUN.Name); err != nil {
			d.errorf(p+".tun.name", "%v", err)
		}
		if n.TUN.MTU == 0 {
			n.TUN.MTU = DefaultMTU
		}
		if n.TUN.MTU < 1280 || n.TUN.MTU > 65535 {
			d.errorf(p+".tun.mtu", "%d is not a valid MTU (1280-65535)", n.TUN.MTU)
		}
		if n.TUN.TxQueueLen < 0 {
			d.errorf(p+".tun.txQueueLen", "%d is negative", n.TUN.TxQueueLen)
		}
		links := map[string]string{}
		for j, l := range n.Uplinks {
			lp := fmt.Sprintf("%s.uplinks[%d]", p, j)
			if err := checkLink(l); err != nil {
				d.errorf(lp, "%v", err)
			} else if _, dup := links[l]; dup {
				d.errorf(lp, "%q is listed twice", l)
			}
			links[l] = "uplink"
		}
		for j, l := range n.CaptureLinks {
			lp := fmt.Sprintf("%s.captureLinks[%d]", p, j)
			if err := checkLink(l); err != nil {
				d.errorf(lp, "%v", err)
			} else if what, dup := links[l]; dup {
				d.errorf(lp, "%q is already listed as %s", l, what)
			}
			links[l] = "capture link"
		}
		switch n.Listen.AdminFormat {
		case "", "meshtun", "ztunnel":
		default:
			d.errorf(p+".listen.adminFormat", "%q: want meshtun or ztunnel", n.Listen.AdminFormat)
		}
		if !d.has(p + ".listen.adminSocket") {
			n.Listen.AdminSocket = DefaultAdminSocket
		} else if s := n.Listen.AdminSocket; s != "" && (!filepath.IsAbs(s) || len(s) > 107) {
			d.errorf(p+".listen.adminSocket", "%q: want an absolute path of at most 107 bytes (a Unix socket's limit)", s)
		}
		for _, f := range []struct {
			name string
			v    *string
			def  string
		}{{"admin", &n.Listen.Admin, DefaultAdmin}, {"metrics", &n.Listen.Metrics, DefaultMetrics}, {"readiness", &n.Listen.Readiness, DefaultReadiness}} {
			lp := p + ".listen." + f.name
			if !d.has(lp) {
				*f.v = f.def
			} else if *f.v != "" {
				if err := checkListen(*f.v); err != nil {
					d.errorf(lp, "%v", err)
				}
			}
		}
	}
	return nodes
}

type wlIndex struct {
	byRef  map[registry.WorkloadRef]int
	byAddr map[netip.Addr]int
}

func (c *Config) validateWorkloads(d *decoder, nodes map[string]int) wlIndex {
	idx := wlIndex{byRef: map[registry.WorkloadRef]int{}, byAddr: map[netip.Addr]int{}}
	for i := range c.Workloads {
		w := &c.Workloads[i]
		p := fmt.Sprintf("workloads[%d]", i)
		if w.Namespace == "" {
			w.Namespace = DefaultNamespace
		} else if err := checkLabel(w.Namespace); err != nil {
			d.errorf(p+".namespace", "%v", err)
		}
		if w.ServiceAccount == "" {
			w.ServiceAccount = DefaultSA
		} else if err := checkSubdomain(w.ServiceAccount); err != nil {
			d.errorf(p+".serviceAccount", "%v", err)
		}
		ref := registry.WorkloadRef{Namespace: w.Namespace, Name: w.Name}
		switch first, dup := idx.byRef[ref]; {
		case w.Name == "":
			d.errorf(p+".name", "is required")
		case dup:
			d.errorf(p+".name", "workload %s is already defined at line %d", ref, d.at(fmt.Sprintf("workloads[%d]", first)).line)
		default:
			if err := checkSubdomain(w.Name); err != nil {
				d.errorf(p+".name", "%v", err)
			}
			idx.byRef[ref] = i
		}
		if len(w.Addresses) == 0 {
			d.errorf(p+".addresses", "at least one address is required")
		}
		for j, a := range w.Addresses {
			ap := fmt.Sprintf("%s.addresses[%d]", p, j)
			if first, dup := idx.byAddr[a]; dup {
				if first == i {
					d.errorf(ap, "%s is listed twice", a)
				} else {
					o := &c.Workloads[first]
					d.errorf(ap, "%s is already the address of workload %s/%s (line %d)", a, o.Namespace, o.Name, d.at(fmt.Sprintf("workloads[%d]", first)).line)
				}
				continue
			}
			if !a.IsGlobalUnicast() {
				d.errorf(ap, "%s is not a unicast address a workload can have", a)
			}
			idx.byAddr[a] = i
		}
		ni, known := nodes[w.Node]
		switch {
		case w.Node == "" && w.InMesh():
			d.errorf(p+".node", "is required for a workload in the mesh (the node whose proxy captures it)")
		case w.Node != "" && !known:
			d.errorf(p+".node", "node %q is not defined in nodes%s", w.Node, knownNodes(c))
		}
		if w.PeerAuthentication == "" {
			// resolved by validatePeerAuthentications
		} else if err := checkMode(w.PeerAuthentication); err != nil {
			d.errorf(p+".peerAuthentication", "%v", err)
		}
		if w.CaptureLink != "" {
			lp := p + ".captureLink"
			if err := checkLink(w.CaptureLink); err != nil {
				d.errorf(lp, "%v", err)
			} else if !w.InMesh() {
				d.warnf(lp, "ignored: the workload is not in the mesh, so its link is not captured")
			} else if w.Node != "" && known {
				n := &c.Nodes[ni]
				if slices.Contains(n.Uplinks, w.CaptureLink) {
					d.errorf(lp, "%q is an uplink of node %s", w.CaptureLink, n.Name)
				} else if !slices.Contains(n.CaptureLinks, w.CaptureLink) {
					n.CaptureLinks = append(n.CaptureLinks, w.CaptureLink)
				}
			}
		}
	}
	return idx
}

func knownNodes(c *Config) string {
	if len(c.Nodes) == 0 {
		return " (there are none)"
	}
	var names []string
	for _, n := range c.Nodes {
		if n.Name != "" && !slices.Contains(names, n.Name) {
			names = append(names, n.Name)
		}
	}
	return " (known: " + strings.Join(names, ", ") + ")"
}

func (c *Config) validateServices(d *decoder, wls wlIndex) {
	byRef := map[registry.WorkloadRef]int{}
	vips := map[netip.Addr]int{}
	for i := range c.Services {
		s := &c.Services[i]
		p := fmt.Sprintf("services[%d]", i)
		if s.Namespace == "" {
			s.Namespace = DefaultNamespace
		} else if err := checkLabel(s.Namespace); err != nil {
			d.errorf(p+".namespace", "%v", err)
		}
		ref := registry.WorkloadRef{Namespace: s.Namespace, Name: s.Name}
		switch first, dup := byRef[ref]; {
		case s.Name == "":
			d.errorf(p+".name", "is required")
		case dup:
			d.errorf(p+".name", "service %s is already defined at line %d", ref, d.at(fmt.Sprintf("services[%d]", first)).line)
		default:
			if err := checkLabel(s.Name); err != nil {
				d.errorf(p+".name", "%v", err)
			}
			byRef[ref] = i
		}
		if s.Hostname != "" {
			if err := checkSubdomain(s.Hostname); err != nil {
				d.errorf(p+".hostname", "%v", err)
			}
		}
		if len(s.VIPs) == 0 {
			d.errorf(p+".vips", "at least one VIP is required")
		}
		for j, v := range s.VIPs {
			vp := fmt.Sprintf("%s.vips[%d]", p, j)
			if !v.IsGlobalUnicast() {
				d.errorf(vp, "%s is not a unicast address a service can have", v)
			} else if wi, ok := wls.byAddr[v]; ok {
				o := &c.Workloads[wi]
				d.errorf(vp, "%s is the address of workload %s/%s (line %d)", v, o.Namespace, o.Name, d.at(fmt.Sprintf("workloads[%d]", wi)).line)
			} else if first, dup := vips[v]; dup {
				o := &c.Services[first]
				d.errorf(vp, "%s is already a VIP of service %s/%s (line %d)", v, o.Namespace, o.Name, d.at(fmt.Sprintf("services[%d]", first)).line)
			}
			vips[v] = i
		}
		if len(s.Ports) == 0 {
			d.errorf(p+".ports", "at least one port is required")
		}
		for j := range s.Ports {
			pp := fmt.Sprintf("%s.ports[%d]", p, j)
			port := &s.Ports[j]
			if port.Port == 0 {
				d.errorf(pp+".port", "is required")
				continue
			}
			for k := range j {
				if s.Ports[k].Port == port.Port {
					d.errorf(pp+".port", "port %d is listed twice", port.Port)
				}
			}
			if port.TargetPort == 0 {
				port.TargetPort = port.Port
			}
		}
		switch s.TrafficDistribution {
		case "", "PreferSameNode":
		default:
			d.errorf(p+".trafficDistribution", "unknown value %q (want PreferSameNode, or nothing for any endpoint)", s.TrafficDistribution)
		}
		var members []*Workload
		switch {
		case len(s.Selector) > 0 && len(s.Workloads) > 0:
			d.errorf(p+".workloads", "set either selector or workloads, not both")
			continue
		case len(s.Selector) > 0:
			for wi := range c.Workloads {
				w := &c.Workloads[wi]
				if w.Namespace == s.Namespace && policy.SelectorMatches(s.Selector, w.Labels) {
					members = append(members, w)
				}
			}
			if len(members) == 0 {
				d.warnf(p+".selector", "selects no workload in namespace %s", s.Namespace)
				continue
			}
		case len(s.Workloads) > 0:
			for j, r := range s.Workloads {
				wr := workloadRef(s.Namespace, r)
				wi, ok := wls.byRef[wr]
				if !ok {
					d.errorf(fmt.Sprintf("%s.workloads[%d]", p, j), "workload %s is not defined", wr)
					continue
				}
				members = append(members, &c.Workloads[wi])
			}
		default:
			d.errorf(p+".selector", "set selector or workloads to give the service endpoints")
			continue
		}
		for j, v := range s.VIPs {
			has := false
			for _, w := range members {
				for _, a := range w.Addresses {
					has = has || a.Is4() == v.Is4()
				}
			}
			if !has && len(members) > 0 {
				d.warnf(fmt.Sprintf("%s.vips[%d]", p, j), "no endpoint has an %s address: connections to %s find no endpoint", familyName(v), v)
			}
		}
	}
}

func familyName(a netip.Addr) string {
	if a.Is4() {
		return "IPv4"
	}
	return "IPv6"
}

var policyFieldRE = regexp.MustCompile(`^rules\[(\d+)\]\.(from|to)\[(\d+)\]`)

// istio returns the policy as policy.FromIstio takes it.
func (ap *AuthorizationPolicy) istio() policy.Istio {
	in := policy.Istio{
		Name: ap.Name, Namespace: ap.Namespace, Selector: ap.Selector, Action: ap.Action,
		HasProvider: ap.Provider != nil,
	}
	switch {
	case ap.TargetRef != nil:
		in.TargetRef = "targetRef"
	case len(ap.TargetRefs) > 0:
		in.TargetRef = "targetRefs"
	}
	for _, r := range ap.Rules {
		pr := policy.Rule{}
		for _, f := range r.From {
			s := f.Source
			ps := policy.Source{
				Principals: s.Principals, NotPrincipals: s.NotPrincipals,
				Namespaces: s.Namespaces, NotNamespaces: s.NotNamespaces,
				ServiceAccounts: s.ServiceAccounts, NotServiceAccounts: s.NotServiceAccounts,
				IPBlocks: s.IPBlocks, NotIPBlocks: s.NotIPBlocks,
			}
			for _, f := range s.l7 {
				ps.L7 = append(ps.L7, f.name)
			}
			pr.From = append(pr.From, ps)
		}
		for _, t := range r.To {
			po := policy.Operation{Ports: t.Operation.Ports, NotPorts: t.Operation.NotPorts}
			for _, f := range t.Operation.l7 {
				po.L7 = append(po.L7, f.name)
			}
			pr.To = append(pr.To, po)
		}
		for _, w := range r.When {
			pr.When = append(pr.When, policy.Condition{Key: w.Key, Values: w.Values, NotValues: w.NotValues})
		}
		in.Rules = append(in.Rules, pr)
	}
	return in
}

// policyPath turns a policy.Problem path into the path of the field in
// the file, where the source or operation may be wrapped in Istio's
// {source: …} / {operation: …}.
func policyPath(ap *AuthorizationPolicy, fp string) string {
	m := policyFieldRE.FindStringSubmatchIndex(fp)
	if m == nil {
		return fp
	}
	r, _ := strconv.Atoi(fp[m[2]:m[3]])
	k, _ := strconv.Atoi(fp[m[6]:m[7]])
	if r >= len(ap.Rules) {
		return fp
	}
	wrapped, key := false, "source"
	if fp[m[4]:m[5]] == "from" {
		wrapped = k < len(ap.Rules[r].From) && ap.Rules[r].From[k].wrapped
	} else {
		wrapped, key = k < len(ap.Rules[r].To) && ap.Rules[r].To[k].wrapped, "operation"
	}
	if !wrapped {
		return fp
	}
	return fp[:m[1]] + "." + key + fp[m[1]:]
}

func (c *Config) validatePolicies(d *decoder) {
	seen := map[registry.WorkloadRef]int{}
	for i := range c.AuthorizationPolicies {
		ap := &c.AuthorizationPolicies[i]
		p := fmt.Sprintf("authorizationPolicies[%d]", i)
		if ap.Namespace == "" {
			ap.Namespace = DefaultNamespace
		} else if err := checkLabel(ap.Namespace); err != nil {
			d.errorf(p+".namespace", "%v", err)
		}
		ref := registry.WorkloadRef{Namespace: ap.Namespace, Name: ap.Name}
		switch first, dup := seen[ref]; {
		case ap.Name == "":
			d.errorf(p+".name", "is required")
		case dup:
			d.errorf(p+".name", "policy %s is already defined at line %d", ref, d.at(fmt.Sprintf("authorizationPolicies[%d]", first)).line)
		default:
			if err := checkSubdomain(ap.Name); err != nil {
				d.errorf(p+".name", "%v", err)
			}
			seen[ref] = i
		}
		if ap.Action == "" {
			ap.Action = "ALLOW"
		}
		built, probs := policy.FromIstio(ap.istio())
		for _, pr := range probs {
			if pr.Path == "name" || pr.Path == "namespace" {
				continue // reported above
			}
			fp := join(p, policyPath(ap, pr.Path))
			if pr.Warning {
				d.warnf(fp, "%s", pr.Reason)
			} else {
				d.errorf(fp, "%s", pr.Reason)
			}
		}
		if built == nil {
			continue
		}
		c.policies = append(c.policies, built)
		if len(ap.Selector) > 0 {
			selected := false
			for wi := range c.Workloads {
				w := &c.Workloads[wi]
				selected = selected || built.AppliesTo(c.RootNamespace, w.Namespace, w.Labels)
			}
			if !selected {
				scope := "namespace " + ap.Namespace
				if ap.Namespace == c.RootNamespace {
					scope = "any namespace (root namespace policy)"
				}
				d.warnf(p+".selector", "selects no workload in %s", scope)
			}
		}
	}
}
