// Package gate is the node proxy's side of meshtun's startup gate: a Unix
// socket server that the chained CNI plugin (cmd/meshtun-cni) asks, while
// the container runtime creates a pod's sandbox, to capture the pod. For a
// pod the node's API server caches show in the mesh, it announces the
// pod's addresses (from the CNI result) to the model at once, before the
// API server shows the pod's IPs, waits until the node reports the pod
// captured (certificate held, capture and inbound HBONE rules installed)
// and answers "captured"; the sandbox starts only then, so the pod's first
// packet, an init container's included, is captured. A pod outside the
// mesh gets "pass" at once.
//
// An announcement lasts until the API server shows the pod's own IPs (the
// model then holds the same workload with the same addresses: the rules
// stay, nothing flaps), the pod leaves the API server or ends, the CNI
// DEL of its sandbox arrives, or the capture could not be done in time.
//
// The server is bounded: the socket is the local runtime's only (directory
// 0700, socket 0600, peers checked to be root), it serves a bounded number
// of connections at once, and it holds a bounded number of announcements.
package gate

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/mesh/cni"
	"github.com/meshtun/meshtun/mesh/registry"
)

// Pod is what the node's API server caches say of a pod.
type Pod struct {
	UID string
	// Node is the pod's spec.nodeName.
	Node string
	// InMesh: the pod is enrolled (its namespace labelled ambient, the
	// pod not opted out, not hostNetwork); Reason says why not.
	InMesh bool
	Reason string
	// Ended: the pod has succeeded or failed; Running: it runs (init
	// containers done).
	Ended, Running bool
	// Addresses are the pod's IPs in its status (none before the kubelet
	// reports them).
	Addresses []netip.Addr
}

// Pods is the node's view of the API server (kube.Source).
type Pods interface {
	// Pod returns the cached pod namespace/name, if the cache holds it
	// and its namespace.
	Pod(namespace, name string) (Pod, bool)
	// Rebuild asks for the model to be rebuilt (an announcement came or
	// went).
	Rebuild()
	// Exempt returns the namespaces the cache holds that are not
	// enrolled.
	Exempt() []string
}

// Config configures a Gate.
type Config struct {
	// Node is this node's name.
	Node string
	// Socket is the path the plugin asks on; its directory is made 0700.
	Socket string
	// StateFile, if set, is where the namespaces outside the mesh are
	// written for the plugin to fall back on (cni.State).
	StateFile string
	Pods      Pods
	// Timeout bounds how long an ADD waits for the pod to show up in the
	// caches and then to be captured; DefaultTimeout if zero. Keep it
	// below the plugin's own (cni.DefaultTimeout).
	Timeout time.Duration
	// MaxConns bounds the requests served at once, MaxPending the
	// announcements held; defaults DefaultMaxConns, DefaultMaxPending.
	MaxConns, MaxPending int
	// AllowUID is the peer user id allowed besides root (tests); -1 or 0:
	// root only.
	AllowUID int
	Logger   zerolog.Logger
}

// Defaults of Config.
const (
	DefaultTimeout    = 20 * time.Second
	DefaultMaxConns   = 32
	DefaultMaxPending = 256
)

// announcement is a pod's addresses from its CNI ADD, held until the API
// server shows them.
type announcement struct {
	uid         string
	containerID string
	addrs       []netip.Addr
	link        string
	since       time.Time
}

// Gate serves the plugin and holds the announcements.
type Gate struct {
	cfg Config
	log zerolog.Logger

	mu       sync.Mutex
	pending  map[registry.WorkloadRef]*announcement
	captured map[registry.WorkloadRef][]netip.Addr // the node's last report
	changed  chan struct{}                         // closed and replaced at every report
	exempt   []string                              // last written to StateFile
}

