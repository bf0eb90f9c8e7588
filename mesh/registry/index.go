package registry

import (
	"fmt"
	"slices"

	"github.com/meshtun/meshtun/mesh/policy"
)

// policyIndex finds the policies that apply to a workload without testing
// every policy: policies are grouped by namespace (the root namespace's
// apply everywhere), and within a namespace those with a selector are
// filed under one label of their selector, so only policies sharing a
// label with the workload are tested.
type policyIndex struct {
	root    string
	byNS    map[string]*nsPolicies
	ordinal map[*policy.Policy]int // position in the model, to keep its order
}

type label struct{ k, v string }

type nsPolicies struct {
	all     []*policy.Policy // no selector: every workload of the scope
	byLabel map[label][]*policy.Policy
}

func newPolicyIndex(root string, ps []*policy.Policy) (*policyIndex, error) {
	idx := &policyIndex{root: root, byNS: make(map[string]*nsPolicies), ordinal: make(map[*policy.Policy]int, len(ps))}
	for i, p := range ps {
		if p == nil || !p.Built() {
			return nil, fmt.Errorf("registry: policy %d was not built by policy.New", i)
		}
		if _, dup := idx.ordinal[p]; dup {
			return nil, fmt.Errorf("registry: policy %s listed twice", p.ID())
		}
		idx.ordinal[p] = i
		n := idx.byNS[p.Namespace]
		if n == nil {
			n = &nsPolicies{byLabel: make(map[label][]*policy.Policy)}
			idx.byNS[p.Namespace] = n
		}
		if len(p.Selector) == 0 {
			n.all = append(n.all, p)
			continue
		}
		// File it under its smallest key, so the choice is stable.
		var k string
		first := true
		for key := range p.Selector {
			if first || key < k {
				k, first = key, false
			}
		}
		l := label{k, p.Selector[k]}
		n.byLabel[l] = append(n.byLabel[l], p)
	}
	return idx, nil
}

// forWorkload returns the policies that apply to a workload of namespace
// ns with labels, in model order.
func (idx *policyIndex) forWorkload(ns string, labels map[string]string) []*policy.Policy {
	var out []*policy.Policy
	collect := func(n *nsPolicies) {
		if n == nil {
			return
		}
		out = append(out, n.all...)
		if len(n.byLabel) == 0 {
			return
		}
		for k, v := range labels {
			for _, p := range n.byLabel[label{k, v}] {
				if policy.SelectorMatches(p.Selector, labels) {
					out = append(out, p)
				}
			}
		}
	}
	collect(idx.byNS[idx.root])
	if ns != idx.root {
		collect(idx.byNS[ns])
	}
	if len(out) > 1 {
		slices.SortFunc(out, func(a, b *policy.Policy) int { return idx.ordinal[a] - idx.ordinal[b] })
	}
	return out
}
