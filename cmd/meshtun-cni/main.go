// Command meshtun-cni is meshtun's chained CNI plugin, the startup gate:
// the container runtime runs it after the plugin that gives a pod its
// network, and its ADD holds the pod's sandbox until the node proxy has
// captured the pod (certificate, capture rules, inbound HBONE rules), so
// that no enrolled pod sends or receives a byte, init containers included,
// before it is captured. It asks the node proxy over a Unix socket; the
// node decides enrolment from its API server caches and answers
// "captured" or "pass". When the node cannot be asked, the ADD fails (and
// the kubelet retries) for every pod except those of namespaces the node
// last listed as not enrolled, and of the conflist's exemptNamespaces.
//
// It follows the CNI specification (1.1.0; earlier results passed through
// as they come) with the standard library only, to stay small: it is
// exec'd for every pod sandbox (docs/kubernetes.md, "The startup gate").
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/meshtun/meshtun/mesh/cni"
)

// netConf is the plugin's configuration as the runtime passes it on stdin.
type netConf struct {
	CNIVersion string `json:"cniVersion"`
	Name       string `json:"name"`
	Type       string `json:"type"`
	cni.PluginConf
	RawPrevResult json.RawMessage `json:"prevResult,omitempty"`
}

// prevResult is the part of a previous plugin's result the plugin reads.
type prevResult struct {
	Interfaces []struct {
		Name    string `json:"name"`
		Sandbox string `json:"sandbox,omitempty"`
	} `json:"interfaces"`
	IPs []struct {
		Address   string `json:"address"`
		Interface *int   `json:"interface,omitempty"`
	} `json:"ips"`
}

// CNI error codes (the specification's well-known ones).
const (
	codeIncompatibleVersion = 1
	codeInvalidConfig       = 7
	codeTryAgainLater       = 11
)

var supportedVersions = []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

// cniError is the specification's error result.
type cniError struct {
	CNIVersion string `json:"cniVersion"`
	Code       int    `json:"code"`
	Msg        string `json:"msg"`
	Details    string `json:"details,omitempty"`
}

func (e *cniError) Error() string { return e.Msg + ": " + e.Details }

func main() {
	err := run(os.Getenv, os.Stdin, os.Stdout)
	if err != nil {
		var ce *cniError
		if !errors.As(err, &ce) {
			ce = &cniError{Code: codeTryAgainLater, Msg: "meshtun-cni", Details: err.Error()}
		}
		if ce.CNIVersion == "" {
			ce.CNIVersion = "1.1.0"
		}
		json.NewEncoder(os.Stdout).Encode(ce)
		fmt.Fprintln(os.Stderr, "meshtun-cni:", ce.Msg+": "+ce.Details)
		os.Exit(1)
	}
}

