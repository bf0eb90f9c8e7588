package node

import (
	"context"
	"net"
	"net/netip"
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/test/fixture"
	"github.com/meshtun/meshtun/tun"
)

// BenchmarkHBONEDial compares the dial of an outbound HBONE connection
// from a pod's address (podDialer: transparent socket, SO_REUSEADDR, bind
// to a port of the range, the replies delivered by LocalDelivery's rule)
// with the plain dial from the node's address: connect and close (RST)
// to a listener on port 15008 in a peer namespace behind a veth. It
// measures the dial path only, no TLS.
func BenchmarkHBONEDial(b *testing.B) {
	fixture.PrivateNetns(b)
	nodeNS, err := netns.Get()
	if err != nil {
		b.Fatal(err)
	}
	defer nodeNS.Close()
	peerNS, err := netns.New() // the thread is now in it
	if err != nil {
		b.Fatal(err)
	}
	defer peerNS.Close()
	must := func(err error) {
		b.Helper()
		if err != nil {
			b.Fatal(err)
		}
	}
	addr := func(l netlink.Link, p string) {
		a, err := netlink.ParseAddr(p)
		must(err)
		a.Flags = unix.IFA_F_NODAD
		must(netlink.AddrAdd(l, a))
	}
	pod := netip.MustParseAddr("198.18.8.1")
	peer := netip.MustParseAddrPort("198.18.9.2:15008")
	// In the peer namespace: lo, and the listener once the link is there.
	lo, err := netlink.LinkByName("lo")
	must(err)
	must(netlink.LinkSetUp(lo))
	must(netns.Set(nodeNS))
	up := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "up0"}, PeerName: "up0p"}
	must(netlink.LinkAdd(up))
	upp, err := netlink.LinkByName("up0p")
	must(err)
	must(netlink.LinkSetNsFd(upp, int(peerNS)))
	must(netlink.LinkSetUp(up))
	addr(up, "198.18.9.1/24")
	ld, err := tun.InstallLocalDelivery(tun.LocalDeliveryConfig{Port: 15008, Pods: []netip.Addr{pod}, Replies: HBONEClientPorts})
	must(err)
	defer ld.Close()
	must(netns.Set(peerNS))
	upp, err = netlink.LinkByName("up0p")
	must(err)
	must(netlink.LinkSetUp(upp))
	addr(upp, "198.18.9.2/24")
	must(netlink.RouteAdd(&netlink.Route{Dst: &net.IPNet{IP: net.IPv4(198, 18, 8, 0), Mask: net.CIDRMask(24, 32)}, Gw: net.ParseIP("198.18.9.1")}))
	ln, err := net.Listen("tcp4", peer.String())
	must(err)
	defer ln.Close()
	must(netns.Set(nodeNS))
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				// Until the client's reset: a server that reset
				// first could reset the connect itself.
				c.Read(make([]byte, 1))
				c.Close()
			}()
		}
	}()

	var state atomic.Int32
	state.Store(podSourceOn)
	pd := &podDialer{ports: HBONEClientPorts, state: &state}
	nd := &net.Dialer{}
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		dial func() (net.Conn, error)
	}{
		{"node", func() (net.Conn, error) { return nd.DialContext(ctx, "tcp4", peer.String()) }},
		{"pod", func() (net.Conn, error) { return pd.dial(ctx, pod, peer) }},
		{"node-again", func() (net.Conn, error) { return nd.DialContext(ctx, "tcp4", peer.String()) }},
		{"pod-again", func() (net.Conn, error) { return pd.dial(ctx, pod, peer) }},
	} {
		b.Run(tc.name, func(b *testing.B) {
			// A sub-benchmark runs on a goroutine of its own: into
			// the node's namespace first (the thread ends with it).
			runtime.LockOSThread()
			if err := netns.Set(nodeNS); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				c, err := tc.dial()
				if err != nil {
					b.Fatal(err)
				}
				c.(*net.TCPConn).SetLinger(0)
				c.Close()
			}
		})
	}
}
