package e2e

import (
	"context"
	"io"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
)

// TestPodJoinsAndLeaves: a pod added to the mesh by a config change is
// captured from then on (its connections travel through HBONE), and a pod
// removed is released, without restarting the node.
func TestPodJoinsAndLeaves(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "life", Nodes: 2, PodsPerNode: 2, NoExternal: true, Control: true})
	n1, n2 := c.Nodes[0], c.Nodes[1]
	pod, srv := n1.Pods[1], n2.Pods[0]
	outside := noderun.Mesh{Pods: map[string]noderun.Pod{pod.ID: {Outside: true}}}
	cfg := writeConfig(t, c, outside)
	m1 := startWithConfig(t, n1, cfg)
	startWithConfig(t, n2, cfg)
	serve(t, srv, 7500, func(c net.Conn) { io.Copy(c, c) })

	captured := func() bool {
		rules, err := n1.IPRules(unix.AF_INET)
		if err != nil {
			t.Fatal(err)
		}
		return slices.ContainsFunc(rules, func(r string) bool {
			return strings.Contains(r, "to "+pod.IPv4.String()+"/32") || strings.Contains(r, "iif "+pod.HostLink+" ")
		})
	}
	reload := func(m noderun.Mesh) {
		t.Helper()
		mark := m1.Len()
		writeConfig(t, c, m)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := m1.WaitLogSince(ctx, mark, func(l noderun.Line) bool { return l.Str("message") == "mesh model updated" }); err != nil {
			t.Fatalf("node 1 did not reload: %v", err)
		}
	}

	if captured() {
		t.Fatalf("a pod outside the mesh is captured")
	}
	reload(noderun.Mesh{})
	if !captured() {
		t.Fatalf("after the pod joined the mesh, node 1 has no capture rule for it")
	}
	// Its certificate may come after the reload (the CA follows the same
	// file, and may read it later): blocked until then.
	waitCertified(t, n1)
	cl := dial(t, pod.NS, srv.IPv4, 7500)
	echo(t, cl)
	cl.Close()
	wantFields(t, accessLog(t, m1, cl, "connection complete"), "route", "hbone", "src.identity", id(pod.ID))

	reload(outside)
	if captured() {
		t.Fatalf("after the pod left the mesh, node 1 still captures it")
	}
	cl = dial(t, pod.NS, srv.IPv4, 7500)
	echo(t, cl)
}