// New returns a gate; Serve serves it.
func New(cfg Config) *Gate {
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.MaxConns == 0 {
		cfg.MaxConns = DefaultMaxConns
	}
	if cfg.MaxPending == 0 {
		cfg.MaxPending = DefaultMaxPending
	}
	return &Gate{
		cfg: cfg, log: cfg.Logger.With().Str("component", "cni-gate").Logger(),
		pending: map[registry.WorkloadRef]*announcement{}, captured: map[registry.WorkloadRef][]netip.Addr{},
		changed: make(chan struct{}),
	}
}

// Announced returns the addresses announced for pod namespace/name of uid
// (any uid if uid or the announcement's is empty); the model uses them
// while the API server shows none.
func (g *Gate) Announced(namespace, name, uid string) []netip.Addr {
	g.mu.Lock()
	defer g.mu.Unlock()
	a := g.pending[registry.WorkloadRef{Namespace: namespace, Name: name}]
	if a == nil || uid != "" && a.uid != "" && uid != a.uid {
		return nil
	}
	return slices.Clone(a.addrs)
}

// LinkHint returns the host link announced for address a: the node finds
// a pod's link from its route, and uses this when it finds none.
func (g *Gate) LinkHint(a netip.Addr) (string, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, p := range g.pending {
		if p.link != "" && slices.Contains(p.addrs, a) {
			return p.link, true
		}
	}
	return "", false
}

// Pending returns how many announcements are held.
func (g *Gate) Pending() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.pending)
}

// Captured takes the node's report of its captured local workloads
// (node.Config.CapturedWorkloads), wakes the ADDs waiting for them, drops
// the announcements the API server has caught up with or that are over,
// and rewrites the state file if the namespaces outside the mesh changed.
func (g *Gate) Captured(ws []*registry.Workload) {
	g.mu.Lock()
	g.captured = make(map[registry.WorkloadRef][]netip.Addr, len(ws))
	for _, w := range ws {
		g.captured[registry.WorkloadRef{Namespace: w.Namespace, Name: w.Name}] = w.Addresses
	}
	close(g.changed)
	g.changed = make(chan struct{})
	dropped := g.expireLocked()
	g.mu.Unlock()
	if dropped {
		g.cfg.Pods.Rebuild()
	}
	if err := g.WriteState(); err != nil {
		g.log.Error().Err(err).Str("state_file", g.cfg.StateFile).Msg("write the CNI plugin's state file")
	}
}

// expireLocked drops the announcements that are no longer needed: the pod
// is gone, replaced, ended, or running with IPs in its status (its own,
// which the model now uses; or others, which win). A pending pod keeps its
// announcement while its init containers run: the model makes a workload
// of a pending pod only with one.
func (g *Gate) expireLocked() bool {
	dropped := false
	for ref, a := range g.pending {
		p, ok := g.cfg.Pods.Pod(ref.Namespace, ref.Name)
		why := ""
		switch {
		case !ok:
			why = "pod gone from the API server"
		case a.uid != "" && p.UID != a.uid:
			why = "pod replaced"
		case p.Ended:
			why = "pod ended"
		case p.Running && len(p.Addresses) > 0:
			why = "API server shows the pod running with its IPs"
		}
		if why != "" {
			delete(g.pending, ref)
			dropped = true
			g.log.Info().Str("pod", ref.String()).Str("why", why).Dur("held", time.Since(a.since)).Msg("announcement dropped")
		}
	}
	return dropped
}

// WriteState writes the namespaces outside the mesh to the state file if
// they changed since the last write.
func (g *Gate) WriteState() error {
	if g.cfg.StateFile == "" {
		return nil
	}
	ex := g.cfg.Pods.Exempt()
	slices.Sort(ex)
	g.mu.Lock()
	same := g.exempt != nil && slices.Equal(ex, g.exempt)
	g.mu.Unlock()
	if same {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(g.cfg.StateFile), 0o700); err != nil {
		return err
	}
	if err := cni.WriteState(g.cfg.StateFile, &cni.State{Node: g.cfg.Node, Written: time.Now().UTC(), Exempt: ex}); err != nil {
		return err
	}
	g.mu.Lock()
	g.exempt = append([]string{}, ex...)
	g.mu.Unlock()
	return nil
}

