package cni

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// PluginConf is the plugin's entry in a conflist's "plugins" (besides
// "type", which is PluginType).
type PluginConf struct {
	// Socket is the node proxy's socket; StateFile its state file.
	Socket    string `json:"socket"`
	StateFile string `json:"stateFile"`
	// ExemptNamespaces pass without the node even when the state file is
	// missing: the namespaces meshtun itself (and what it needs to start)
	// runs in, so that the gate can never hold back its own pods.
	ExemptNamespaces []string `json:"exemptNamespaces,omitempty"`
	// TimeoutSeconds bounds the wait for the node's answer to an ADD;
	// 0 means DefaultTimeout.
	TimeoutSeconds int `json:"timeoutSeconds,omitempty"`
}

// entry is conf as a conflist plugin object.
func (conf PluginConf) entry() map[string]any {
	data, _ := json.Marshal(conf)
	var m map[string]any
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	dec.Decode(&m)
	m["type"] = PluginType
	return m
}

// MaxConflist bounds a conflist file read.
const MaxConflist = 1 << 20

// AddPlugin returns the conflist with the plugin's entry conf last in its
// chain (after the plugin that gives pods their addresses and the others
// already chained, so that its ADD sees their result), and whether it
// differs from conflist. An entry of the plugin already there is replaced
// in place if it differs, so that adding is idempotent and a conflist
// already right is not rewritten.
func AddPlugin(conflist []byte, conf PluginConf) ([]byte, bool, error) {
	doc, plugins, err := parseConflist(conflist)
	if err != nil {
		return nil, false, err
	}
	want := conf.entry()
	var kept []any
	found := false
	for _, p := range plugins {
		if isOurs(p) {
			if found {
				continue // a duplicate: drop it
			}
			found = true
			kept = append(kept, want)
			continue
		}
		kept = append(kept, p)
	}
	if !found {
		kept = append(kept, want)
	}
	doc["plugins"] = kept
	out, err := marshalConflist(doc)
	if err != nil {
		return nil, false, err
	}
	return out, !sameJSON(conflist, out), nil
}

// RemovePlugin returns the conflist without the plugin's entries, and
// whether there were any.
func RemovePlugin(conflist []byte) ([]byte, bool, error) {
	doc, plugins, err := parseConflist(conflist)
	if err != nil {
		return nil, false, err
	}
	var kept []any
	for _, p := range plugins {
		if !isOurs(p) {
			kept = append(kept, p)
		}
	}
	if len(kept) == len(plugins) {
		return conflist, false, nil
	}
	doc["plugins"] = kept
	out, err := marshalConflist(doc)
	return out, err == nil, err
}

// HasPlugin says whether the conflist chains the plugin.
func HasPlugin(conflist []byte) bool {
	_, plugins, err := parseConflist(conflist)
	if err != nil {
		return false
	}
	return slices.ContainsFunc(plugins, isOurs)
}

func isOurs(p any) bool {
	m, ok := p.(map[string]any)
	return ok && m["type"] == PluginType
}

func parseConflist(data []byte) (map[string]any, []any, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var doc map[string]any
	if err := dec.Decode(&doc); err != nil {
		return nil, nil, fmt.Errorf("cni: conflist: %w", err)
	}
	if dec.Decode(new(any)) != io.EOF {
		return nil, nil, errors.New("cni: conflist: data after the JSON object")
	}
	raw, ok := doc["plugins"]
	if !ok {
		return nil, nil, errors.New(`cni: conflist: no "plugins" list (a single-plugin .conf file cannot be chained)`)
	}
	plugins, ok := raw.([]any)
	if !ok || len(plugins) == 0 {
		return nil, nil, errors.New(`cni: conflist: "plugins" is not a non-empty list`)
	}
	return doc, plugins, nil
}

func marshalConflist(doc map[string]any) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	if err := enc.Encode(doc); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// sameJSON says whether a and b hold the same JSON value.
func sameJSON(a, b []byte) bool {
	var va, vb any
	da, db := json.NewDecoder(bytes.NewReader(a)), json.NewDecoder(bytes.NewReader(b))
	da.UseNumber()
	db.UseNumber()
	if da.Decode(&va) != nil || db.Decode(&vb) != nil {
		return false
	}
	ja, _ := json.Marshal(va)
	jb, _ := json.Marshal(vb)
	return bytes.Equal(ja, jb)
}

// OwnConflist is the CNI configuration meshtun keeps in the node's
// directory: a copy of the pod network's configuration with the plugin
// chained last, named to sort before it, so that the runtime (containerd
// and CRI-O use the first file by name) runs the plugin while the pod
// network's own file stays as its installer wrote it. A pod network that
// rewrites its file at start (kindnet does, after every node reboot)
// then cannot drop the gate: the copy stays first, with the plugin, while
// meshtun is down, and meshtun copies the new content when it runs.
const OwnConflist = "00-meshtun.conflist"

// configFiles returns the CNI configuration files in dir (*.conf,
// *.conflist, *.json) sorted by name, as the runtime orders them.
func configFiles(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("cni: config directory: %w", err)
	}
	var names []string
	for _, e := range ents {
		n := e.Name()
		if e.IsDir() || strings.HasPrefix(n, ".") {
			continue
		}
		switch filepath.Ext(n) {
		case ".conf", ".conflist", ".json":
			names = append(names, n)
		}
	}
	slices.Sort(names)
	return names, nil
}

