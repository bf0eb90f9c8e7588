package xds

import (
	"slices"
	"sort"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// addrEntry is one istio.workload.Address resource as istiod last sent
// it, converted: a workload, a service, or neither (a resource meshtun
// accepts but does not model). err says why meshtun refuses it; a refused
// workload keeps what is known of it (w.w.Refused is set), for the node
// to capture and deny it if it is local.
type addrEntry struct {
	w   *workload
	s   *service
	err error
}

// authzEntry is one istio.security.Authorization resource as istiod last
// sent it, converted; p is the policy that stands for it (a deny-all one
// if meshtun cannot apply it, see convert), nil if none does.
type authzEntry struct {
	p   *policy.Policy
	err error
}

// state is the resources of both types as istiod last sent them, by
// resource name: the model is built from it, whatever was NACKed.
type state struct {
	addrs map[string]addrEntry
	authz map[string]authzEntry
}

func (s state) clone() state {
	n := state{addrs: make(map[string]addrEntry, len(s.addrs)), authz: make(map[string]authzEntry, len(s.authz))}
	for k, v := range s.addrs {
		n.addrs[k] = v
	}
	for k, v := range s.authz {
		n.authz[k] = v
	}
	return n
}

// origin says which resource each object of a model came from: the
// resource names of Model.Workloads and Model.Services, by index.
type origin struct {
	workloads, services []string
}

// model assembles the registry model of a state: workloads pods first,
// then in resource name order (the precedence registry.Resolve applies:
// a pod keeps its address against a WorkloadEntry or a ServiceEntry
// endpoint that claims it), in the mesh if Enroll says so; refused
// workloads only if they are this node's and in the mesh (captured and
// denied); services in resource name order with their endpoints (the
// workloads that list them) and the target ports the endpoints give;
// policies after the config file's. src.mu is held.
func (src *Source) model(st state) (registry.Model, origin) {
	m := registry.Model{
		TrustDomain: src.cfg.TrustDomain, RootNamespace: src.cfg.RootNamespace,
		DomainSuffix: src.cfg.DomainSuffix,
	}
	var o origin
	names := sortedKeys(st.addrs)
	wnames := make([]string, 0, len(names))
	for _, n := range names {
		if e := st.addrs[n]; e.w != nil {
			wnames = append(wnames, n)
		}
	}
	sort.SliceStable(wnames, func(i, j int) bool {
		return st.addrs[wnames[i]].w.pod && !st.addrs[wnames[j]].w.pod
	})
	type member struct {
		ref   registry.WorkloadRef
		ports []portPair
	}
	members := make(map[string][]member, len(names)-len(wnames))
	for _, n := range wnames {
		e := st.addrs[n]
		w := e.w.w
		ref := registry.WorkloadRef{Namespace: w.Namespace, Name: w.Name}
		local := w.Node != "" && w.Node == src.cfg.Node.NodeName
		if !w.InMesh && local && src.enrolled[ref] {
			c := *w
			c.InMesh = true
			w = &c
		}
		if ps := src.probes[ref]; local && len(ps) > 0 && !slices.Equal(w.ProbePorts, ps) {
			c := *w
			c.ProbePorts = slices.Clone(ps)
			w = &c
		}
		if w.Refused != "" && (!local || !w.InMesh) {
			continue // not this node's to capture: left out, as NACKed
		}
		m.Workloads = append(m.Workloads, w)
		o.workloads = append(o.workloads, n)
		for _, ms := range e.w.services {
			members[ms.key] = append(members[ms.key], member{ref: ref, ports: ms.ports})
		}
	}
	seen := make(map[registry.WorkloadRef]bool, len(names)-len(wnames))
	for _, n := range names {
		e := st.addrs[n]
		if e.s == nil {
			continue
		}
		svc := *e.s.s
		if ref := (registry.WorkloadRef{Namespace: svc.Namespace, Name: svc.Name}); seen[ref] {
			svc.Name = svc.Hostname // two services of one name (a ServiceEntry's hosts)
		}
		seen[registry.WorkloadRef{Namespace: svc.Namespace, Name: svc.Name}] = true
		mbs := members[e.s.key]
		svc.Workloads = make([]registry.WorkloadRef, 0, len(mbs))
		for _, mb := range mbs {
			svc.Workloads = append(svc.Workloads, mb.ref)
		}
		sort.Slice(svc.Workloads, func(i, j int) bool { return svc.Workloads[i].String() < svc.Workloads[j].String() })
		if len(e.s.unknownTarget) > 0 {
			svc.Ports = append([]registry.ServicePort(nil), svc.Ports...)
			for i := range svc.Ports {
				p := &svc.Ports[i]
				if !e.s.unknownTarget[p.Port] {
					continue
				}
				// A named targetPort: the endpoints know the number (the
				// first endpoint that does wins).
			endpoints:
				for _, mb := range mbs {
					for _, pp := range mb.ports {
						if pp.service == uint32(p.Port) && pp.target != 0 && pp.target <= 65535 {
							p.TargetPort = uint16(pp.target)
							break endpoints
						}
					}
				}
			}
		}
		m.Services = append(m.Services, &svc)
		o.services = append(o.services, n)
	}
	m.Policies = append(m.Policies, src.cfg.Policies...)
	for _, n := range sortedKeys(st.authz) {
		if p := st.authz[n].p; p != nil {
			m.Policies = append(m.Policies, p)
		}
	}
	return m, o
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
