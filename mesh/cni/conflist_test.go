package cni

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// kindnet writes a conflist like this one (ptp, host-local, portmap).
const kindnetConflist = `{
	"cniVersion": "0.3.1",
	"name": "kindnet",
	"plugins": [
		{"type": "ptp", "ipMasq": false, "ipam": {"type": "host-local", "dataDir": "/run/cni-ipam-state",
		 "routes": [{"dst": "0.0.0.0/0"}], "ranges": [[{"subnet": "10.244.1.0/24"}]]}, "mtu": 1500},
		{"type": "portmap", "capabilities": {"portMappings": true}}
	]
}`

var testConf = PluginConf{Socket: "/var/lib/meshtun/cni/cni.sock", StateFile: "/var/lib/meshtun/cni/state.json", ExemptNamespaces: []string{"kube-system"}}

func pluginTypes(t *testing.T, conflist []byte) []string {
	t.Helper()
	var doc struct {
		Plugins []map[string]any `json:"plugins"`
	}
	if err := json.Unmarshal(conflist, &doc); err != nil {
		t.Fatalf("%v: %s", err, conflist)
	}
	var out []string
	for _, p := range doc.Plugins {
		out = append(out, p["type"].(string))
	}
	return out
}

// TestAddPlugin chains the plugin last, keeps everything else of the
// conflist (numbers too), adds nothing the second time, replaces an
// outdated entry of its own in place and drops duplicates.
func TestAddPlugin(t *testing.T) {
	out, changed, err := AddPlugin([]byte(kindnetConflist), testConf)
	if err != nil {
		t.Fatal(err)
	}
	if !changed {
		t.Error("first add: not changed")
	}
	if got, want := strings.Join(pluginTypes(t, out), ","), "ptp,portmap,"+PluginType; got != want {
		t.Errorf("plugins %s, want %s", got, want)
	}
	for _, keep := range []string{`"mtu": 1500`, `"subnet": "10.244.1.0/24"`, `"name": "kindnet"`, `"cniVersion": "0.3.1"`, `"socket": "/var/lib/meshtun/cni/cni.sock"`} {
		if !strings.Contains(string(out), keep) {
			t.Errorf("conflist lost %s:\n%s", keep, out)
		}
	}
	again, changed, err := AddPlugin(out, testConf)
	if err != nil || changed {
		t.Errorf("second add: changed %v, err %v", changed, err)
	}
	if !sameJSON(out, again) {
		t.Errorf("second add changed the conflist:\n%s\n%s", out, again)
	}

	// An outdated entry (another socket) in the middle, and a duplicate.
	old := strings.Replace(kindnetConflist, `{"type": "portmap"`, `{"type": "meshtun-cni", "socket": "/old"}, {"type": "portmap"`, 1)
	old = strings.Replace(old, `"portMappings": true}}`, `"portMappings": true}}, {"type": "meshtun-cni"}`, 1)
	out, changed, err = AddPlugin([]byte(old), testConf)
	if err != nil || !changed {
		t.Fatalf("replace: changed %v, err %v", changed, err)
	}
	if got, want := strings.Join(pluginTypes(t, out), ","), "ptp,"+PluginType+",portmap"; got != want {
		t.Errorf("plugins %s, want %s", got, want)
	}
	if strings.Contains(string(out), "/old") {
		t.Errorf("outdated entry kept:\n%s", out)
	}

	for _, bad := range []string{`{"type": "ptp"}`, `{"plugins": []}`, `not json`, `{"plugins": [{"type": "ptp"}]} {}`} {
		if _, _, err := AddPlugin([]byte(bad), testConf); err == nil {
			t.Errorf("AddPlugin(%s): no error", bad)
		}
	}
}

// TestRemovePlugin takes the plugin's entries out and nothing else.
func TestRemovePlugin(t *testing.T) {
	with, _, err := AddPlugin([]byte(kindnetConflist), testConf)
	if err != nil {
		t.Fatal(err)
	}
	if !HasPlugin(with) {
		t.Fatal("HasPlugin: false after AddPlugin")
	}
	out, changed, err := RemovePlugin(with)
	if err != nil || !changed {
		t.Fatalf("changed %v, err %v", changed, err)
	}
	if !sameJSON(out, []byte(kindnetConflist)) {
		t.Errorf("RemovePlugin is not the original:\n%s", out)
	}
	if HasPlugin(out) {
		t.Error("HasPlugin: true after RemovePlugin")
	}
	if _, changed, _ := RemovePlugin([]byte(kindnetConflist)); changed {
		t.Error("RemovePlugin of a conflist without the plugin: changed")
	}
}

