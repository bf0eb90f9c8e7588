package kube

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/meshtun/meshtun/mesh/registry"
)

// RefusedAddressConflict is the registry.Workload.Refused reason of an
// address that pods of different nodes claim and that no pod of this
// node verifiably holds: captured if local, every connection to and from
// it denied.
const RefusedAddressConflict = "address_conflict"

// deniedServiceAccount is the service account of the workload that stands
// for a denied address: not a valid Kubernetes name (upper case), so no
// pod has it and the CA issues no certificate for it.
const deniedServiceAccount = "Denied-Address"

// claimant is a pod and the workload it would be, before address claims
// are settled.
type claimant struct {
	p      *corev1.Pod
	key    string // namespace/name
	local  bool   // a pod of this node (not hostNetwork)
	w      *registry.Workload
	reason string // why w is nil (or refused)
}

// resolveClaims settles the addresses that more than one pod claims in
// status.podIPs (cs ordered oldest first). A pod's IPs are written by the
// kubelet of its node, and a compromised kubelet can write any address
// into an older pod's status: so one node's word never takes an address
// from a pod of another node.
//
//   - Pods of one node: the oldest keeps it (an address reused while the
//     pod that had it terminates), the newer pods wait, as everywhere.
//   - Pods of different nodes, one of them this node's (and, with
//     Config.LocalAddress, routed to a pod link here): this node's pod
//     keeps it, with its capture and policies; the remote claimants are
//     left out of the model (no identity at all).
//   - Pods of different nodes, none of them verifiably this node's: the
//     address is denied. Every claimant is left out, a local claimant
//     stays captured but refused (every connection denied), and a
//     workload that stands for the address (refused, of no node) makes
//     connections to it fail closed instead of going out in plaintext or
//     to either claimant's identity.
//
// A pod that loses any of its addresses is left out whole (as
// registry.Resolve does). It returns the workloads standing for denied
// addresses, and a line per contested address for the log.
func (s *Source) resolveClaims(cs []claimant) (denied []*registry.Workload, conflicts map[netip.Addr]string) {
	by := map[netip.Addr][]int{}
	var contested []netip.Addr
	for i, c := range cs {
		if c.w == nil {
			continue
		}
		for _, a := range c.w.Addresses {
			by[a] = append(by[a], i)
			if len(by[a]) == 2 {
				contested = append(contested, a)
			}
		}
	}
	if len(contested) == 0 {
		return nil, nil
	}
	slices.SortFunc(contested, netip.Addr.Compare)
	conflicts = make(map[netip.Addr]string, len(contested))
	lost := map[int]string{}
	refused := map[int]string{}
	for _, a := range contested {
		ids := by[a]
		nodes := map[string]bool{}
		var locals []int
		for _, i := range ids {
			nodes[cs[i].p.Spec.NodeName] = true
			if cs[i].local {
				locals = append(locals, i)
			}
		}
		names := claimants(cs, ids)
		switch {
		case len(nodes) == 1:
			for _, i := range ids[1:] {
				lost[i] = fmt.Sprintf("address %s still belongs to pod %s", a, cs[ids[0]].key)
			}
			conflicts[a] = fmt.Sprintf("address %s claimed by %s (one node): the oldest keeps it", a, names)
		case len(locals) > 0 && (s.cfg.LocalAddress == nil || s.cfg.LocalAddress(a)):
			win := locals[0]
			for _, i := range ids {
				switch {
				case i == win:
				case cs[i].local:
					lost[i] = fmt.Sprintf("address %s still belongs to pod %s", a, cs[win].key)
				default:
					lost[i] = fmt.Sprintf("address %s is this node's pod %s's; the claim of node %s is not trusted", a, cs[win].key, cs[i].p.Spec.NodeName)
				}
			}
			conflicts[a] = fmt.Sprintf("address %s claimed by %s: this node's pod %s keeps it, the other claims are left out", a, names, cs[win].key)
		default:
			why := fmt.Sprintf("address %s is claimed by pods of different nodes (%s): denied", a, names)
			for _, i := range ids {
				lost[i] = why
			}
			if len(locals) > 0 {
				// Captured, and refused: never left open.
				refused[locals[0]] = why
				delete(lost, locals[0])
				for _, i := range locals[1:] {
					lost[i] = fmt.Sprintf("address %s still belongs to pod %s", a, cs[locals[0]].key)
				}
			} else {
				denied = append(denied, &registry.Workload{
					Name: "denied-address:" + a.String(), Namespace: s.cfg.RootNamespace,
					ServiceAccount: deniedServiceAccount, Addresses: []netip.Addr{a},
					InMesh: true, Health: registry.Unhealthy, Refused: RefusedAddressConflict,
				})
			}
			conflicts[a] = "denied: " + why
		}
	}
	for i, why := range refused {
		if _, out := lost[i]; out {
			continue
		}
		w := *cs[i].w
		w.Refused = RefusedAddressConflict
		cs[i].w, cs[i].reason = &w, why
	}
	for i, why := range lost {
		cs[i].w, cs[i].reason = nil, why
	}
	return denied, conflicts
}

// claimants names the pods ids of cs with their nodes.
func claimants(cs []claimant, ids []int) string {
	var b strings.Builder
	for n, i := range ids {
		if n > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "pod %s of node %s", cs[i].key, cs[i].p.Spec.NodeName)
	}
	return b.String()
}
