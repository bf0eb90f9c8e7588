package registry

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/meshtun/meshtun/mesh/identity/workloadid"
	"github.com/meshtun/meshtun/mesh/policy"
)

// refusedPolicy stands for every policy of a refused workload: its one
// empty rule matches every request, so every connection is denied.
var refusedPolicy = func() *policy.Policy {
	p, err := policy.New(policy.Policy{
		Name: "refused-workload", Namespace: "meshtun", Action: policy.Deny, Rules: []policy.Rule{{}},
	})
	if err != nil {
		panic(err)
	}
	return p
}()

// Kind names what a Conflict is about.
type Kind string

// The kinds of objects of a model.
const (
	KindWorkload Kind = "workload"
	KindService  Kind = "service"
	KindPolicy   Kind = "policy"
)

// Conflict is an object of a model that Resolve left out or trimmed.
type Conflict struct {
	Kind Kind
	// Index is the object's position in the Model's list of its kind.
	Index int
	// Name is namespace/name.
	Name string
	// Dropped: the object is left out; otherwise only part of it (some
	// service VIPs) is.
	Dropped bool
	// Reason says why, naming the object that won.
	Reason string
}

func (c Conflict) String() string {
	what := "trimmed"
	if c.Dropped {
		what = "left out"
	}
	return fmt.Sprintf("%s %s %s: %s", c.Kind, c.Name, what, c.Reason)
}

