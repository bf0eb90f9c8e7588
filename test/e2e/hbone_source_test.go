package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/mesh/node"
)

// TestHBONESourceAddress: outbound HBONE leaves from the client pod's
// address, as ztunnel's does (issue 24 item 2). The server node's kernel
// socket on the pod's port 15008 has the client pod's address, and a port
// of node.HBONEClientPorts, as its peer (with the old behaviour, or with
// --hbone-source node, it is the client node's address); the replies come
// back to the client node's socket (the exchange completes, IPv4 and
// IPv6); a source-IP DENY on the client pod's address refuses it at the
// server while a second pod of the same node gets through; stopping the
// client node removes its reply rule and its exemption.
//
//	node 1: n1p1 denied client, n1p2 client
//	node 2: n2p1 server, n2p2 server an ipBlocks DENY on n1p1 protects
func TestHBONESourceAddress(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "hsrc", Nodes: 2, PodsPerNode: 2, NoExternal: true, Control: true})
	n1, n2 := c.Nodes[0], c.Nodes[1]
	denied, client, server, guarded := n1.Pods[0], n1.Pods[1], n2.Pods[0], n2.Pods[1]
	cfg := writeConfig(t, c, noderun.Mesh{
		Pods: map[string]noderun.Pod{"n2p2": {Labels: map[string]string{"app": "guarded"}}},
		Extra: fmt.Sprintf(`authorizationPolicies:
  - name: deny-n1p1-address
    namespace: default
    selector: {app: guarded}
    action: DENY
    rules: [{from: [{ipBlocks: [%s/32, "%s/128"]}]}]
`, denied.IPv4, denied.IPv6),
	})
	m2 := startWithConfig(t, n2, cfg)
	waitReady(t, m2, "pod")

	// hbonePeers returns the peers of node 2's established kernel
	// sockets on port 15008.
	hbonePeers := func(t *testing.T) []netip.AddrPort {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		out, err := n2.NS.Command(ctx, "ss", "-Htn", "state", "established", "( sport = :15008 )").CombinedOutput()
		if err != nil {
			t.Fatalf("ss in %s: %v: %s", n2.Name(), err, out)
		}
		var peers []netip.AddrPort
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			f := strings.Fields(line)
			if len(f) < 4 {
				continue
			}
			a, err := netip.ParseAddrPort(f[3])
			if err != nil {
				t.Fatalf("ss line %q: %v", line, err)
			}
			peers = append(peers, netip.AddrPortFrom(a.Addr().Unmap(), a.Port()))
		}
		return peers
	}
	// exchange opens a mesh connection from pod from to server (IPv4 and
	// IPv6), checks the echo (the replies reached node 1's socket) and
	// returns the peers node 2's HBONE sockets had meanwhile.
	exchangeFrom := func(t *testing.T, from *cluster.Pod, port int) []netip.AddrPort {
		t.Helper()
		s := serve(t, server, port, func(c net.Conn) { io.Copy(c, c) })
		defer s.ln.Close()
		var peers []netip.AddrPort
		for _, dst := range []netip.Addr{server.IPv4, server.IPv6} {
			cl := dial(t, from.NS, dst, port)
			echo(t, cl)
			peers = append(peers, hbonePeers(t)...)
			cl.Close()
		}
		return peers
	}
	has := func(peers []netip.AddrPort, a netip.Addr, ports bool) bool {
		for _, p := range peers {
			if p.Addr() == a && (!ports || p.Port() >= node.HBONEClientPorts.Lo && p.Port() <= node.HBONEClientPorts.Hi) {
				return true
			}
		}
		return false
	}

	t.Run("pod address", func(t *testing.T) {
		m1 := startWithConfig(t, n1, cfg)
		waitReady(t, m1, "pod")
		peers := exchangeFrom(t, client, 7301)
		for _, a := range []netip.Addr{client.IPv4, client.IPv6} {
			if !has(peers, a, true) {
				t.Errorf("node 2's HBONE sockets have peers %v; want the client pod's %s with a port in %s", peers, a, node.HBONEClientPorts)
			}
		}
		for _, a := range []netip.Addr{n1.IPv4, n1.IPv6} {
			if has(peers, a, false) {
				t.Errorf("node 2's HBONE sockets have the client node's %s as peer: %v", a, peers)
			}
		}

		// The DENY on n1p1's address matches at node 2; n1p2 passes.
		serve(t, guarded, 7302, func(c net.Conn) { io.Copy(c, c) })
		for _, dst := range []netip.Addr{guarded.IPv4, guarded.IPv6} {
			to := netip.AddrPortFrom(dst, 7302)
			mark := m2.Len()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			if c, err := denied.Dial(ctx, "tcp", to.String()); err == nil {
				// Over HBONE the refusal is a reset after connect.
				c.SetReadDeadline(time.Now().Add(5 * time.Second))
				if n, rerr := c.Read(make([]byte, 1)); rerr == nil || n > 0 {
					t.Errorf("%s → %s: connected and read %d bytes; want refused", denied.ID, to, n)
				}
				c.Close()
			}
			src := denied.IPv4
			if dst.Is6() {
				src = denied.IPv6
			}
			srcPrefix := strings.TrimSuffix(netip.AddrPortFrom(src, 0).String(), "0") // "a.b.c.d:" or "[a:b::c]:"
			if _, err := m2.WaitLogSince(ctx, mark, func(l noderun.Line) bool {
				return l.Str("message") == "connection refused" && l.Str("dst.addr") == to.String() &&
					strings.HasPrefix(l.Str("src.addr"), srcPrefix) &&
					strings.Contains(l.Str("error"), "deny-n1p1-address")
			}); err != nil {
				t.Errorf("node 2 logged no refusal of %s → %s by deny-n1p1-address: %v", denied.ID, to, err)
			}
			cancel()
			cl := dial(t, client.NS, dst, 7302)
			echo(t, cl)
			cl.Close()
		}

		// Stopping node 1 removes the reply rule and the exemption.
		if err := m1.stop(syscall.SIGTERM); err != nil {
			t.Errorf("node 1 exit: %v", err)
		}
		for _, fam := range []string{"-4", "-6"} {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			out, err := n1.NS.Command(ctx, "ip", fam, "rule").CombinedOutput()
			cancel()
			if err != nil {
				t.Fatalf("ip %s rule in %s: %v: %s", fam, n1.Name(), err, out)
			}
			want := fmt.Sprintf("dport %d-%d", node.HBONEClientPorts.Lo, node.HBONEClientPorts.Hi)
			if strings.Contains(string(out), want) || strings.Contains(string(out), "sport 15008") || strings.Contains(string(out), "dport 15008") {
				t.Errorf("ip %s rule in %s after the stop still has meshtun's HBONE rules:\n%s", fam, n1.Name(), out)
			}
		}
	})

	t.Run("node address", func(t *testing.T) {
		m1 := startWithConfig(t, n1, cfg, "--hbone-source", node.HBONESourceNode)
		waitReady(t, m1, "node")
		peers := exchangeFrom(t, client, 7311)
		for _, a := range []netip.Addr{n1.IPv4, n1.IPv6} {
			if !has(peers, a, false) {
				t.Errorf("with --hbone-source node, node 2's HBONE sockets have peers %v; want the client node's %s", peers, a)
			}
		}
		if has(peers, client.IPv4, false) || has(peers, client.IPv6, false) {
			t.Errorf("with --hbone-source node, node 2's HBONE sockets have the client pod as peer: %v", peers)
		}
		if err := m1.stop(syscall.SIGTERM); err != nil {
			t.Errorf("node 1 exit: %v", err)
		}
	})

	t.Run("pod address required without the kernel path", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		p, err := noderun.Start(ctx, meshtunBin, n1, "--config", cfg, "--credentials", noderun.CredentialDir(cfg, n1),
			"--hbone-source", node.HBONESourcePod, "--hbone-netstack")
		if err == nil {
			p.Stop(syscall.SIGTERM)
			t.Fatal("node 1 with --hbone-source pod --hbone-netstack became ready; want a refusal to start")
		}
		if !strings.Contains(err.Error(), "needs inbound HBONE on the kernel socket") {
			t.Errorf("node 1 with --hbone-source pod --hbone-netstack: %v; want the refusal to say why", err)
		}
	})
}

// waitReady waits for m's ready line and checks its hbone_source.
func waitReady(t *testing.T, m nodeProc, source string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := m.WaitLog(ctx, func(l noderun.Line) bool { return l.Str("message") == node.ReadyMessage })
	if err != nil {
		t.Fatal(err)
	}
	if got := l.Str("hbone_source"); got != source {
		t.Fatalf("%s dials outbound HBONE from the %q address, want %q", m.Node.Name(), got, source)
	}
}