// TestEnsureInConflist keeps OwnConflist, first by name, a copy of the
// pod network's configuration (the first other file) with the plugin
// chained last, leaves the pod network's file as its installer wrote it,
// writes only on a change, follows the pod network's rewrites, and is
// removed by RemoveFromConflists.
func TestEnsureInConflist(t *testing.T) {
	dir := t.TempDir()
	if _, _, err := EnsureInConflist(dir, testConf); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("empty dir: %v, want ErrNotExist", err)
	}
	first := filepath.Join(dir, "10-kindnet.conflist")
	second := filepath.Join(dir, "20-other.conflist")
	for _, p := range []string{first, second} {
		if err := os.WriteFile(p, []byte(kindnetConflist), 0o640); err != nil {
			t.Fatal(err)
		}
	}
	own := filepath.Join(dir, OwnConflist)
	path, changed, err := EnsureInConflist(dir, testConf)
	if err != nil || !changed || path != own {
		t.Fatalf("EnsureInConflist: %s, changed %v, err %v", path, changed, err)
	}
	names, _ := configFiles(dir)
	if names[0] != OwnConflist {
		t.Errorf("the runtime's first configuration is %s, want %s", names[0], OwnConflist)
	}
	data, _ := os.ReadFile(own)
	if !HasPlugin(data) {
		t.Errorf("%s lacks the plugin:\n%s", own, data)
	}
	want, _, _ := AddPlugin([]byte(kindnetConflist), testConf)
	if !sameJSON(data, want) {
		t.Errorf("%s is not the pod network's conflist with the plugin last:\n%s", own, data)
	}
	for _, p := range []string{first, second} {
		if data, _ := os.ReadFile(p); string(data) != kindnetConflist {
			t.Errorf("%s (the pod network's) was edited:\n%s", p, data)
		}
	}
	st, _ := os.Stat(own)
	before := st.ModTime()
	if _, changed, err := EnsureInConflist(dir, testConf); err != nil || changed {
		t.Errorf("second ensure: changed %v, err %v", changed, err)
	}
	if st, _ := os.Stat(own); !st.ModTime().Equal(before) {
		t.Error("second ensure rewrote the file")
	}
	// The pod network rewrites its conflist with new content: the copy
	// follows, the plugin still last.
	changedNet := strings.Replace(kindnetConflist, `"mtu": 1500`, `"mtu": 1400`, 1)
	if changedNet == kindnetConflist {
		t.Fatal("test conflist has no mtu to change")
	}
	os.WriteFile(first, []byte(changedNet), 0o640)
	if _, changed, err := EnsureInConflist(dir, testConf); err != nil || !changed {
		t.Errorf("after a rewrite: changed %v, err %v", changed, err)
	}
	if data, _ := os.ReadFile(own); !strings.Contains(string(data), "1400") || !HasPlugin(data) {
		t.Errorf("copy after the pod network's rewrite:\n%s", data)
	}
	// An earlier meshtun chained the plugin into the pod network's file:
	// it is taken out there and kept in the copy.
	inPlace, _, _ := AddPlugin([]byte(changedNet), testConf)
	os.WriteFile(first, inPlace, 0o640)
	if _, _, err := EnsureInConflist(dir, testConf); err != nil {
		t.Fatal(err)
	}
	if data, _ := os.ReadFile(first); HasPlugin(data) {
		t.Errorf("the plugin is still in the pod network's file:\n%s", data)
	}
	if st, _ := os.Stat(first); st.Mode().Perm() != 0o640 {
		t.Errorf("pod network's file mode %v, want 0640 kept", st.Mode().Perm())
	}
	// No temporary file is left behind.
	if ents, _ := os.ReadDir(dir); len(ents) != 3 {
		t.Errorf("files in %s: %v", dir, ents)
	}

	done, err := RemoveFromConflists(dir)
	if err != nil || len(done) != 1 || done[0] != own {
		t.Errorf("RemoveFromConflists: %v, %v", done, err)
	}
	if _, err := os.Stat(own); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s after RemoveFromConflists: %v", own, err)
	}

	// A single-plugin .conf first: the copy is a conflist of it and the
	// plugin.
	single := filepath.Join(dir, "05-single.conf")
	os.WriteFile(single, []byte(`{"cniVersion":"0.4.0","name":"br","type":"bridge"}`), 0o644)
	if _, _, err := EnsureInConflist(dir, testConf); err != nil {
		t.Fatalf(".conf first: %v", err)
	}
	_, plugins, err := parseConflist(mustReadFile(t, own))
	if err != nil || len(plugins) != 2 || plugins[0].(map[string]any)["type"] != "bridge" || !isOurs(plugins[1]) {
		t.Errorf("copy of a .conf: %v, %v", plugins, err)
	}
	// The pod network's configuration goes away: so does the copy.
	for _, p := range []string{single, first, second} {
		os.Remove(p)
	}
	if _, _, err := EnsureInConflist(dir, testConf); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("without a pod network: %v", err)
	}
	if _, err := os.Stat(own); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s kept without a pod network: %v", own, err)
	}
	// A configuration that sorts before the copy: an error, never a
	// silent gate that the runtime does not run.
	os.WriteFile(filepath.Join(dir, "00-aaa.conflist"), []byte(kindnetConflist), 0o644)
	if _, _, err := EnsureInConflist(dir, testConf); err == nil || errors.Is(err, os.ErrNotExist) {
		t.Errorf("a file before ours: %v, want an error", err)
	}
}

