package main

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/meshtun/meshtun/mesh/cni"
)

// TestCNIFlags: --cni needs --kubernetes (the gate decides enrolment from
// the API server), and the conflist entry points at the socket and state
// file of --cni-dir, exempts the listed namespaces and gives the plugin
// longer than the node's own timeout.
func TestCNIFlags(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "mesh.yaml")
	os.WriteFile(cfg, []byte("trustDomain: cluster.local\n"), 0o644)
	err := runNode(context.Background(), []string{"--cni", "--node", "n1", "--config", cfg})
	if err == nil || !strings.Contains(err.Error(), "--cni needs --kubernetes") {
		t.Errorf("--cni without --kubernetes: %v", err)
	}
	f := cniFlags{dir: "/var/lib/x", exemptNamespaces: "kube-system, meshtun-system,", timeout: 20 * time.Second}
	pc := f.pluginConf()
	if pc.Socket != "/var/lib/x/cni.sock" || pc.StateFile != "/var/lib/x/state.json" {
		t.Errorf("paths %q %q", pc.Socket, pc.StateFile)
	}
	if !slices.Equal(pc.ExemptNamespaces, []string{"kube-system", "meshtun-system"}) {
		t.Errorf("exempt %q", pc.ExemptNamespaces)
	}
	if pc.TimeoutSeconds*1e9 <= int(f.timeout) {
		t.Errorf("plugin timeout %ds is not above the node's %s", pc.TimeoutSeconds, f.timeout)
	}
}

// TestCNIUninstall removes meshtun's conflist, the plugin from every other
// conflist, its binary and the gate's directory, and leaves the rest of
// the conflist.
func TestCNIUninstall(t *testing.T) {
	root := t.TempDir()
	bin, conf, dir := filepath.Join(root, "bin"), filepath.Join(root, "net.d"), filepath.Join(root, "cni")
	for _, d := range []string{bin, conf, dir} {
		os.MkdirAll(d, 0o755)
	}
	os.WriteFile(filepath.Join(bin, cni.PluginType), []byte("x"), 0o755)
	os.WriteFile(filepath.Join(bin, "ptp"), []byte("x"), 0o755)
	list, _, err := cni.AddPlugin([]byte(`{"cniVersion":"1.0.0","name":"k","plugins":[{"type":"ptp"}]}`), cni.PluginConf{Socket: "/s"})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(conf, "10-k.conflist")
	os.WriteFile(path, list, 0o644) // chained in place, as an earlier meshtun did
	own := filepath.Join(conf, cni.OwnConflist)
	os.WriteFile(own, list, 0o644)
	if err := runCNI(context.Background(), []string{"uninstall", "--cni-bin-dir", bin, "--cni-conf-dir", conf, "--cni-dir", dir}); err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(path)
	if cni.HasPlugin(data) || !strings.Contains(string(data), `"ptp"`) {
		t.Errorf("conflist after uninstall:\n%s", data)
	}
	if _, err := os.Stat(own); !os.IsNotExist(err) {
		t.Errorf("%s after uninstall: %v", own, err)
	}
	if _, err := os.Stat(filepath.Join(bin, cni.PluginType)); !os.IsNotExist(err) {
		t.Errorf("plugin binary: %v", err)
	}
	if _, err := os.Stat(filepath.Join(bin, "ptp")); err != nil {
		t.Errorf("other plugin removed: %v", err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("gate directory: %v", err)
	}
}
