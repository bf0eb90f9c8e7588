package kube

import (
	"context"
	"net/netip"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
)

// TestForgedPodIPClaim (issue 22 item 8a): node 2's kubelet, compromised,
// writes into the status of its older pods the address of node 1's STRICT
// pod and of node 3's pod. Node 1 keeps its pod captured and STRICT (the
// claim of another node takes nothing from a pod its own routes lead to),
// the forger gains no identity, and the address two other nodes claim is
// denied: node 1's mesh pod that reached it in plaintext before is now
// refused, with a log line and meshtun_denied_addresses.
func TestForgedPodIPClaim(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "claim", Nodes: 3, PodsPerNode: 2})
	cp := controlPlaneT(t, c)
	ctx := context.Background()
	ms := applyDeploy(t, cp)
	dir := t.TempDir()
	cfgPath := nodeConfig(t, ms, dir, netip.AddrPortFrom(cp.Host.IPv4, caPort))
	ca := startCA(t, cp, ms, cfgPath, dir)
	installIstioCRDs(t, cp)
	kubeconfig := nodeKubeconfig(t, cp, dir)

	n1, n2, n3 := c.Nodes[0], c.Nodes[1], c.Nodes[2]
	victim, outsider, other := n1.Pods[0], n1.Pods[1], n3.Pods[0]
	k := kubelet{t: t, cs: cp.Admin}
	k.namespace("apps", true)
	k.namespace("evil", true)
	k.namespace("plain", false)
	// The forgers first: the older pods, which won every claim before.
	k.run(n2.Pods[0], "evil", "forger", "forger", nil)
	k.run(n2.Pods[1], "evil", "forger2", "forger2", nil)
	time.Sleep(1100 * time.Millisecond) // creation timestamps have 1 s resolution
	k.run(victim, "apps", "victim", "victim", map[string]string{"app": "victim"})
	k.run(outsider, "plain", "outsider", "outsider", nil)
	k.run(other, "plain", "other", "other", nil)
	echo(t, victim, 8080)
	echo(t, other, 8080)
	strict := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "security.istio.io/v1", "kind": "PeerAuthentication",
		"metadata": map[string]any{"name": "strict", "namespace": "apps"},
		"spec":     map[string]any{"mtls": map[string]any{"mode": "STRICT"}},
	}}
	par := dynamic.NewForConfigOrDie(cp.AdminConfig).Resource(schema.GroupVersionResource{
		Group: "security.istio.io", Version: "v1", Resource: "peerauthentications"}).Namespace("apps")
	if _, err := par.Create(ctx, strict, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	m, err := noderun.Start(sctx, meshtunBin, n1, "--kubernetes", "--kubeconfig", kubeconfig, "--config", cfgPath,
		"--ca-token-file", nodeToken(t, cp, n1, dir), "--ca-roots", ca.roots)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("node 1 log:\n%s", m.Logs())
		}
		m.Stop(9)
	})
	waitLog(t, m, 0, "victim captured", podLog("apps/victim", "pod in the mesh"))
	victimPrefix := netip.PrefixFrom(victim.IPv4, 32).String()
	waitRule(t, n1, victimPrefix, true)
	dst := netip.AddrPortFrom(victim.IPv4, 8080)
	toOther := netip.AddrPortFrom(other.IPv4, 8080)
	deadline := time.Now().Add(20 * time.Second)
	for roundTripMaybe(outsider, dst).IsValid() {
		if time.Now().After(deadline) {
			t.Fatal("plaintext from outside the mesh reaches the STRICT victim before any forged claim")
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Control: the victim reaches node 3's pod (outside the mesh) in
	// plaintext before its address is contested.
	roundTrip(t, victim, toOther)

	// Node 2's kubelet writes the victim's address (and node 3's pod's)
	// into its older pods' status, as it may for any pod of its node.
	mark := m.Len()
	forge := func(name string, addr netip.Addr) {
		p, err := cp.Admin.CoreV1().Pods("evil").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p.Status.PodIP = addr.String()
		p.Status.PodIPs = []corev1.PodIP{{IP: addr.String()}}
		if _, err := cp.Admin.CoreV1().Pods("evil").UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	forge("forger", victim.IPv4)
	forge("forger2", other.IPv4)
	conflict := func(a netip.Addr) func(noderun.Line) bool {
		return func(l noderun.Line) bool {
			return l.Str("message") == "pods claim the same address" && l.Str("address") == a.String()
		}
	}
	t.Log(waitLog(t, m, mark, "the forged claim on the victim's address", conflict(victim.IPv4)))
	t.Log(waitLog(t, m, mark, "the address claimed by two other nodes", conflict(other.IPv4)))

	// The victim is still captured and STRICT, under its own identity.
	if !ruleFor(t, n1, victimPrefix) {
		t.Error("the victim's capture rule is gone after the forged claim")
	}
	if src := roundTripMaybe(outsider, dst); src.IsValid() {
		t.Errorf("plaintext from %s reaches the STRICT victim after the forged claim", src)
	}
	var dump struct {
		Workloads []struct {
			Name, Namespace, Node, Identity, Refused string
			Addresses                                []netip.Addr
		}
		Source struct {
			LocalPods []struct {
				Pod  string
				Mesh bool
			}
		}
	}
	getJSON(t, n1, "http://127.0.0.1:15000/config_dump", &dump)
	byAddr := map[netip.Addr]string{}
	for _, w := range dump.Workloads {
		for _, a := range w.Addresses {
			byAddr[a] = w.Namespace + "/" + w.Name + " " + w.Node + " " + w.Identity + " " + w.Refused
		}
		if w.Namespace == "evil" {
			t.Errorf("forger %s/%s is in node 1's model (identity %s)", w.Namespace, w.Name, w.Identity)
		}
	}
	if got, want := byAddr[victim.IPv4], "apps/victim "+noderun.NodeName(n1)+" "+spiffe("apps", "victim")+" "; got != want {
		t.Errorf("node 1's model: %s is %q, want %q", victim.IPv4, got, want)
	}
	if got := byAddr[other.IPv4]; got == "" || got[len(got)-len("address_conflict"):] != "address_conflict" {
		t.Errorf("node 1's model: %s is %q, want a denied address", other.IPv4, got)
	}
	for _, p := range dump.Source.LocalPods {
		if p.Pod == "apps/victim" && !p.Mesh {
			t.Error("config_dump: the victim is no longer in the mesh")
		}
	}
	// The contested address of two other nodes fails closed: the victim
	// (a mesh pod) that reached it in plaintext is now refused.
	if src := roundTripMaybe(victim, toOther); src.IsValid() {
		t.Errorf("the victim still reaches %s, which pods of two other nodes claim", toOther)
	}
	// The access line is written as the connection is reset, which may
	// be after the client sees the reset: wait for it.
	waitLog(t, m, 0, "the access line denying the connection to the contested address", func(l noderun.Line) bool {
		return l.Str("log") == "access" && l.Str("dst.addr") == toOther.String() && l.Str("response_flags") == "DENY"
	})
}