// Listen makes the socket's directory (0700), removes a socket a previous
// run left, and listens (0600).
func (g *Gate) Listen() (net.Listener, error) {
	dir := filepath.Dir(g.cfg.Socket)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("gate: socket directory: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("gate: socket directory: %w", err)
	}
	if err := os.Remove(g.cfg.Socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("gate: stale socket: %w", err)
	}
	l, err := net.Listen("unix", g.cfg.Socket)
	if err != nil {
		return nil, fmt.Errorf("gate: %w", err)
	}
	if err := os.Chmod(g.cfg.Socket, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("gate: socket mode: %w", err)
	}
	return l, nil
}

// Serve answers the plugin on the socket until ctx ends, then removes the
// socket: from then on the plugin finds no node and fails closed.
func (g *Gate) Serve(ctx context.Context) error {
	l, err := g.Listen()
	if err != nil {
		return err
	}
	return g.ServeListener(ctx, l)
}

// ServeListener serves on l until ctx ends, and closes l.
func (g *Gate) ServeListener(ctx context.Context, l net.Listener) error {
	g.log.Info().Str("socket", g.cfg.Socket).Msg("CNI startup gate serving")
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	sem := make(chan struct{}, g.cfg.MaxConns)
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				g.log.Info().Str("socket", g.cfg.Socket).Msg("CNI startup gate closed")
				return nil
			}
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue
			}
			return fmt.Errorf("gate: accept: %w", err)
		}
		select {
		case sem <- struct{}{}:
		default:
			wg.Go(func() {
				g.reply(c, &cni.Response{Verdict: cni.Refused, Reason: "node busy: too many CNI requests at once"})
				c.Close()
			})
			continue
		}
		wg.Go(func() {
			defer func() { <-sem }()
			defer c.Close()
			g.serveConn(ctx, c)
		})
	}
}

func (g *Gate) reply(c net.Conn, r *cni.Response) {
	c.SetWriteDeadline(time.Now().Add(time.Second))
	data, _ := jsonLine(r)
	c.Write(data)
}

func (g *Gate) serveConn(ctx context.Context, c net.Conn) {
	if err := g.checkPeer(c); err != nil {
		g.log.Warn().Err(err).Msg("CNI request refused")
		g.reply(c, &cni.Response{Verdict: cni.Refused, Reason: err.Error()})
		return
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	var req cni.Request
	if err := cni.ReadMessage(c, &req); err != nil {
		g.reply(c, &cni.Response{Verdict: cni.Refused, Reason: "bad request: " + err.Error()})
		return
	}
	if err := req.Validate(); err != nil {
		g.reply(c, &cni.Response{Verdict: cni.Refused, Reason: err.Error()})
		return
	}
	rctx, cancel := context.WithTimeout(ctx, g.cfg.Timeout)
	defer cancel()
	var resp *cni.Response
	if req.Command == cni.CommandDel {
		resp = g.del(&req)
	} else {
		resp = g.add(rctx, &req)
	}
	g.reply(c, resp)
}

// checkPeer accepts root (and AllowUID) only.
func (g *Gate) checkPeer(c net.Conn) error {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return err
	}
	if cerr != nil {
		return fmt.Errorf("gate: peer credentials: %w", cerr)
	}
	if cred.Uid != 0 && (g.cfg.AllowUID <= 0 || int(cred.Uid) != g.cfg.AllowUID) {
		return fmt.Errorf("gate: peer uid %d (pid %d) is not root", cred.Uid, cred.Pid)
	}
	return nil
}

