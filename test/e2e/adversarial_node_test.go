package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
)

// TestNodeTrafficIsAuthorized: a process of the node itself (a socket in
// the node's namespace, like a hostNetwork pod or a node daemon) is
// treated like plaintext from outside the mesh: refused by a STRICT
// workload and by an ALLOW policy that names identities, admitted where a
// policy allows the node's address, and served directly on the ports a
// workload declares for probes. And a passthrough destination sees the
// pod's own address and port, not the node's.
//
//	n1p1 STRICT, probe port 7101
//	n1p2 PERMISSIVE, ALLOW from n1p3's identity, or from the node's
//	     addresses to port 7104
//	n1p3 mesh client
func TestNodeTrafficIsAuthorized(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "advnode", Nodes: 1, PodsPerNode: 3, Control: true})
	n1 := c.Nodes[0]
	strict, guarded, client, ext := n1.Pods[0], n1.Pods[1], n1.Pods[2], c.External
	m := noderun.Mesh{
		Pods: map[string]noderun.Pod{
			"n1p1": {Strict: true, ProbePorts: []uint16{7101}},
			"n1p2": {Labels: map[string]string{"app": "guarded"}},
		},
		Extra: fmt.Sprintf(`authorizationPolicies:
  - name: guarded-from-client
    namespace: default
    selector: {app: guarded}
    action: ALLOW
    rules:
      - from: [{principals: [cluster.local/ns/default/sa/n1p3]}]
      - from: [{ipBlocks: [%s/32, %s/32, "%s/128", "%s/128"]}]
        to: [{ports: [7104]}]
`, n1.IPv4, n1.Gateway4, n1.IPv6, n1.Gateway6),
	}
	mt := startWithConfig(t, n1, writeConfig(t, c, m))

	echoSrv := func(c net.Conn) { io.Copy(c, c) }
	// refused asserts that a connection from the node to dst is refused
	// (a reset to its SYN) and that the server never saw it.
	refused := func(t *testing.T, s *server, dst netip.AddrPort) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		cl, err := n1.Dial(ctx, "tcp", dst.String())
		if err == nil {
			cl.Close()
			t.Fatalf("node → %s: connected; want refused", dst)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("node → %s: %v, want connection refused", dst, err)
		}
		select {
		case p := <-s.peers:
			t.Fatalf("the workload received a connection from %s", p)
		default:
		}
		if _, err := mt.WaitLog(ctx, func(l noderun.Line) bool {
			return l.Str("message") == "connection refused" && l.Str("dst.addr") == dst.String() && l.Str("route") == "plaintext"
		}); err != nil {
			t.Fatalf("no access log of the refusal of node → %s: %v", dst, err)
		}
	}

	for _, v6 := range []bool{false, true} {
		family, addr := "IPv4", func(p *cluster.Pod) netip.Addr { return p.IPv4 }
		if v6 {
			family, addr = "IPv6", func(p *cluster.Pod) netip.Addr { return p.IPv6 }
		}
		port := func(base int) int {
			if v6 {
				return base + 100
			}
			return base
		}
		t.Run(family+" node to a STRICT workload is refused", func(t *testing.T) {
			s := serve(t, strict, port(7102), echoSrv)
			refused(t, s, netip.AddrPortFrom(addr(strict), uint16(port(7102))))
		})
		t.Run(family+" node to a PERMISSIVE workload an identity policy protects is refused", func(t *testing.T) {
			s := serve(t, guarded, port(7103), echoSrv)
			refused(t, s, netip.AddrPortFrom(addr(guarded), uint16(port(7103))))
			// The identity the policy names gets through (same node).
			cl := dial(t, client.NS, addr(guarded), port(7103))
			echo(t, cl)
			if p := s.peer(t); p.Addr() != addr(client) {
				t.Fatalf("workload saw %s, want the client %s", p, addr(client))
			}
		})
	}
	t.Run("node to a STRICT workload's probe port is served directly", func(t *testing.T) {
		s := serve(t, strict, 7101, echoSrv)
		for _, a := range []netip.Addr{strict.IPv4, strict.IPv6} {
			cl := dial(t, n1.NS, a, 7101)
			echo(t, cl)
			if peer, local := s.peer(t), localAddr(cl); peer != local {
				t.Fatalf("workload saw %s, the node's socket is %s: the probe was proxied", peer, local)
			}
		}
		// From anywhere else the probe port is an ordinary STRICT port.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if cl, err := ext.Dial(ctx, "tcp", netip.AddrPortFrom(strict.IPv4, 7101).String()); err == nil {
			cl.Close()
			t.Fatal("external host → the STRICT workload's probe port: connected; want refused")
		}
	})
	t.Run("node to a port a policy opens to the node's address is authorized and delivered", func(t *testing.T) {
		s := serve(t, guarded, 7104, echoSrv)
		for _, a := range []netip.Addr{guarded.IPv4, guarded.IPv6} {
			cl := dial(t, n1.NS, a, 7104)
			echo(t, cl)
			// Proxied (a kernel socket of the proxy, marked so that it is
			// not captured again): the node's address, another port.
			if peer, local := s.peer(t), localAddr(cl); peer.Addr() != local.Addr() || peer == local {
				t.Fatalf("workload saw %s, the node's socket is %s: want the node's address from the proxy's own socket", peer, local)
			}
			cl.Close()
			wantFields(t, accessLog(t, mt, cl, "connection complete"), "route", "plaintext", "direction", "inbound")
		}
	})
	t.Run("a pod reaches a server of the node (its replies cross the TUN verbatim)", func(t *testing.T) {
		s := serve(t, n1.NS, 7107, echoSrv)
		for _, a := range []netip.Addr{n1.Gateway4, n1.Gateway6} {
			cl := dial(t, client.NS, a, 7107)
			echo(t, cl)
			if peer, local := s.peer(t), localAddr(cl); peer != local {
				t.Fatalf("node saw %s, want the pod's own %s", peer, local)
			}
		}
	})
	t.Run("passthrough destination sees the pod's own address and port", func(t *testing.T) {
		s := serve(t, ext, 7105, exchangeServer(4<<20))
		for _, a := range []netip.Addr{ext.IPv4, ext.IPv6} {
			cl := dial(t, client.NS, a, 7105)
			exchange(t, cl, 4<<20)
			if peer, local := s.peer(t), localAddr(cl); peer != local {
				t.Fatalf("external host saw %s, want the pod's own %s", peer, local)
			}
			cl.Close()
			wantFields(t, accessLog(t, mt, cl, "connection complete"), "route", "passthrough")
		}
		// A closed port is refused as it would be without meshtun.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if cl, err := client.Dial(ctx, "tcp", netip.AddrPortFrom(ext.IPv4, 7106).String()); !errors.Is(err, syscall.ECONNREFUSED) {
			if err == nil {
				cl.Close()
			}
			t.Fatalf("pod → a closed port of the external host: %v, want connection refused", err)
		}
	})
}

