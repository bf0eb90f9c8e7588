// Package cni is what meshtun's chained CNI plugin (cmd/meshtun-cni) and
// the node proxy share: the request the plugin sends the node over a Unix
// socket when the container runtime adds or deletes a pod's network, the
// node's answer, the state file the plugin falls back on when the node
// does not answer, and the editing of the node's CNI conflist that puts
// the plugin in the chain.
//
// It imports the standard library only: the plugin is exec'd by the
// runtime for every pod sandbox and stays small (docs/kubernetes.md,
// "The startup gate").
package cni

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"time"
)

// PluginType is the plugin's "type" in a conflist and its binary's name in
// the CNI bin directory.
const PluginType = "meshtun-cni"

// Defaults of the host paths the plugin and the node share (a hostPath
// directory of the DaemonSet, kept across reboots so that the state file
// is there before the node proxy is).
const (
	DefaultDir       = "/var/lib/meshtun/cni"
	DefaultSocket    = DefaultDir + "/cni.sock"
	DefaultStateFile = DefaultDir + "/state.json"
)

// Commands of a Request.
const (
	CommandAdd = "ADD"
	CommandDel = "DEL"
)

// Verdicts of a Response.
const (
	// Captured: the pod is in the mesh and its capture rules, certificate
	// and inbound HBONE rules are in place; the sandbox may start.
	Captured = "captured"
	// Pass: the pod is not in the mesh; nothing was done.
	Pass = "pass"
	// Refused: the node cannot capture the pod (yet); the plugin fails
	// the ADD and the kubelet retries the sandbox.
	Refused = "refused"
	// Done answers a DEL.
	Done = "done"
)

// MaxMessage bounds a request or response line.
const MaxMessage = 16 << 10

// Bounds of a request's fields.
const (
	MaxAddresses = 8
	maxName      = 253
	maxLinkName  = 15 // IFNAMSIZ-1
	maxID        = 256
)

// Request is what the plugin sends the node: one JSON object on one line.
type Request struct {
	Command     string `json:"command"`
	ContainerID string `json:"containerID"`
	Netns       string `json:"netns,omitempty"`
	IfName      string `json:"ifName,omitempty"`
	// Namespace, Name and UID are the pod's (CNI_ARGS K8S_POD_NAMESPACE,
	// K8S_POD_NAME, K8S_POD_UID; the UID only if the runtime sends it).
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid,omitempty"`
	// Addresses are the pod's addresses from the previous plugin's result.
	Addresses []netip.Addr `json:"addresses,omitempty"`
	// HostLink is the host side of the pod's link (the veth's host end),
	// from the previous plugin's result; empty if it named none.
	HostLink string `json:"hostLink,omitempty"`
}

// Validate checks the request's bounds and form.
func (r *Request) Validate() error {
	switch r.Command {
	case CommandAdd, CommandDel:
	default:
		return fmt.Errorf("cni: command %q: want ADD or DEL", r.Command)
	}
	if r.ContainerID == "" || len(r.ContainerID) > maxID {
		return fmt.Errorf("cni: container id %q: want 1 to %d characters", r.ContainerID, maxID)
	}
	if r.Namespace == "" || len(r.Namespace) > maxName || r.Name == "" || len(r.Name) > maxName || len(r.UID) > maxID {
		return fmt.Errorf("cni: pod %q/%q: want a namespace and a name of 1 to %d characters", r.Namespace, r.Name, maxName)
	}
	if len(r.Addresses) > MaxAddresses {
		return fmt.Errorf("cni: pod %s/%s: %d addresses, at most %d", r.Namespace, r.Name, len(r.Addresses), MaxAddresses)
	}
	for _, a := range r.Addresses {
		if !a.IsValid() || a.IsUnspecified() || a.IsLoopback() || a.IsMulticast() {
			return fmt.Errorf("cni: pod %s/%s: address %s cannot be a pod's", r.Namespace, r.Name, a)
		}
	}
	if r.Command == CommandAdd && len(r.Addresses) == 0 {
		return fmt.Errorf("cni: pod %s/%s: ADD without an address", r.Namespace, r.Name)
	}
	if len(r.HostLink) > maxLinkName {
		return fmt.Errorf("cni: pod %s/%s: host link %q longer than %d characters", r.Namespace, r.Name, r.HostLink, maxLinkName)
	}
	return nil
}

// Response is the node's answer: one JSON object on one line.
type Response struct {
	Verdict string `json:"verdict"`
	// Reason says why (not in the mesh, or why the node refused).
	Reason string `json:"reason,omitempty"`
}

// ErrUnreachable wraps the errors of a node that could not be asked (no
// socket, nobody listening, connection cut before an answer).
var ErrUnreachable = errors.New("meshtun node unreachable")

// Ask sends req to the node listening on socket and returns its answer.
// An error wraps ErrUnreachable when the node could not be asked at all or
// did not answer.
func Ask(ctx context.Context, socket string, req *Request) (*Response, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", socket)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	data, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	if _, err := c.Write(append(data, '\n')); err != nil {
		return nil, fmt.Errorf("%w: send to %s: %w", ErrUnreachable, socket, err)
	}
	var resp Response
	if err := ReadMessage(c, &resp); err != nil {
		return nil, fmt.Errorf("%w: answer from %s: %w", ErrUnreachable, socket, err)
	}
	return &resp, nil
}

// ReadMessage reads one JSON line of at most MaxMessage bytes into v.
func ReadMessage(r io.Reader, v any) error {
	line, err := bufio.NewReaderSize(r, MaxMessage).ReadSlice('\n')
	switch {
	case errors.Is(err, bufio.ErrBufferFull):
		return fmt.Errorf("cni: message longer than %d bytes", MaxMessage)
	case errors.Is(err, io.EOF):
		return io.ErrUnexpectedEOF
	case err != nil:
		return err
	}
	if err := json.Unmarshal(line, v); err != nil {
		return fmt.Errorf("cni: bad message: %w", err)
	}
	return nil
}

// DefaultTimeout is how long the plugin waits for the node's answer to an
// ADD; the node answers within its own capture timeout, which is shorter.
const DefaultTimeout = 30 * time.Second
