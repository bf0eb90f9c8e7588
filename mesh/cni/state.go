package cni

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"time"
)

// State is what the node proxy last knew of enrolment, written for the
// plugin to fall back on while the node cannot be asked (not started yet
// after a reboot, restarting, crashed). The plugin lets a pod through
// without the node only when its namespace is listed in Exempt: a
// namespace the node saw without the ambient label, whose pods are
// therefore not in the mesh. Every other pod's ADD fails until the node
// answers, so a pod that may be in the mesh never starts uncaptured.
type State struct {
	// Node is the node proxy's node name; Written is when it wrote this.
	Node    string    `json:"node"`
	Written time.Time `json:"written"`
	// Exempt are the namespaces not enrolled in the mesh, sorted.
	Exempt []string `json:"exempt"`
}

// MaxStateFile bounds the state file the plugin reads.
const MaxStateFile = 4 << 20

// WriteState writes s to path atomically (a temporary file renamed over
// it), mode 0600, so that the plugin never reads half a file.
func WriteState(path string, s *State) error {
	s.Exempt = slices.Clone(s.Exempt)
	slices.Sort(s.Exempt)
	data, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return writeAtomic(path, data, 0o600)
}

// ReadState reads the state file at path.
func ReadState(path string) (*State, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var s State
	dec := json.NewDecoder(io.LimitReader(f, MaxStateFile))
	if err := dec.Decode(&s); err != nil {
		return nil, fmt.Errorf("cni: state file %s: %w", path, err)
	}
	return &s, nil
}

// IsExempt says whether namespace ns is listed as not enrolled.
func (s *State) IsExempt(ns string) bool {
	_, found := slices.BinarySearch(s.Exempt, ns)
	return found
}

// writeAtomic writes data to a temporary file in path's directory and
// renames it over path.
func writeAtomic(path string, data []byte, mode os.FileMode) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("cni: write %s: %w", path, err)
	}
	tmp := f.Name()
	_, werr := f.Write(data)
	if werr == nil {
		werr = f.Chmod(mode)
	}
	if werr == nil {
		werr = f.Sync()
	}
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = os.Rename(tmp, path)
	}
	if werr != nil {
		os.Remove(tmp)
		return fmt.Errorf("cni: write %s: %w", path, werr)
	}
	return nil
}
