package noderun

import (
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/mesh/config"
	"github.com/meshtun/meshtun/mesh/identity"
)

// testCluster is a cluster value (no namespaces) of two nodes with a pod
// each and a control host, enough for the config writers.
func testCluster() *cluster.Cluster {
	c := &cluster.Cluster{Name: "t", Control: &cluster.Host{IPv4: netip.MustParseAddr("198.18.0.100")}}
	for i := 1; i <= 2; i++ {
		n := &cluster.Node{Index: i, Uplink: "eth0"}
		n.Pods = []*cluster.Pod{{ID: "n" + string(rune('0'+i)) + "p1", Index: 1, Node: n,
			IPv4: netip.AddrFrom4([4]byte{10, 0, byte(i), 2}), IPv6: netip.MustParseAddr("fd00::" + string(rune('0'+i)) + ":2"),
			HostLink: "veth" + string(rune('0'+i))}}
		c.Nodes = append(c.Nodes, n)
	}
	return c
}

// TestNodeConfigLeavesOutTheCADirectory: the nodes' config names no
// directory holding the CA's root key (the file of `meshtun ca` does), and
// describes the same mesh.
func TestNodeConfigLeavesOutTheCADirectory(t *testing.T) {
	dir := t.TempDir()
	c := testCluster()
	caDir := filepath.Join(dir, "ca")
	if err := os.MkdirAll(caDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(caDir, identity.RootKeyFile), []byte("key"), 0o600); err != nil {
		t.Fatal(err)
	}
	caPath, err := WriteConfig(c, dir, Mesh{})
	if err != nil {
		t.Fatal(err)
	}
	nodePath, err := WriteNodeConfig(c, dir, Mesh{})
	if err != nil {
		t.Fatal(err)
	}
	if nodePath == caPath {
		t.Fatalf("WriteNodeConfig wrote %s, the file of meshtun ca", nodePath)
	}
	caCfg, err := config.Load(caPath)
	if err != nil {
		t.Fatal(err)
	}
	if caCfg.CA.Dir != caDir {
		t.Errorf("meshtun ca's config: ca.dir %q, want %q", caCfg.CA.Dir, caDir)
	}
	nodeCfg, err := config.Load(nodePath)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(nodeCfg.CA.Dir, identity.RootKeyFile)); err == nil {
		t.Errorf("the nodes' config has ca.dir %s, which holds the CA's root key", nodeCfg.CA.Dir)
	}
	data, err := os.ReadFile(nodePath)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(data), caDir) {
		t.Errorf("the nodes' config names the CA's directory %s:\n%s", caDir, data)
	}
	if nodeCfg.CA.Address != caCfg.CA.Address || nodeCfg.CA.Address == "" {
		t.Errorf("ca.address: nodes %q, meshtun ca %q; want the same, not empty", nodeCfg.CA.Address, caCfg.CA.Address)
	}
	if nodeCfg.Sum() == caCfg.Sum() {
		t.Error("the two configs have the same content")
	}
	if len(nodeCfg.Nodes) != 2 || len(nodeCfg.Workloads) != len(caCfg.Workloads) || len(caCfg.Workloads) != 2 {
		t.Errorf("nodes %d, workloads %d (meshtun ca's %d): want 2, 2, 2", len(nodeCfg.Nodes), len(nodeCfg.Workloads), len(caCfg.Workloads))
	}
	if _, err := WriteNodeConfig(c, dir, Mesh{InsecureSharedCA: true}); err == nil {
		t.Error("WriteNodeConfig with InsecureSharedCA: no error; those nodes need the CA directory")
	}
}
