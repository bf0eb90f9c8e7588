package kube

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/meshtun/meshtun/mesh/policy"
)

// The spec of an Istio AuthorizationPolicy (security.istio.io/v1), as the
// API server stores it: decoded strictly (an unknown field is an error,
// for it may restrict what the policy matches), and converted by
// policy.FromIstio like the config file's and istiod's policies.
type apSpec struct {
	Selector *apSelector `json:"selector"`
	Action   string      `json:"action"`
	Provider *struct {
		Name string `json:"name"`
	} `json:"provider"`
	TargetRef  *apTargetRef  `json:"targetRef"`
	TargetRefs []apTargetRef `json:"targetRefs"`
	Rules      []struct {
		From []struct {
			Source apSource `json:"source"`
		} `json:"from"`
		To []struct {
			Operation apOperation `json:"operation"`
		} `json:"to"`
		When []struct {
			Key       string   `json:"key"`
			Values    []string `json:"values"`
			NotValues []string `json:"notValues"`
		} `json:"when"`
	} `json:"rules"`
}

type apSelector struct {
	MatchLabels map[string]string `json:"matchLabels"`
}

type apTargetRef struct {
	Group     string `json:"group"`
	Kind      string `json:"kind"`
	Name      string `json:"name"`
	Namespace string `json:"namespace"`
}

type apSource struct {
	Principals         []string `json:"principals"`
	NotPrincipals      []string `json:"notPrincipals"`
	Namespaces         []string `json:"namespaces"`
	NotNamespaces      []string `json:"notNamespaces"`
	ServiceAccounts    []string `json:"serviceAccounts"`
	NotServiceAccounts []string `json:"notServiceAccounts"`
	IPBlocks           []string `json:"ipBlocks"`
	NotIPBlocks        []string `json:"notIpBlocks"`
	// HTTP (L7) fields: kept by name for policy.FromIstio.
	RequestPrincipals    []string `json:"requestPrincipals"`
	NotRequestPrincipals []string `json:"notRequestPrincipals"`
	RemoteIPBlocks       []string `json:"remoteIpBlocks"`
	NotRemoteIPBlocks    []string `json:"notRemoteIpBlocks"`
}

type apOperation struct {
	Ports    []apPort `json:"ports"`
	NotPorts []apPort `json:"notPorts"`
	// HTTP (L7) fields: kept by name for policy.FromIstio.
	Hosts      []string `json:"hosts"`
	NotHosts   []string `json:"notHosts"`
	Methods    []string `json:"methods"`
	NotMethods []string `json:"notMethods"`
	Paths      []string `json:"paths"`
	NotPaths   []string `json:"notPaths"`
}

// apPort is a port as Istio writes it ("8080"), or as a number.
type apPort uint16

func (p *apPort) UnmarshalJSON(b []byte) error {
	s := string(b)
	if u, err := strconv.Unquote(s); err == nil {
		s = u
	}
	n, err := strconv.ParseUint(s, 10, 16)
	if err != nil || n == 0 {
		return fmt.Errorf("%s is not a port number (1-65535)", b)
	}
	*p = apPort(n)
	return nil
}

// l7 is an HTTP field of a source or operation.
type l7 struct {
	name string
	v    []string
}

// l7Names lists the names of the non-empty HTTP fields.
func l7Names(fs ...l7) []string {
	var out []string
	for _, f := range fs {
		if len(f.v) > 0 {
			out = append(out, f.name)
		}
	}
	return out
}

// decodeAuthorizationPolicy decodes the spec of the AuthorizationPolicy
// namespace/name into what policy.FromIstio converts.
func decodeAuthorizationPolicy(namespace, name string, spec []byte) (policy.Istio, error) {
	in := policy.Istio{Name: name, Namespace: namespace}
	var s apSpec
	dec := json.NewDecoder(bytes.NewReader(spec))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&s); err != nil {
		return in, err
	}
	if s.Selector != nil {
		in.Selector = s.Selector.MatchLabels
	}
	in.Action, in.HasProvider = s.Action, s.Provider != nil
	switch {
	case s.TargetRef != nil:
		in.TargetRef = "targetRef"
	case len(s.TargetRefs) > 0:
		in.TargetRef = "targetRefs"
	}
	for ri, r := range s.Rules {
		var pr policy.Rule
		for fi, f := range r.From {
			src := f.Source
			ps := policy.Source{
				Principals: src.Principals, NotPrincipals: src.NotPrincipals,
				Namespaces: src.Namespaces, NotNamespaces: src.NotNamespaces,
				ServiceAccounts: src.ServiceAccounts, NotServiceAccounts: src.NotServiceAccounts,
				L7: l7Names(l7{"requestPrincipals", src.RequestPrincipals}, l7{"notRequestPrincipals", src.NotRequestPrincipals},
					l7{"remoteIpBlocks", src.RemoteIPBlocks}, l7{"notRemoteIpBlocks", src.NotRemoteIPBlocks}),
			}
			var err error
			if ps.IPBlocks, err = ipBlocks(src.IPBlocks); err != nil {
				return in, fmt.Errorf("rules[%d].from[%d].source.ipBlocks: %w", ri, fi, err)
			}
			if ps.NotIPBlocks, err = ipBlocks(src.NotIPBlocks); err != nil {
				return in, fmt.Errorf("rules[%d].from[%d].source.notIpBlocks: %w", ri, fi, err)
			}
			pr.From = append(pr.From, ps)
		}
		for _, t := range r.To {
			op := t.Operation
			po := policy.Operation{
				L7: l7Names(l7{"hosts", op.Hosts}, l7{"notHosts", op.NotHosts}, l7{"methods", op.Methods},
					l7{"notMethods", op.NotMethods}, l7{"paths", op.Paths}, l7{"notPaths", op.NotPaths}),
			}
			for _, p := range op.Ports {
				po.Ports = append(po.Ports, uint16(p))
			}
			for _, p := range op.NotPorts {
				po.NotPorts = append(po.NotPorts, uint16(p))
			}
			pr.To = append(pr.To, po)
		}
		for _, w := range r.When {
			pr.When = append(pr.When, policy.Condition{Key: w.Key, Values: w.Values, NotValues: w.NotValues})
		}
		in.Rules = append(in.Rules, pr)
	}
	return in, nil
}

func ipBlocks(ss []string) ([]policy.IPBlock, error) {
	var out []policy.IPBlock
	for _, s := range ss {
		b, err := policy.ParseIPBlock(s)
		if err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, nil
}
