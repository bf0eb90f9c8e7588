package spire

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/mesh/identity"
)

var meshtunBin, spireServer, spireAgent string

func TestMain(m *testing.M) {
	var remove func()
	var err error
	// The product's own module: its go.mod and go.sum, not this test module's.
	if meshtunBin, remove, err = noderun.Build("../.."); err != nil {
		fmt.Fprintln(os.Stderr, "spire:", err)
		os.Exit(1)
	}
	if spireServer, spireAgent, err = spireBinaries(); err != nil {
		fmt.Fprintln(os.Stderr, "spire:", err)
		os.Exit(1)
	}
	code := m.Run()
	remove()
	os.Exit(code)
}

const td = "cluster.local"

func id(pod string) string { return "spiffe://" + td + "/ns/default/sa/" + pod }

// spireServerRun is a SPIRE server on the cluster's control host.
type spireServerRun struct {
	dir, sock string
}

func (s *spireServerRun) cli(t *testing.T, args ...string) string {
	t.Helper()
	args = append(args, "-socketPath", s.sock)
	out, err := exec.Command(spireServer, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("spire-server %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// waitHealthy runs healthcheck until it succeeds: SPIRE's own readiness
// signal.
func waitHealthy(t *testing.T, bin string, sock string, what string, exited <-chan struct{}, logs func() string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := exec.Command(bin, "healthcheck", "-socketPath", sock).CombinedOutput()
		if err == nil {
			return
		}
		select {
		case <-exited:
			t.Fatalf("%s exited: %v\n%s\nlog:\n%s", what, err, out, logs())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not healthy: %v\n%s\nlog:\n%s", what, err, out, logs())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

type logBuf struct{ b strings.Builder }

func (l *logBuf) Write(p []byte) (int, error) { return l.b.Write(p) }

func startSpireServer(t *testing.T, c *cluster.Cluster, dir string) *spireServerRun {
	t.Helper()
	s := &spireServerRun{dir: dir, sock: filepath.Join(dir, "server.sock")}
	conf := fmt.Sprintf(`server {
  bind_address = "%s"
  bind_port = "8081"
  socket_path = %q
  trust_domain = %q
  data_dir = %q
  log_level = "INFO"
  default_x509_svid_ttl = "1h"
}
plugins {
  DataStore "sql" {
    plugin_data {
      database_type = "sqlite3"
      connection_string = %q
    }
  }
  NodeAttestor "join_token" {
    plugin_data {}
  }
  KeyManager "memory" {
    plugin_data {}
  }
}
`, c.Control.IPv4, s.sock, td, filepath.Join(dir, "data"), filepath.Join(dir, "data", "datastore.sqlite3"))
	path := filepath.Join(dir, "server.conf")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := c.Control.Command(context.Background(), spireServer, "run", "-config", path)
	logs := &logBuf{}
	cmd.Stdout, cmd.Stderr = logs, logs
	proc, err := c.Control.Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	waitHealthy(t, spireServer, s.sock, "spire-server", proc.Done(), logs.b.String)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("spire-server log:\n%s", logs.b.String())
		}
	})
	return s
}

var tokenRE = regexp.MustCompile(`Token: ([0-9a-f-]+)`)

// startSpireAgent registers node n (join token, the node proxy's own entry,
// one entry per pod with k8s selectors) and starts its agent in n's
// namespace. It returns the agent's admin socket.
func startSpireAgent(t *testing.T, c *cluster.Cluster, s *spireServerRun, n *cluster.Node) string {
	t.Helper()
	name := noderun.NodeName(n)
	agentID := fmt.Sprintf("spiffe://%s/meshtun/agent/%s", td, name)
	nodeID := fmt.Sprintf("spiffe://%s/meshtun/node/%s", td, name)
	m := tokenRE.FindStringSubmatch(s.cli(t, "token", "generate", "-spiffeID", agentID, "-ttl", "600"))
	if m == nil {
		t.Fatalf("no join token in spire-server output")
	}
	// The node proxy runs as root: on this node's agent, uid 0 is the
	// node proxy, the one delegate the agent serves.
	s.cli(t, "entry", "create", "-parentID", agentID, "-spiffeID", nodeID, "-selector", "unix:uid:0")
	for _, p := range n.Pods {
		s.cli(t, "entry", "create", "-parentID", agentID, "-spiffeID", id(p.ID),
			"-selector", "k8s:ns:default", "-selector", "k8s:sa:"+p.ID)
	}
	dir := filepath.Join(s.dir, name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	// The admin socket must not share the Workload API socket's directory.
	for _, d := range []string{"admin", "api"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	admin := filepath.Join(dir, "admin", "admin.sock")
	apiSock := filepath.Join(dir, "api", "agent.sock")
	conf := fmt.Sprintf(`agent {
  data_dir = %q
  log_level = "INFO"
  server_address = "%s"
  server_port = "8081"
  socket_path = %q
  admin_socket_path = %q
  trust_domain = %q
  insecure_bootstrap = true
  authorized_delegates = [%q]
}
plugins {
  NodeAttestor "join_token" {
    plugin_data {}
  }
  KeyManager "memory" {
    plugin_data {}
  }
  WorkloadAttestor "unix" {
    plugin_data {}
  }
}
`, filepath.Join(dir, "data"), c.Control.IPv4, apiSock, admin, td, nodeID)
	path := filepath.Join(dir, "agent.conf")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := n.Command(context.Background(), spireAgent, "run", "-config", path, "-joinToken", m[1])
	logs := &logBuf{}
	cmd.Stdout, cmd.Stderr = logs, logs
	proc, err := n.Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	waitHealthy(t, spireAgent, apiSock, "spire-agent on "+name, proc.Done(), logs.b.String)
	// Healthy is not yet synced: wait until the agent serves this process
	// (root, like the node proxy) the node's own identity.
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := exec.Command(spireAgent, "api", "fetch", "x509", "-socketPath", apiSock).CombinedOutput()
		if err == nil && strings.Contains(string(out), nodeID) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("spire-agent on %s never served %s: %v\n%s\nlog:\n%s", name, nodeID, err, out, logs.b.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("spire-agent %s log:\n%s", name, logs.b.String())
		}
	})
	return admin
}

// TestSpireSource: nodes whose workload certificates come from SPIRE
// agents carry mesh traffic with those identities, and a node's agent
// gives it the identities of its own workloads only.
func TestSpireSource(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "spire", Nodes: 2, PodsPerNode: 1, NoExternal: true, Control: true})
	dir := t.TempDir()
	srv := startSpireServer(t, c, dir)
	admin := map[*cluster.Node]string{}
	for _, n := range c.Nodes {
		admin[n] = startSpireAgent(t, c, srv, n)
	}
	cfg, err := noderun.WriteConfig(c, dir, noderun.Mesh{})
	if err != nil {
		t.Fatal(err)
	}
	var nodes []*noderun.Process
	for _, n := range c.Nodes {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		p, err := noderun.Start(ctx, meshtunBin, n, "--config", cfg, "--log-level", "debug", "--spire-admin-socket", admin[n])
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		nodes = append(nodes, p)
		t.Cleanup(func() {
			p.Stop(syscall.SIGTERM)
			if t.Failed() {
				t.Logf("meshtun log of %s:\n%s", n.Name(), p.Logs())
			}
		})
	}
	n1, n2 := c.Nodes[0], c.Nodes[1]
	p1, p2 := n1.Pods[0], n2.Pods[0]

	t.Run("mesh traffic with SPIRE identities", func(t *testing.T) {
		ln, err := p2.Listen("tcp", netip.AddrPortFrom(p2.IPv4, 7001).String())
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go func() {
			c, err := ln.Accept()
			if err == nil {
				io.Copy(c, c)
				c.Close()
			}
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn, err := p1.Dial(ctx, "tcp", netip.AddrPortFrom(p2.IPv4, 7001).String())
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		msg := []byte("through the mesh, on SPIRE identities")
		conn.Write(msg)
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(conn, got); err != nil || string(got) != string(msg) {
			t.Fatalf("echo: %q, %v", got, err)
		}
		conn.Close()
		l, err := nodes[1].WaitLog(ctx, func(l noderun.Line) bool {
			return l.Str("message") == "connection complete" && l.Str("direction") == "inbound" && l.Str("dst.addr") == netip.AddrPortFrom(p2.IPv4, 7001).String()
		})
		if err != nil {
			t.Fatalf("no inbound access log on n2: %v", err)
		}
		if l.Str("src.identity") != id(p1.ID) || l.Str("route") != "hbone" {
			t.Errorf("inbound access log %v: want route hbone from %s", l, id(p1.ID))
		}
		for _, p := range nodes {
			if _, err := p.WaitLog(ctx, func(l noderun.Line) bool { return l.Str("message") == "certificates from the SPIRE agent" }); err != nil {
				t.Errorf("%s did not use the SPIRE agent: %v", p.Node.Name(), err)
			}
		}
	})

	t.Run("a node's agent serves only its own workloads", func(t *testing.T) {
		// This process runs as root, like the node proxy: on n1's agent it
		// is the delegate n1.
		sp, err := identity.DialSpire(context.Background(), identity.SpireConfig{
			AdminSocket: admin[n1], TrustDomain: spiffeid.RequireTrustDomainFromString(td), Timeout: 3 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer sp.Close()
		if svid, err := sp.Issue(context.Background(), spiffeid.RequireFromString(id(p1.ID))); err != nil || svid.ID.String() != id(p1.ID) {
			t.Fatalf("n1's agent, n1's workload: %v, %v", svid, err)
		}
		if svid, err := sp.Issue(context.Background(), spiffeid.RequireFromString(id(p2.ID))); err == nil {
			t.Fatalf("n1's agent handed out n2's workload identity %s", svid.ID)
		} else {
			t.Logf("n1 asking its agent for %s: %v", id(p2.ID), err)
		}
	})
}
