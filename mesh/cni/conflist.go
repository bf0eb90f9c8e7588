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

// FindConflist returns the conflist the container runtime uses in dir:
// the first of its CNI configuration files (*.conf, *.conflist, *.json)
// by name, as containerd and CRI-O choose it. It is an error if that file
// is not a .conflist (a single plugin cannot be chained) and
// os.ErrNotExist (wrapped) if dir has none yet: the pod network's own
// installer has not written it.
func FindConflist(dir string) (string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", fmt.Errorf("cni: config directory: %w", err)
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
	if len(names) == 0 {
		return "", fmt.Errorf("cni: no CNI configuration in %s yet: %w", dir, os.ErrNotExist)
	}
	slices.Sort(names)
	path := filepath.Join(dir, names[0])
	if filepath.Ext(path) != ".conflist" {
		return "", fmt.Errorf("cni: %s is the runtime's CNI configuration and not a .conflist: the plugin cannot be chained to it", path)
	}
	return path, nil
}

// EnsureInConflist adds the plugin to the conflist the runtime uses in
// dir (FindConflist), rewriting it atomically only if it changes. It
// returns the file's path and whether it was rewritten.
func EnsureInConflist(dir string, conf PluginConf) (string, bool, error) {
	path, err := FindConflist(dir)
	if err != nil {
		return "", false, err
	}
	data, err := readBounded(path)
	if err != nil {
		return path, false, err
	}
	out, changed, err := AddPlugin(data, conf)
	if err != nil {
		return path, false, fmt.Errorf("%s: %w", path, err)
	}
	if !changed {
		return path, false, nil
	}
	st, err := os.Stat(path)
	if err != nil {
		return path, false, err
	}
	return path, true, writeAtomic(path, out, st.Mode().Perm())
}

// RemoveFromConflists removes the plugin from every conflist in dir and
// returns the files it rewrote.
func RemoveFromConflists(dir string) ([]string, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "*.conflist"))
	if err != nil {
		return nil, err
	}
	var done []string
	var errs []error
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
