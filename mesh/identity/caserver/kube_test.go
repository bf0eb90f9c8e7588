package caserver

import (
	"context"
	"errors"
	"strings"
	"testing"

	"google.golang.org/grpc/metadata"
)

type fakeReviewer map[string]*TokenReview

func (f fakeReviewer) Review(_ context.Context, token string, aud []string) (*TokenReview, error) {
	if r, ok := f[token]; ok {
		return r, nil
	}
	return &TokenReview{Error: "invalid bearer token"}, nil
}

type fakePods []Pod

func (f fakePods) Get(_ context.Context, ns, name string) (*Pod, error) {
	for _, p := range f {
		if p.Namespace == ns && p.Name == name {
			return &p, nil
		}
	}
	return nil, errors.New("pod not found")
}

func (f fakePods) OnNode(_ context.Context, node string) ([]Pod, error) {
	var out []Pod
	for _, p := range f {
		if p.Node == node {
			out = append(out, p)
		}
	}
	return out, nil
}

func bearer(tok string) context.Context {
	return metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer "+tok))
}

func TestKubeMode(t *testing.T) {
	sa := func(ns, name, pod, uid string, aud ...string) *TokenReview {
		return &TokenReview{Authenticated: true, Username: "system:serviceaccount:" + ns + ":" + name, Audiences: aud,
			Extra: map[string][]string{ExtraPodName: {pod}, ExtraPodUID: {uid}}}
	}
	k := &KubeMode{
		TrustDomain: td, Audience: "meshtun-ca", NodeAccounts: []string{"meshtun-system/meshtun-node"},
		Reviewer: fakeReviewer{
			"node1":    sa("meshtun-system", "meshtun-node", "meshtun-node-abc", "u1", "meshtun-ca"),
			"otheraud": sa("meshtun-system", "meshtun-node", "meshtun-node-abc", "u1", "kubernetes"),
			"notnode":  sa("default", "a", "a-1", "u3", "meshtun-ca"),
			"stale":    sa("meshtun-system", "meshtun-node", "meshtun-node-abc", "u-old", "meshtun-ca"),
			"othernode": {Authenticated: true, Username: "system:serviceaccount:meshtun-system:meshtun-node", Audiences: []string{"meshtun-ca"},
				Extra: map[string][]string{ExtraPodName: {"meshtun-node-abc"}, ExtraPodUID: {"u1"}, ExtraNodeName: {"k2"}}},
			"unbound": {Authenticated: true, Username: "system:serviceaccount:meshtun-system:meshtun-node", Audiences: []string{"meshtun-ca"}},
		},
		Pods: fakePods{
			{Namespace: "meshtun-system", Name: "meshtun-node-abc", UID: "u1", ServiceAccount: "meshtun-node", Node: "k1", Running: true},
			{Namespace: "default", Name: "a-1", UID: "u3", ServiceAccount: "a", Node: "k1", Running: true},
			{Namespace: "default", Name: "b-1", ServiceAccount: "b", Node: "k2", Running: true},
			{Namespace: "default", Name: "done-1", ServiceAccount: "done", Node: "k1", Running: false},
		},
	}
	c, err := k.Authenticate(bearer("node1"))
	if err != nil || c.Node != "k1" {
		t.Fatalf("node token: %+v, %v; want node k1", c, err)
	}
	if err := k.Authorize(context.Background(), c, wid("default", "a")); err != nil {
		t.Errorf("pod a on k1: %v", err)
	}
	for id, want := range map[string]string{
		"b":    "no running pod of namespace default with service account b is on node k1",
		"done": "no running pod",
	} {
		if err := k.Authorize(context.Background(), c, wid("default", id)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s from k1: %v, want %q", id, err, want)
		}
	}
	if _, err := k.Authenticate(context.Background()); !errors.Is(err, ErrNoCredential) {
		t.Errorf("no token: %v, want ErrNoCredential", err)
	}
	for tok, want := range map[string]string{
		"bogus":     "token not authenticated: invalid bearer token",
		"otheraud":  `not for audience "meshtun-ca"`,
		"notnode":   "service account default/a is not a node account",
		"stale":     "is gone",
		"unbound":   "not bound to a pod",
		"othernode": "token names node k2, but pod meshtun-system/meshtun-node-abc is on node k1",
	} {
		if _, err := k.Authenticate(bearer(tok)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("token %s: %v, want %q", tok, err, want)
		}
	}
}