// add serves an ADD.
func (g *Gate) add(ctx context.Context, req *cni.Request) *cni.Response {
	ref := registry.WorkloadRef{Namespace: req.Namespace, Name: req.Name}
	log := g.log.With().Str("pod", ref.String()).Str("container", shortID(req.ContainerID)).Logger()
	start := time.Now()
	// The kubelet knows the pod before this node's caches may: wait for
	// it (and for a replaced pod's new uid) up to the timeout.
	var pod Pod
	for {
		p, ok := g.cfg.Pods.Pod(req.Namespace, req.Name)
		if ok && (req.UID == "" || p.UID == req.UID) {
			pod = p
			break
		}
		select {
		case <-ctx.Done():
			log.Warn().Msg("CNI ADD refused: the pod is not in this node's API server caches")
			return &cni.Response{Verdict: cni.Refused, Reason: "pod " + ref.String() + " is not in the node's API server caches yet"}
		case <-time.After(50 * time.Millisecond):
		}
	}
	if pod.Node != "" && g.cfg.Node != "" && pod.Node != g.cfg.Node {
		return &cni.Response{Verdict: cni.Refused, Reason: "pod " + ref.String() + " is scheduled to node " + pod.Node + ", not " + g.cfg.Node}
	}
	if !pod.InMesh {
		log.Debug().Str("reason", pod.Reason).Msg("CNI ADD: not in the mesh, pass")
		return &cni.Response{Verdict: cni.Pass, Reason: pod.Reason}
	}
	g.mu.Lock()
	if _, held := g.pending[ref]; !held && len(g.pending) >= g.cfg.MaxPending {
		g.mu.Unlock()
		log.Warn().Int("pending", g.cfg.MaxPending).Msg("CNI ADD refused: too many pods waiting for the API server")
		return &cni.Response{Verdict: cni.Refused, Reason: fmt.Sprintf("node holds %d pods not yet shown by the API server", g.cfg.MaxPending)}
	}
	a := &announcement{uid: req.UID, containerID: req.ContainerID, addrs: slices.Clone(req.Addresses), link: req.HostLink, since: start}
	if a.uid == "" {
		a.uid = pod.UID
	}
	g.pending[ref] = a
	g.mu.Unlock()
	g.cfg.Pods.Rebuild()
	for {
		g.mu.Lock()
		got, ok := g.captured[ref]
		done := ok && containsAll(got, req.Addresses)
		wait := g.changed
		g.mu.Unlock()
		if done {
			log.Info().Strs("addresses", addrStrings(req.Addresses)).Str("host_link", req.HostLink).Dur("took", time.Since(start)).Msg("CNI ADD: pod captured before its sandbox starts")
			return &cni.Response{Verdict: cni.Captured}
		}
		select {
		case <-wait:
		case <-ctx.Done():
			g.withdraw(ref, req.ContainerID)
			log.Error().Strs("addresses", addrStrings(req.Addresses)).Msg("CNI ADD refused: the pod was not captured in time (certificate, host link or rules); the kubelet retries")
			return &cni.Response{Verdict: cni.Refused, Reason: "pod " + ref.String() + " not captured in time (certificate, host link or capture rules)"}
		}
	}
}

// del serves a DEL: the announcement of that sandbox goes.
func (g *Gate) del(req *cni.Request) *cni.Response {
	g.withdraw(registry.WorkloadRef{Namespace: req.Namespace, Name: req.Name}, req.ContainerID)
	return &cni.Response{Verdict: cni.Done}
}

// withdraw drops the announcement of ref made by sandbox containerID.
func (g *Gate) withdraw(ref registry.WorkloadRef, containerID string) {
	g.mu.Lock()
	a := g.pending[ref]
	drop := a != nil && a.containerID == containerID
	if drop {
		delete(g.pending, ref)
	}
	g.mu.Unlock()
	if drop {
		g.log.Info().Str("pod", ref.String()).Str("container", shortID(containerID)).Msg("announcement withdrawn")
		g.cfg.Pods.Rebuild()
	}
}

func containsAll(have, want []netip.Addr) bool {
	for _, a := range want {
		if !slices.Contains(have, a.Unmap()) {
			return false
		}
	}
	return true
}

func addrStrings(as []netip.Addr) []string {
	out := make([]string, len(as))
	for i, a := range as {
		out[i] = a.String()
	}
	return out
}

func shortID(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}
