package istio_test

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/meshtun/meshtun/test/kind"
)

// vipServiceEntryYAML: a ServiceEntry with a VIP no network routes
// (240.240.0.0/16 is reserved), port 9090 to the echo server's 8080,
// selecting the mesh server pod: only a node proxy that models the VIP
// can carry a connection to it.
const vipServiceEntryYAML = `apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: echo-vip, namespace: {{NS}}}
spec:
  hosts: [{{HOST}}]
  addresses: [{{VIP}}]
  ports:
    - {number: 9090, name: tcp-echo, protocol: TCP, targetPort: 8080}
  location: MESH_INTERNAL
  resolution: STATIC
  workloadSelector:
    labels: {app: server}
`

// workloadEntryYAML: a WorkloadEntry that claims the mesh server pod's
// address under another service account (istio#54338: istiod sends it
// as a workload beside the pod).
const workloadEntryYAML = `apiVersion: networking.istio.io/v1
kind: WorkloadEntry
metadata: {name: impostor, namespace: {{NS}}}
spec:
  address: {{ADDR}}
  serviceAccount: impostor
  labels: {app: impostor}
`

// TestServiceEntries: Istio's ServiceEntry and WorkloadEntry as istiod
// sends them to meshtun:
//
//   - a ServiceEntry with a VIP selecting the mesh server: the far client
//     reaches it through the VIP and its port 9090 (to the server's 8080)
//     over HBONE, with both identities on the server's node and the
//     marker never on the kind network;
//   - a WorkloadEntry on the server pod's address under another service
//     account: the pod keeps its address and identity (a connection to it
//     still verifies the server's SPIFFE id, none names the impostor's),
//     and the nodes keep taking istiod's changes (a pod created after it
//     is reached with both identities).
func TestServiceEntries(t *testing.T) {
	ctx := context.Background()
	w := workloads(t)
	redirected(t, w.server)
	redirected(t, w.far)
	run := randHex(3)
	vip := netip.MustParseAddr(fmt.Sprintf("240.240.%d.10", 1+int(run[0])%200))
	markers := map[string]string{}
	for _, c := range []string{"vip", "workloadentry", "after"} {
		markers[c] = "MESHTUN-SE-" + run + "-" + c
	}
	all := make([]string, 0, len(markers))
	for _, m := range markers {
		all = append(all, m)
	}
	capture, err := kind.StartCapture(cl.Bridge, all...)
	if err != nil {
		t.Fatal(err)
	}
	defer capture.Stop()
	notOnWire := func(t *testing.T, c string) {
		t.Helper()
		if n := capture.Seen(markers[c]); n != 0 {
			t.Errorf("marker %s seen %d times in plaintext on the kind network", markers[c], n)
		}
	}
	apply := func(t *testing.T, tmpl string, r *strings.Replacer) {
		t.Helper()
		if _, err := cl.KubectlIn(ctx, r.Replace(tmpl), "apply", "-f", "-"); err != nil {
			t.Fatal(err)
		}
	}
	server := w.server.ip(false)

	t.Run("vip", func(t *testing.T) {
		host := "echo-vip-" + run + ".example"
		apply(t, vipServiceEntryYAML, strings.NewReplacer("{{NS}}", w.mesh, "{{HOST}}", host, "{{VIP}}", vip.String()))
		defer cl.Kubectl(ctx, "-n", w.mesh, "delete", "serviceentry", "echo-vip", "--ignore-not-found")
		before := countAccess(t, w.serverNode, w.far.ip(false), w.far.id(), w.server.id())
		eventually(t, w.far, netip.AddrPortFrom(vip, 9090), markers["vip"])
		waitMoreAccess(t, w.serverNode, w.far.ip(false), w.far.id(), w.server.id(), before)
		notOnWire(t, "vip")
		// The node's model has it, by its name and VIP (istioctl's view).
		proxy, err := proxyPod(ctx, w.clientNode)
		if err != nil {
			t.Fatal(err)
		}
		out, err := runIstioctl(t, "ztunnel-config", "service", proxy+".istio-system")
		if err != nil {
			t.Fatal(err)
		}
		wantAll(t, "ztunnel-config service", out, "echo-vip", vip.String())
	})

	t.Run("workloadentry-on-pod-address", func(t *testing.T) {
		apply(t, workloadEntryYAML, strings.NewReplacer("{{NS}}", w.mesh, "{{ADDR}}", server.String()))
		defer cl.Kubectl(ctx, "-n", w.mesh, "delete", "workloadentry", "impostor", "--ignore-not-found")
		impostor := "spiffe://cluster.local/ns/" + w.mesh + "/sa/impostor"
		// istiod sends the WorkloadEntry beside the pod; the client's node
		// logs the conflict it resolved (the pod wins, the entry alone is
		// NACKed): what follows runs on a model that has seen the entry.
		waitConflict(t, w.clientNode, "impostor")
		before := countAccess(t, w.serverNode, w.far.ip(false), w.far.id(), w.server.id())
		eventually(t, w.far, netip.AddrPortFrom(server, 8080), markers["workloadentry"])
		waitMoreAccess(t, w.serverNode, w.far.ip(false), w.far.id(), w.server.id(), before)
		notOnWire(t, "workloadentry")
		for _, node := range []string{w.serverNode, w.clientNode} {
			recs, err := accessLog(ctx, node)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range recs {
				if r.DstIdentity == impostor || r.SrcIdentity == impostor {
					t.Errorf("node %s: an access record names the WorkloadEntry's identity: %+v", node, r)
				}
			}
		}
		// The nodes still take istiod's changes.
		ns := namespace(t, "after-we", true)
		srv := newPod(t, ns, "after", w.serverNode, true, false, "")
		redirected(t, srv)
		eventually(t, w.far, netip.AddrPortFrom(srv.ip(false), 8080), markers["after"])
		waitAccess(t, w.serverNode, w.far.ip(false), w.far.id(), srv.id())
		notOnWire(t, "after")
	})
}