// oldMark is the socket mark meshtun's rules used to exempt ("fwmark
// 0x6d74 lookup main"): any process with CAP_NET_RAW could set it.
const oldMark = 0x6d74

// TestForgedSocketMark: a process of the node (a thread of this test
// entering the node's namespace as uid 65534 with CAP_NET_RAW only, as a
// container's default capabilities allow) sets SO_MARK to the mark
// meshtun used to exempt its own sockets with and dials a STRICT pod of
// that node in plaintext: refused while meshtun runs (and logged as a
// refused plaintext connection), refused after meshtun is SIGKILLed, and a
// capture in the pod's namespace never shows the marker it writes if it
// connects.
func TestForgedSocketMark(t *testing.T) {
	mc := newMeshCluster(t, "fwmark")
	mc.m1 = mc.start(t, mc.n1)
	m2 := mc.start(t, mc.n2)
	strict := mc.p23 // STRICT, node 2
	srv := serve(t, strict, 7720, func(c net.Conn) { io.Copy(c, c) })
	onLink := sniff(t, strict.NS)

	attempt := func(what string, dst netip.AddrPort) {
		t.Helper()
		marker := []byte(fmt.Sprintf("MESHTUN-FORGED-MARK-%d-%s", time.Now().UnixNano(), what))
		creds, err := markedDial(mc.n2.NS, dst, oldMark, marker, 3*time.Second)
		t.Logf("%s: %s → %s: %v", what, creds, dst, err)
		if err == nil {
			t.Errorf("%s: a node process with SO_MARK %#x connected to the STRICT pod %s in plaintext", what, oldMark, dst)
		}
		if onLink.waitSeen(marker, 500*time.Millisecond) {
			t.Errorf("%s: the marker reached the STRICT pod's link in plaintext", what)
		}
		select {
		case p := <-srv.peers:
			t.Errorf("%s: the STRICT pod accepted a connection from %s", what, p)
		default:
		}
	}

	// The capture sees the pod's link: a mesh connection's bytes are
	// plaintext there (after node 2's proxy).
	control := []byte(fmt.Sprintf("MESHTUN-CONTROL-%d", time.Now().UnixNano()))
	cl := dial(t, mc.p11.NS, strict.IPv4, 7720)
	if _, err := cl.Write(control); err != nil {
		t.Fatal(err)
	}
	if !onLink.waitSeen(control, 10*time.Second) {
		t.Fatalf("the capture on the STRICT pod's link never saw a mesh connection's bytes (%d captured)", onLink.captured())
	}
	cl.Close()
	<-srv.peers

	for _, dst := range []netip.AddrPort{netip.AddrPortFrom(strict.IPv4, 7720), netip.AddrPortFrom(strict.IPv6, 7720)} {
		attempt("running", dst)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := m2.WaitLog(ctx, func(l noderun.Line) bool {
			return l.Str("message") == "connection refused" && l.Str("dst.addr") == dst.String() && l.Str("route") == "plaintext"
		})
		cancel()
		if err != nil {
			t.Errorf("no access log of the refusal of the marked node connection to %s: %v", dst, err)
		}
	}
	m2.Stop(syscall.SIGKILL)
	for _, dst := range []netip.AddrPort{netip.AddrPortFrom(strict.IPv4, 7720), netip.AddrPortFrom(strict.IPv6, 7720)} {
		attempt("killed", dst)
	}
	// The unprivileged threads are gone: the tests after this one still
	// run with the binary's privileges.
	if err := cluster.Preflight(); err != nil {
		t.Fatalf("after the unprivileged dials: %v", err)
	}
}

