package node

import (
	"context"
	"net"
	"net/netip"
	"strconv"

	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/tun"
)

// kernelHBONE terminates inbound HBONE on a kernel socket: a transparent
// listener on port 15008 (all addresses), and the rules that deliver a
// local pod's port 15008 to it (tun.LocalDelivery), installed after the
// capture rules of InstallRouting. The TLS leg then has the kernel's TCP
// (segmentation and receive offloads) instead of a netstack leg through
// the TUN; the workload leg stays on the netstack. If the kernel lacks
// what it needs (rules on ipproto/dport, IP_TRANSPARENT) or the port is
// taken, it logs a warning and returns nil: HBONE stays on the netstack
// path, which capturePolicy keeps selecting for any port 15008 the rules
// do not cover.
func (n *node) kernelHBONE(ctx context.Context, locals []*registry.Workload) *tun.LocalDelivery {
	log := n.log.With().Str("fallback", "netstack").Logger()
	lc := net.ListenConfig{Control: tun.TransparentSocket}
	ln, err := lc.Listen(ctx, "tcp", ":"+strconv.Itoa(hbone.Port))
	if err != nil {
		log.Warn().Err(err).Msg("inbound HBONE: no transparent listener on the node; terminating on the netstack")
		return nil
	}
	// The replies to outbound HBONE dialled from a client pod's address
	// come the same way, unless the node dials from its own.
	var replies tun.PortRange
	if n.cfg.HBONESource != HBONESourceNode {
		replies = HBONEClientPorts
	}
	ld, err := tun.InstallLocalDelivery(tun.LocalDeliveryConfig{
		Port: hbone.Port, Pods: podAddrs(locals), Replies: replies,
	})
	if err != nil {
		ln.Close()
		log.Warn().Err(err).Msg("inbound HBONE: cannot deliver the pods' port 15008 to the node; terminating on the netstack")
		return nil
	}
	// The listener answers from the pods' addresses: its packets skip the
	// spoof rules while it holds the port.
	if err := n.routes.SetLocalDelivery(hbone.Port, replies); err != nil {
		ld.Close()
		ln.Close()
		log.Warn().Err(err).Msg("inbound HBONE: cannot exempt the listener's replies from the spoof rules; terminating on the netstack")
		return nil
	}
	if v4, v6 := ld.Families(); !v4 || !v6 {
		n.log.Warn().Bool("ipv4", v4).Bool("ipv6", v6).Msg("inbound HBONE: local delivery for one address family only; the other terminates on the netstack")
	}
	// A connection to the node's own port 15008 is answered from the
	// node's address: exempt like the other listeners.
	release := n.exempt.AddListener(ln.Addr().(*net.TCPAddr).AddrPort())
	go func() {
		defer release()
		if err := n.px.ServeHBONE(ctx, ln); err != nil {
			// Without a listener the rules would blackhole port 15008:
			// remove them, so that the netstack takes it again.
			cerr := ld.Close()
			rerr := n.routes.SetLocalDelivery(0, tun.PortRange{})
			n.losePodSource()
			n.log.Error().Err(err).AnErr("remove_rules", cerr).AnErr("remove_exemption", rerr).Msg("inbound HBONE listener stopped; terminating on the netstack")
		}
	}()
	return ld
}

// losePodSource is called when the replies to outbound HBONE from a pod's
// address are no longer delivered: auto falls back to the node's address,
// a required pod source fails every outbound HBONE dial from then on.
func (n *node) losePodSource() {
	if n.podSource.Load() == podSourceOff {
		return
	}
	if n.cfg.HBONESource == HBONESourcePod {
		n.podSource.Store(podSourceFailed)
		n.log.Error().Msg("outbound HBONE from the client pod's address is required (--hbone-source pod) and its replies are no longer delivered: outbound HBONE fails")
		return
	}
	n.podSource.Store(podSourceOff)
	n.log.Warn().Msg("outbound HBONE: the replies to the pods' addresses are no longer delivered; dialling from the node's address (the client travels in forwarded only)")
}

// podAddrs returns the workloads' addresses.
func podAddrs(ws []*registry.Workload) []netip.Addr {
	var out []netip.Addr
	for _, w := range ws {
		out = append(out, w.Addresses...)
	}
	return out
}