// waitConflict waits until node's proxy logs a conflict it resolved
// among istiod's resources whose line names what.
func waitConflict(t *testing.T, node, what string) {
	t.Helper()
	ctx := context.Background()
	proxy, err := proxyPod(ctx, node)
	if err != nil {
		t.Fatal(err)
	}
	if err := waitFor(ctx, 90*time.Second, "node "+node+"'s conflict line for "+what, func() error {
		logs, err := cl.Kubectl(ctx, "-n", "istio-system", "logs", proxy)
		if err != nil {
			return err
		}
		for _, l := range strings.Split(string(logs), "\n") {
			if strings.Contains(l, "istiod's resources conflict") && strings.Contains(l, what) {
				t.Logf("node %s: %s", node, l)
				return nil
			}
		}
		return fmt.Errorf("not logged yet")
	}); err != nil {
		t.Fatal(err)
	}
}

// countAccess is how many inbound records node's access log has from src
// with both identities.
func countAccess(t *testing.T, node string, src netip.Addr, srcID, dstID string) int {
	t.Helper()
	recs, err := accessLog(context.Background(), node)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, r := range recs {
		ap, err := netip.ParseAddrPort(r.SrcAddr)
		if err == nil && ap.Addr().Unmap() == src && r.SrcIdentity == srcID && r.DstIdentity == dstID {
			n++
		}
	}
	return n
}

// waitMoreAccess waits until node's access log has more than before such
// records: the exchange just made was carried with both identities.
func waitMoreAccess(t *testing.T, node string, src netip.Addr, srcID, dstID string, before int) {
	t.Helper()
	if err := waitFor(context.Background(), time.Minute, "a new access record", func() error {
		if n := countAccess(t, node, src, srcID, dstID); n <= before {
			return fmt.Errorf("%d records from %s (%s → %s), %d before", n, src, srcID, dstID, before)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}