func mustReadFile(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// TestInstallBinary copies the plugin, executable, and not again when the
// same one is there.
func TestInstallBinary(t *testing.T) {
	src := filepath.Join(t.TempDir(), "meshtun-cni")
	os.WriteFile(src, []byte("#!/bin/sh\n"), 0o700)
	bin := t.TempDir()
	if wrote, err := InstallBinary(src, bin); err != nil || !wrote {
		t.Fatalf("wrote %v, err %v", wrote, err)
	}
	st, err := os.Stat(filepath.Join(bin, PluginType))
	if err != nil || st.Mode().Perm() != 0o755 {
		t.Fatalf("installed: %v, %v", st, err)
	}
	if wrote, err := InstallBinary(src, bin); err != nil || wrote {
		t.Errorf("second install: wrote %v, err %v", wrote, err)
	}
}

// TestState round-trips the state file and answers exemption by name.
func TestState(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.json")
	if err := WriteState(path, &State{Node: "n1", Exempt: []string{"kube-system", "default", "meshtun-system"}}); err != nil {
		t.Fatal(err)
	}
	st, err := ReadState(path)
	if err != nil {
		t.Fatal(err)
	}
	for ns, want := range map[string]bool{"default": true, "kube-system": true, "meshtun-system": true, "mesh": false, "": false} {
		if got := st.IsExempt(ns); got != want {
			t.Errorf("IsExempt(%q) = %v, want %v", ns, got, want)
		}
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o600 {
		t.Errorf("mode %v", fi.Mode().Perm())
	}
	os.WriteFile(path, []byte(`{"exempt": ["a"`), 0o600)
	if _, err := ReadState(path); err == nil {
		t.Error("truncated state file: no error")
	}
}

// TestValidate bounds a request.
func TestValidate(t *testing.T) {
	ok := Request{Command: CommandAdd, ContainerID: "c1", Namespace: "mesh", Name: "p"}
	ok.Addresses = append(ok.Addresses, mustAddr("10.244.1.5"))
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	for name, mut := range map[string]func(*Request){
		"command":    func(r *Request) { r.Command = "CHECK" },
		"no id":      func(r *Request) { r.ContainerID = "" },
		"no ns":      func(r *Request) { r.Namespace = "" },
		"long name":  func(r *Request) { r.Name = strings.Repeat("a", 254) },
		"no address": func(r *Request) { r.Addresses = nil },
		"loopback":   func(r *Request) { r.Addresses[0] = mustAddr("127.0.0.1") },
		"many":       func(r *Request) { r.Addresses = make([]netipAddr, 9); fill(r.Addresses) },
		"long link":  func(r *Request) { r.HostLink = strings.Repeat("v", 16) },
	} {
		r := ok
		r.Addresses = append([]netipAddr(nil), ok.Addresses...)
		mut(&r)
		if err := r.Validate(); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}