// Resolve returns a model Build accepts, and what it had to leave out of m
// for that. Sources of the model (the Kubernetes API, istiod) may give
// objects that cannot hold together — two pods with one address while one
// is being deleted, a ServiceEntry VIP that is a pod's address, a
// WorkloadEntry on a pod's IP — and one such object must not keep the
// rest of the mesh from being modelled. Order decides, the same way on
// every node, so the source orders its objects by precedence: an earlier
// workload keeps an address or a name against a later one; workloads keep
// their addresses against service VIPs; an earlier service keeps a name,
// or a VIP, against a later one of its namespace (services of different
// namespaces may share a VIP). A workload that loses is left out whole (a
// workload with part of its addresses would be reached as another); a
// service loses only the VIPs in conflict, and is left out if none
// remains. Service endpoints that name a workload left out are dropped
// silently (the workload's conflict says it). Resolve does not modify m's
// objects; the returned model shares the ones it keeps unchanged.
func Resolve(m Model) (Model, []Conflict) {
	var cs []Conflict
	out := m
	out.Workloads = make([]*Workload, 0, len(m.Workloads))
	out.Services = make([]*Service, 0, len(m.Services))
	out.Policies = make([]*policy.Policy, 0, len(m.Policies))

	seenPolicy := make(map[*policy.Policy]bool, len(m.Policies))
	for i, p := range m.Policies {
		switch {
		case p == nil || !p.Built():
			cs = append(cs, Conflict{Kind: KindPolicy, Index: i, Name: fmt.Sprintf("#%d", i), Dropped: true, Reason: "not built by policy.New"})
			continue
		case seenPolicy[p]:
			cs = append(cs, Conflict{Kind: KindPolicy, Index: i, Name: p.ID(), Dropped: true, Reason: "listed twice"})
			continue
		}
		seenPolicy[p] = true
		out.Policies = append(out.Policies, p)
	}

	nAddrs := 0
	for _, w := range m.Workloads {
		nAddrs += len(w.Addresses)
	}
	owner := make(map[netip.Addr]*Workload, nAddrs)
	names := make(map[WorkloadRef]bool, len(m.Workloads))
	validID := make(map[WorkloadRef]bool) // namespace and account that make an identity
	td := m.TrustDomain
	for i, w := range m.Workloads {
		drop := func(reason string) {
			cs = append(cs, Conflict{Kind: KindWorkload, Index: i, Name: w.String(), Dropped: true, Reason: reason})
		}
		if w.Name == "" || w.Namespace == "" {
			drop("name and namespace are required")
			continue
		}
		ref := WorkloadRef{w.Namespace, w.Name}
		if names[ref] {
			drop("an earlier workload has the same name")
			continue
		}
		if !td.IsZero() {
			sa := w.ServiceAccount
			if sa == "" {
				sa = "default"
			}
			if idKey := (WorkloadRef{w.Namespace, sa}); !validID[idKey] {
				if _, err := workloadid.New(td, w.Namespace, sa); err != nil {
					drop(fmt.Sprintf("identity: %v", err))
					continue
				}
				validID[idKey] = true
			}
		}
		reason := ""
		for k, a := range w.Addresses {
			a = a.Unmap()
			if !a.IsValid() {
				reason = "invalid address"
				break
			}
			if o := owner[a]; o != nil {
				reason = fmt.Sprintf("address %s belongs to workload %s, which takes precedence", a, o)
				break
			}
			if slices.ContainsFunc(w.Addresses[:k], func(b netip.Addr) bool { return b.Unmap() == a }) {
				reason = fmt.Sprintf("address %s listed twice", a)
				break
			}
		}
		if reason != "" {
			drop(reason)
			continue
		}
		for _, a := range w.Addresses {
			owner[a.Unmap()] = w
		}
		names[ref] = true
		out.Workloads = append(out.Workloads, w)
	}

	// A VIP is one service's per namespace: services of different
	// namespaces may share it (ServiceFor chooses by the client's).
	type vipNS struct {
		a  netip.Addr
		ns string
	}
	nVIPs := 0
	for _, svc := range m.Services {
		nVIPs += len(svc.VIPs)
	}
	vipOwner := make(map[vipNS]*Service, nVIPs)
	svcNames := make(map[WorkloadRef]bool, len(m.Services))
	for i, in := range m.Services {
		drop := func(reason string) {
			cs = append(cs, Conflict{Kind: KindService, Index: i, Name: in.String(), Dropped: true, Reason: reason})
		}
		if in.Name == "" || in.Namespace == "" {
			drop("name and namespace are required")
			continue
		}
		ref := WorkloadRef{in.Namespace, in.Name}
		if svcNames[ref] {
			drop("an earlier service has the same name")
			continue
		}
		if r := badPorts(in.Ports); r != "" {
			drop(r)
			continue
		}
		if r := badCIDRs(in.CIDRs); r != "" {
			drop(r)
			continue
		}
		var vips []netip.Addr
		var lost []string
		for _, v := range in.VIPs {
			v = v.Unmap()
			switch {
			case !v.IsValid():
				lost = append(lost, "an invalid VIP")
			case vipOwner[vipNS{v, in.Namespace}] == in:
				// listed twice by the service itself: once is enough
			case owner[v] != nil:
				lost = append(lost, fmt.Sprintf("VIP %s is the address of workload %s", v, owner[v]))
			case vipOwner[vipNS{v, in.Namespace}] != nil:
				lost = append(lost, fmt.Sprintf("VIP %s is a VIP of service %s of the same namespace, which takes precedence", v, vipOwner[vipNS{v, in.Namespace}]))
			default:
				vips = append(vips, v)
				vipOwner[vipNS{v, in.Namespace}] = in // claimed even if later VIPs of in repeat it
				continue
			}
		}
		if len(lost) > 0 && len(vips) == 0 {
			drop(joinReasons(lost))
			continue
		}
		svc := in
		if len(lost) > 0 {
			cs = append(cs, Conflict{Kind: KindService, Index: i, Name: in.String(), Reason: joinReasons(lost)})
		}
		if len(vips) != len(in.VIPs) {
			c := *in
			c.VIPs = vips
			svc = &c
		}
		if len(svc.Selector) == 0 {
			keep := true
			for _, r := range svc.Workloads {
				if !names[r] {
					keep = false
					break
				}
			}
			if !keep {
				c := *svc
				c.Workloads = make([]WorkloadRef, 0, len(svc.Workloads))
				for _, r := range svc.Workloads {
					if names[r] {
						c.Workloads = append(c.Workloads, r)
					}
				}
				svc = &c
			}
		}
		svcNames[ref] = true
		out.Services = append(out.Services, svc)
	}
	return out, cs
}

func badPorts(ps []ServicePort) string {
	for i := range ps {
		if ps[i].Port == 0 {
			return "port 0"
		}
		for j := range i {
			if ps[j].Port == ps[i].Port {
				return fmt.Sprintf("port %d listed twice", ps[i].Port)
			}
		}
	}
	return ""
}

func badCIDRs(ps []netip.Prefix) string {
	for _, p := range ps {
		if !p.IsValid() || p != p.Masked() || p.Addr().Is4In6() {
			return fmt.Sprintf("invalid VIP range %s", p)
		}
	}
	return ""
}

func joinReasons(rs []string) string {
	s := rs[0]
	for _, r := range rs[1:] {
		s += "; " + r
	}
	return s
}