// markedDial connects to dst from ns as uid and gid 65534 holding
// CAP_NET_RAW only (effective and permitted), on a socket with SO_MARK
// mark, and writes marker if it connects. The credentials are set on a
// thread of its own (Linux credentials are per thread), which is never
// reused: its goroutine ends locked. It returns what the thread's
// /proc/thread-self/status said about its credentials, and the error of
// the dial (nil if it connected within timeout).
func markedDial(ns *cluster.NS, dst netip.AddrPort, mark int, marker []byte, timeout time.Duration) (string, error) {
	type result struct {
		creds string
		err   error
	}
	ch := make(chan result, 1)
	onFreshThread(func() {
		var res result
		defer func() { ch <- res }()
		target, err := netns.GetFromName(ns.Name())
		if err != nil {
			res.err = fmt.Errorf("open %s: %w", ns.Name(), err)
			return
		}
		err = netns.Set(target)
		target.Close()
		if err != nil {
			res.err = fmt.Errorf("enter %s: %w", ns.Name(), err)
			return
		}
		if err := dropToNetRaw(); err != nil {
			res.err = fmt.Errorf("drop privileges: %w", err)
			return
		}
		if b, err := os.ReadFile("/proc/thread-self/status"); err == nil {
			for _, l := range strings.Split(string(b), "\n") {
				if strings.HasPrefix(l, "Uid:") || strings.HasPrefix(l, "CapEff:") || strings.HasPrefix(l, "CapPrm:") {
					res.creds += strings.Join(strings.Fields(l), " ") + "; "
				}
			}
		}
		res.err = dialMarked(dst, mark, marker, timeout)
	})
	r := <-ch
	return r.creds, r.err
}

// onFreshThread runs fn on a goroutine locked to a thread that is not the
// process's main thread, and never unlocks it: the Go runtime ends the
// thread with the goroutine, so whatever fn does to the thread's
// credentials or namespace dies with it. (The main thread cannot end: it
// would stay, and /proc/self, which shows the main thread, would show its
// credentials to the rest of the test binary.)
func onFreshThread(fn func()) {
	done := make(chan struct{})
	go func() {
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			// While this goroutine holds the main thread, the next one
			// runs on another.
			onFreshThread(fn)
			runtime.UnlockOSThread()
			close(done)
			return
		}
		defer close(done)
		fn()
	}()
	<-done
}

// dialMarked connects to dst on a socket with SO_MARK mark from the
// calling thread, and writes marker if it connects.
func dialMarked(dst netip.AddrPort, mark int, marker []byte, timeout time.Duration) error {
	family := unix.AF_INET6
	var sa unix.Sockaddr = &unix.SockaddrInet6{Addr: dst.Addr().As16(), Port: int(dst.Port())}
	if dst.Addr().Is4() {
		family = unix.AF_INET
		sa = &unix.SockaddrInet4{Addr: dst.Addr().As4(), Port: int(dst.Port())}
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, mark); err != nil {
		return fmt.Errorf("SO_MARK %#x with CAP_NET_RAW (Linux >= 5.17 allows it): %w", mark, err)
	}
	if err := unix.Connect(fd, sa); err != nil && !errors.Is(err, unix.EINPROGRESS) {
		return fmt.Errorf("connect: %w", err)
	}
	pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
	n, err := unix.Poll(pfd, int(timeout.Milliseconds()))
	if err != nil {
		return err
	}
	if n == 0 {
		return fmt.Errorf("connect: timed out after %v", timeout)
	}
	if serr, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR); serr != 0 {
		return fmt.Errorf("connect: %w", syscall.Errno(serr))
	}
	unix.Write(fd, marker) // queued: the close sends it before its FIN
	return nil
}

// dropToNetRaw makes the calling thread uid and gid 65534 with
// CAP_NET_RAW as its only effective and permitted capability, with raw
// system calls (the syscall package's would change every thread).
func dropToNetRaw() error {
	if _, _, e := unix.RawSyscall(unix.SYS_PRCTL, unix.PR_SET_KEEPCAPS, 1, 0); e != 0 {
		return fmt.Errorf("PR_SET_KEEPCAPS: %w", e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, 0, 0, 0); e != 0 {
		return fmt.Errorf("setgroups: %w", e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, 65534, 65534, 65534); e != 0 {
		return fmt.Errorf("setresgid: %w", e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, 65534, 65534, 65534); e != 0 {
		return fmt.Errorf("setresuid: %w", e)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := [2]unix.CapUserData{{Effective: 1 << unix.CAP_NET_RAW, Permitted: 1 << unix.CAP_NET_RAW}}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return nil
}
