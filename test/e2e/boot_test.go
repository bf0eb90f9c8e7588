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

	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/mesh/node"
)

// TestBootWithoutCA: a node started while its certificate service is
// unreachable (a reboot during a CA outage) installs its capture anyway
// and keeps running: its STRICT pod refuses plaintext from a pod outside
// the mesh (the capture of the node-to-node link shows the plaintext never
// got through), its workloads, which hold no certificate, are blocked for
// mesh connections both ways (outbound reset, inbound HBONE refused) and
// reported (metric, readiness, /config_dump); once the service is back
// the node gets the certificates in the background and carries mesh
// traffic. Before, the node exited at start with no rule installed, and
// its pods ran uncaptured.
func TestBootWithoutCA(t *testing.T) {
	mc := newMeshCluster(t, "boot")
	cfg := writeConfig(t, mc.c, noderun.Mesh{Pods: map[string]noderun.Pod{
		"n1p3": {Outside: true}, "n2p2": {Outside: true}, "n2p3": {Strict: true},
	}})
	startWithConfig(t, mc.n1, cfg)
	// n2's node credential is issued offline; then the service goes away.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := noderun.IssueNodeCredential(ctx, meshtunBin, cfg, mc.n2); err != nil {
		t.Fatal(err)
	}
	ca := startCA(t, mc.c, cfg)
	if err := ca.Stop(syscall.SIGTERM); err != nil {
		t.Fatalf("stop meshtun ca: %v", err)
	}
	sn := mc.capture(t, 7680)
	serve(t, mc.p22, 7690, func(c net.Conn) { io.Copy(io.Discard, c) }) // wireCheck's control

	m2 := startWithConfig(t, mc.n2, cfg) // fails here before: the node exits
	ready := waitNodeLog(t, m2, 0, 5*time.Second, node.ReadyMessage)
	if n := ready.Num("workloads_without_certificate"); n != 2 {
		t.Errorf("ready line says %v workloads without certificate, want 2 (n2p1, n2p3)", n)
	}

	strict := serve(t, mc.p23, 7601, func(c net.Conn) { io.Copy(c, c) })
	t.Log("plaintext from outside the mesh to the STRICT pod of the node without certificates")
	marker := []byte(fmt.Sprintf("MESHTUN-SECRET-%d-boot", time.Now().UnixNano()))
	if c, err := tryDial(mc.p13.NS, netip.AddrPortFrom(mc.p23.IPv4, 7601), marker); err == nil {
		c.Close()
		t.Errorf("n1p3 (outside the mesh) connected in plaintext to STRICT n2p3 while n2 has no certificate")
	}
	wireCheck(t, sn, mc, marker, "plaintext to the STRICT pod")
	if n := len(strict.peers); n != 0 {
		t.Errorf("the STRICT server accepted %d connections", n)
	}

	t.Log("mesh connections of the workloads without certificate")
	if err := pingMesh(t, mc.p11, mc.p23, 7602); err == nil {
		t.Error("n1p1 → n2p3 (no certificate) through the mesh succeeded; want its inbound HBONE refused")
	}
	mark := m2.Len()
	if err := pingMesh(t, mc.p21, mc.p11, 7603); err == nil {
		t.Error("n2p1 (no certificate) → n1p1 through the mesh succeeded; want it reset")
	}
	lctx, lcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer lcancel()
	if _, err := m2.WaitLogSince(lctx, mark, func(l noderun.Line) bool {
		return l.Str("message") == "connection refused" && l.Str("src.addr") != "" &&
			strings.Contains(l.Str("error"), "has no certificate")
	}); err != nil {
		t.Errorf("no access-log refusal saying n2p1 has no certificate: %v", err)
	}
	if v := value(scrape(t, mc.n2), node.WorkloadsBlockedMetric, map[string]string{"reason": node.BlockedReasonNoCertificate}); v != 2 {
		t.Errorf("%s{reason=%q} = %v, want 2", node.WorkloadsBlockedMetric, node.BlockedReasonNoCertificate, v)
	}
	if code, body := httpGet(t, mc.n2.NS, "http://127.0.0.1:15021/healthz/ready"); code != 503 || !strings.Contains(body, "no certificate") {
		t.Errorf("readiness of n2 without certificates: %d %q, want 503 saying so", code, body)
	}
	if code, body := httpGet(t, mc.n2.NS, "http://127.0.0.1:15000/config_dump"); code != 200 || !strings.Contains(body, `"blocked": "no-certificate"`) || !strings.Contains(body, `"missingCertificates": [`) {
		t.Errorf("/config_dump of n2 does not show the missing certificates: %d\n%s", code, body)
	}

	t.Log("the certificate service comes back")
	mark = m2.Len()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel2()
	ca2, err := noderun.StartCA(ctx2, meshtunBin, mc.c, cfg, "--log-level", "debug")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("restarted meshtun ca log:\n%s", ca2.Logs())
		}
	})
	back := time.Now()
	for _, p := range []string{"n2p1", "n2p3"} {
		wctx, wcancel := context.WithTimeout(context.Background(), 2*node.CertRetryMax+node.CertAttemptTimeout)
		_, err := m2.WaitLogSince(wctx, mark, func(l noderun.Line) bool {
			return l.Str("identity") == id(p) && l.Str("message") == "certificate issued for a local workload: its mesh connections are no longer blocked"
		})
		wcancel()
		if err != nil {
			t.Fatalf("%s got no certificate after the service came back: %v", p, err)
		}
	}
	t.Logf("certificates issued %s after the service came back", time.Since(back).Round(time.Millisecond))
	if err := pingMesh(t, mc.p11, mc.p23, 7604); err != nil {
		t.Errorf("n1p1 → n2p3 once certified: %v", err)
	}
	if err := pingMesh(t, mc.p21, mc.p11, 7605); err != nil {
		t.Errorf("n2p1 → n1p1 once certified: %v", err)
	}
	if v := value(scrape(t, mc.n2), node.WorkloadsBlockedMetric, map[string]string{"reason": node.BlockedReasonNoCertificate}); v != 0 {
		t.Errorf("%s = %v once certified, want 0", node.WorkloadsBlockedMetric, v)
	}
	if code, body := httpGet(t, mc.n2.NS, "http://127.0.0.1:15021/healthz/ready"); code != 200 {
		t.Errorf("readiness of n2 once certified: %d %q", code, body)
	}
	// Still refused in plaintext, now that everything is certified.
	marker2 := []byte(fmt.Sprintf("MESHTUN-SECRET-%d-boot-after", time.Now().UnixNano()))
	if c, err := tryDial(mc.p13.NS, netip.AddrPortFrom(mc.p23.IPv4, 7601), marker2); err == nil {
		c.Close()
		t.Errorf("n1p3 connected in plaintext to STRICT n2p3")
	}
	wireCheck(t, sn, mc, marker2, "plaintext to the STRICT pod, certified")
}