func run(getenv func(string) string, stdin io.Reader, stdout io.Writer) error {
	cmd := getenv("CNI_COMMAND")
	if cmd == "VERSION" {
		return json.NewEncoder(stdout).Encode(map[string]any{"cniVersion": "1.1.0", "supportedVersions": supportedVersions})
	}
	data, err := io.ReadAll(io.LimitReader(stdin, cni.MaxConflist+1))
	if err != nil {
		return err
	}
	var conf netConf
	if err := json.Unmarshal(data, &conf); err != nil {
		return &cniError{Code: codeInvalidConfig, Msg: "invalid network configuration", Details: err.Error()}
	}
	if conf.CNIVersion != "" && !slices.Contains(supportedVersions, conf.CNIVersion) {
		return &cniError{CNIVersion: conf.CNIVersion, Code: codeIncompatibleVersion, Msg: "unsupported cniVersion", Details: conf.CNIVersion}
	}
	if conf.Socket == "" {
		conf.Socket = cni.DefaultSocket
	}
	if conf.StateFile == "" {
		conf.StateFile = cni.DefaultStateFile
	}
	timeout := cni.DefaultTimeout
	if conf.TimeoutSeconds > 0 {
		timeout = time.Duration(conf.TimeoutSeconds) * time.Second
	}
	args := parseArgs(getenv("CNI_ARGS"))
	req := &cni.Request{
		ContainerID: getenv("CNI_CONTAINERID"), Netns: getenv("CNI_NETNS"), IfName: getenv("CNI_IFNAME"),
		Namespace: args["K8S_POD_NAMESPACE"], Name: args["K8S_POD_NAME"], UID: args["K8S_POD_UID"],
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	switch cmd {
	case "ADD":
		return add(ctx, &conf, req, stdout)
	case "DEL":
		// DEL must succeed whatever the node's state: the node drops
		// what it holds for the sandbox if it hears it, and otherwise
		// when the pod leaves the API server.
		if req.Namespace != "" && req.Name != "" && req.ContainerID != "" {
			req.Command = cni.CommandDel
			ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			cni.Ask(ctx, conf.Socket, req)
			cancel()
		}
		return nil
	case "CHECK", "STATUS", "GC":
		return nil
	}
	return &cniError{CNIVersion: conf.CNIVersion, Code: codeInvalidConfig, Msg: "unknown CNI_COMMAND", Details: cmd}
}

// add asks the node to capture the pod, and passes the previous result on
// once it has, or once the pod is known to be outside the mesh.
func add(ctx context.Context, conf *netConf, req *cni.Request, stdout io.Writer) error {
	if raw := bytes.TrimSpace(conf.RawPrevResult); len(raw) == 0 || string(raw) == "null" {
		return &cniError{CNIVersion: conf.CNIVersion, Code: codeInvalidConfig, Msg: "no prevResult", Details: "meshtun-cni is a chained plugin: it must come after the plugin that gives the pod its addresses"}
	}
	pass := func() error {
		// The result of a chained plugin is its input's prevResult,
		// unchanged, in the same version.
		_, err := stdout.Write(append(bytes.TrimSpace(conf.RawPrevResult), '\n'))
		return err
	}
	if req.Namespace == "" || req.Name == "" {
		return pass() // not a Kubernetes pod: not meshtun's
	}
	var prev prevResult
	if err := json.Unmarshal(conf.RawPrevResult, &prev); err != nil {
		return &cniError{CNIVersion: conf.CNIVersion, Code: codeInvalidConfig, Msg: "invalid prevResult", Details: err.Error()}
	}
	req.Command = cni.CommandAdd
	for _, ip := range prev.IPs {
		p, err := netip.ParsePrefix(ip.Address)
		if err != nil {
			return &cniError{CNIVersion: conf.CNIVersion, Code: codeInvalidConfig, Msg: "invalid prevResult address", Details: ip.Address}
		}
		req.Addresses = append(req.Addresses, p.Addr().Unmap())
	}
	req.HostLink = hostLink(&prev)
	resp, err := cni.Ask(ctx, conf.Socket, req)
	if err != nil {
		return unreachable(conf, req, err, pass)
	}
	switch resp.Verdict {
	case cni.Captured, cni.Pass:
		return pass()
	}
	return &cniError{CNIVersion: conf.CNIVersion, Code: codeTryAgainLater,
		Msg:     "meshtun node refused to start pod " + req.Namespace + "/" + req.Name,
		Details: resp.Reason}
}

// unreachable decides a pod's ADD when the node could not be asked: it
// passes only pods of namespaces known not to be enrolled.
func unreachable(conf *netConf, req *cni.Request, askErr error, pass func() error) error {
	if slices.Contains(conf.ExemptNamespaces, req.Namespace) {
		return pass()
	}
	st, err := cni.ReadState(conf.StateFile)
	if err == nil && st.IsExempt(req.Namespace) {
		return pass()
	}
	why := "the node has not listed namespace " + req.Namespace + " as outside the mesh"
	if err != nil {
		why = "no state file of the node (" + err.Error() + ")"
	}
	return &cniError{CNIVersion: conf.CNIVersion, Code: codeTryAgainLater,
		Msg:     "meshtun node not ready: pod " + req.Namespace + "/" + req.Name + " may be in the mesh and waits for it",
		Details: askErr.Error() + "; " + why}
}

// hostLink returns the host-side interface of the previous result: one
// without a sandbox (the veth's host end, as ptp and bridge report it).
func hostLink(prev *prevResult) string {
	for _, i := range prev.Interfaces {
		if i.Sandbox == "" && i.Name != "" {
			return i.Name
		}
	}
	return ""
}

// parseArgs parses CNI_ARGS ("K1=V1;K2=V2").
func parseArgs(s string) map[string]string {
	out := map[string]string{}
	for _, kv := range strings.Split(s, ";") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			out[k] = v
		}
	}
	return out
}
