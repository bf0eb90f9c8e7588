package node

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/tun"
)

// The values of Config.HBONESource: where outbound HBONE connections are
// dialled from.
const (
	// HBONESourceAuto dials from the client pod's address where the
	// kernel can deliver the replies (the kernel inbound HBONE path is
	// up), from the node's otherwise, with a warning. The default.
	HBONESourceAuto = "auto"
	// HBONESourcePod requires the client pod's address: the node does not
	// start without it, and if it is lost later, outbound HBONE fails.
	HBONESourcePod = "pod"
	// HBONESourceNode dials from the node's address (the client travels
	// in the forwarded header only), as before.
	HBONESourceNode = "node"
)

// HBONEClientPorts are the local ports of outbound HBONE connections
// dialled from a client pod's address: above the kernel's default
// ephemeral range (32768-60999), so that a pod's own connection to some
// server's port 15008 (a passthrough, whose replies must reach the pod)
// normally leaves from a port outside it. The replies to these ports, from
// port 15008, are delivered to the node's sockets (tun.LocalDelivery).
var HBONEClientPorts = tun.PortRange{Lo: 64512, Hi: 65534}

// podSource states (node.podSource).
const (
	podSourceOff    int32 = iota // dial from the node's address
	podSourceOn                  // dial from the client pod's address
	podSourceFailed              // required and lost: outbound HBONE fails
)

// errPodSourceLost refuses an outbound HBONE dial while HBONESourcePod
// is required and the rules that deliver the replies are gone.
var errPodSourceLost = errors.New("node: outbound HBONE must leave from the client pod's address (--hbone-source pod) and the rules that deliver its replies are gone")

// hboneFromPod reports whether outbound HBONE of local pod address src
// leaves from src: with auto, only while the replies to src are delivered
// (its rules are in: a family without a local route, or a pod whose rules
// are not in yet, dials from the node's address); with pod required,
// always (a dial whose replies cannot come back fails: closed).
func (n *node) hboneFromPod(src netip.Addr) bool {
	switch n.podSource.Load() {
	case podSourceOff:
		return false
	case podSourceFailed:
		return true
	}
	if n.cfg.HBONESource == HBONESourcePod {
		return true
	}
	return n.local != nil && n.local.Covers(src)
}

// podDialer opens outbound HBONE connections from a client pod's address:
// a transparent socket (IP_TRANSPARENT: binding an address the node does
// not own, CAP_NET_ADMIN) bound to one of ports, SO_REUSEADDR so that
// connections to different peers share a port (the kernel refuses a
// second connection of the same four-tuple at connect, EADDRNOTAVAIL,
// and the next port is tried).
type podDialer struct {
	ports tun.PortRange
	state *atomic.Int32
}

// maxPortTries bounds the ports one dial tries before it fails.
const maxPortTries = 64

// dial connects from from (a port of d.ports) to endpoint. It fails
// rather than fall back to the node's address: the peer would evaluate
// the client's source-IP rules on the node's address (docs/decisions,
// "outbound HBONE from the pod's address").
func (d *podDialer) dial(ctx context.Context, from netip.Addr, endpoint netip.AddrPort) (net.Conn, error) {
	if d.state.Load() == podSourceFailed {
		return nil, errPodSourceLost
	}
	network := "tcp4"
	if !from.Unmap().Is4() {
		network = "tcp6"
	}
	n := int(d.ports.Hi) - int(d.ports.Lo) + 1
	start := rand.IntN(n)
	var err error
	for i := range min(n, maxPortTries) {
		port := d.ports.Lo + uint16((start+i)%n)
		var c net.Conn
		c, err = dialFromPort(ctx, network, netip.AddrPortFrom(from.Unmap(), port), endpoint)
		if err == nil {
			return c, nil
		}
		if !errors.Is(err, syscall.EADDRINUSE) && !errors.Is(err, syscall.EADDRNOTAVAIL) {
			return nil, err
		}
	}
	return nil, fmt.Errorf("node: no free local port in %s of %s for %s after %d tries: %w", d.ports, from, endpoint, min(n, maxPortTries), err)
}

// dialFromPort connects a transparent socket bound to local to remote.
func dialFromPort(ctx context.Context, network string, local, remote netip.AddrPort) (net.Conn, error) {
	dl := net.Dialer{Control: func(network, address string, c syscall.RawConn) error {
		if err := tun.TransparentSocket(network, address, c); err != nil {
			return err
		}
		var serr error
		if err := c.Control(func(fd uintptr) {
			if serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); serr != nil {
				return
			}
			var sa unix.Sockaddr
			if local.Addr().Is4() {
				sa = &unix.SockaddrInet4{Addr: local.Addr().As4(), Port: int(local.Port())}
			} else {
				sa = &unix.SockaddrInet6{Addr: local.Addr().As16(), Port: int(local.Port())}
			}
			if serr = unix.Bind(int(fd), sa); serr != nil {
				serr = &net.OpError{Op: "bind", Net: network, Addr: net.TCPAddrFromAddrPort(local), Err: serr}
			}
		}); err != nil {
			return err
		}
		return serr
	}}
	return dl.DialContext(ctx, network, remote.String())
}