// FindConflist returns the pod network's CNI configuration in dir: the
// first configuration file by name other than OwnConflist, as the runtime
// would choose it without meshtun. It is os.ErrNotExist (wrapped) if dir
// has none yet: the pod network's installer has not written it.
func FindConflist(dir string) (string, error) {
	names, err := configFiles(dir)
	if err != nil {
		return "", err
	}
	for _, n := range names {
		if n != OwnConflist {
			return filepath.Join(dir, n), nil
		}
	}
	return "", fmt.Errorf("cni: no CNI configuration in %s yet: %w", dir, os.ErrNotExist)
}

// asConflist returns a CNI configuration file's content as a conflist: a
// single-plugin .conf becomes a list of that one plugin, with its name and
// version.
func asConflist(path string, data []byte) ([]byte, error) {
	if filepath.Ext(path) == ".conflist" {
		return data, nil
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var conf map[string]any
	if err := dec.Decode(&conf); err != nil {
		return nil, fmt.Errorf("cni: %s: %w", path, err)
	}
	if _, ok := conf["plugins"]; ok {
		return data, nil // a conflist under another extension
	}
	if _, ok := conf["type"].(string); !ok {
		return nil, fmt.Errorf(`cni: %s: no "type" and no "plugins": not a CNI configuration`, path)
	}
	doc := map[string]any{"cniVersion": conf["cniVersion"], "name": conf["name"], "plugins": []any{conf}}
	return marshalConflist(doc)
}

// EnsureInConflist keeps OwnConflist in dir the pod network's
// configuration (FindConflist) with the plugin chained last, rewriting it
// atomically only when it changes, and takes the plugin out of the pod
// network's own file where an earlier meshtun put it. It returns the path
// of OwnConflist and whether it was written. Without a pod network
// configuration it removes OwnConflist (no stale network is kept alive)
// and returns os.ErrNotExist (wrapped).
func EnsureInConflist(dir string, conf PluginConf) (string, bool, error) {
	own := filepath.Join(dir, OwnConflist)
	src, err := FindConflist(dir)
	if errors.Is(err, os.ErrNotExist) {
		if rerr := os.Remove(own); rerr == nil {
			return own, true, err
		}
	}
	if err != nil {
		return own, false, err
	}
	if filepath.Base(src) < OwnConflist {
		return own, false, fmt.Errorf("cni: %s sorts before %s: the runtime would not use meshtun's configuration (rename it to sort after %s)", src, OwnConflist, OwnConflist)
	}
	data, err := readBounded(src)
	if err != nil {
		return own, false, err
	}
	if filepath.Ext(src) == ".conflist" && HasPlugin(data) {
		// Chained in place by an earlier meshtun: the copy holds it now.
		stripped, _, err := RemovePlugin(data)
		if err != nil {
			return own, false, fmt.Errorf("%s: %w", src, err)
		}
		st, err := os.Stat(src)
		if err != nil {
			return own, false, err
		}
		if err := writeAtomic(src, stripped, st.Mode().Perm()); err != nil {
			return own, false, err
		}
		data = stripped
	}
	list, err := asConflist(src, data)
	if err != nil {
		return own, false, err
	}
	out, _, err := AddPlugin(list, conf)
	if err != nil {
		return own, false, fmt.Errorf("%s: %w", src, err)
	}
	if old, err := readBounded(own); err == nil && sameJSON(old, out) {
		return own, false, nil
	}
	return own, true, writeAtomic(own, out, 0o644)
}

// RemoveFromConflists removes OwnConflist from dir and the plugin from
// every other conflist there (an earlier meshtun chained it in place),
// and returns the files it removed or rewrote.
func RemoveFromConflists(dir string) ([]string, error) {
	var done []string
	var errs []error
	own := filepath.Join(dir, OwnConflist)
	if err := os.Remove(own); err == nil {
		done = append(done, own)
	} else if !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	paths, err := filepath.Glob(filepath.Join(dir, "*.conflist"))
	if err != nil {
		return done, err
	}
	for _, path := range paths {
		data, err := readBounded(path)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out, changed, err := RemovePlugin(data)
		if err != nil || !changed {
			continue // not ours to judge
		}
		st, err := os.Stat(path)
		if err == nil {
			err = writeAtomic(path, out, st.Mode().Perm())
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		done = append(done, path)
	}
	return done, errors.Join(errs...)
}

func readBounded(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxConflist+1))
	if err != nil {
		return nil, fmt.Errorf("cni: read %s: %w", path, err)
	}
	if len(data) > MaxConflist {
		return nil, fmt.Errorf("cni: %s is longer than %d bytes", path, MaxConflist)
	}
	return data, nil
}

// InstallBinary copies the plugin binary src into binDir as PluginType,
// atomically (written beside it, then renamed: a runtime exec'ing the old
// one meanwhile is not disturbed), unless an identical file is there.
// It returns whether it wrote.
func InstallBinary(src, binDir string) (bool, error) {
	data, err := os.ReadFile(src)
	if err != nil {
		return false, fmt.Errorf("cni: plugin binary: %w", err)
	}
	dst := filepath.Join(binDir, PluginType)
	if old, err := os.ReadFile(dst); err == nil && bytes.Equal(old, data) {
		return false, nil
	}
	return true, writeAtomic(dst, data, 0o755)
}
