package proxy

import (
	"net/netip"

	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/stack/classify"
)

// Flow is what the node does with a TCP connection: the capture decision,
// made in this one place for the classifier (CapturePolicy: which SYNs the
// netstack takes) and for HandleTCP (which path carries what it took).
type Flow uint8

const (
	// Verbatim: not captured; the packets pass the TUN as they are.
	Verbatim Flow = iota
	// Outbound: opened by a local mesh workload.
	Outbound
	// InboundHBONE: HBONE (port 15008) to a local mesh workload.
	InboundHBONE
	// InboundPlain: plaintext to a local mesh workload, authorized
	// without an identity (refused under STRICT).
	InboundPlain
)

// Decide returns the flow of a connection from src to dst in snap, for the
// node named node (fromNode: a source address of the node's own), with the
// workloads at both ends (nil if none):
//
//   - HBONE to a local mesh workload, and connections opened by one, are
//     captured;
//   - plaintext to a local mesh workload is captured from a mesh workload
//     (its own node should have tunnelled it) and wherever STRICT mode or
//     an authorization policy protects the port, also from the node
//     itself, except the node's connections to the workload's probe ports;
//   - everything else stays verbatim: plaintext to an unprotected
//     PERMISSIVE workload reaches it directly, and so do the node's probes.
//
// The classifier also asks, for a segment of no known flow, about both
// orientations of the connection, and keeps the segment from going out
// verbatim when both are captured. So mesh-to-mesh is captured both ways
// (their traffic must never be verbatim), and the node's probes are not
// (their replies must stay verbatim).
func Decide(snap *registry.Snapshot, node string, src, dst netip.AddrPort, fromNode func(netip.Addr) bool) (f Flow, sw, dw *registry.Workload) {
	sw, dw = snap.Workload(src.Addr()), snap.Workload(dst.Addr())
	local := func(w *registry.Workload) bool { return w.CapturedBy(node) }
	switch {
	case local(dw) && dst.Port() == hbone.Port:
		return InboundHBONE, sw, dw
	case local(sw):
		return Outbound, sw, dw
	case !local(dw):
		return Verbatim, sw, dw
	case sw != nil && sw.InMesh:
		return InboundPlain, sw, dw
	case dw.ProbePort(dst.Port()) && fromNode != nil && fromNode(src.Addr()):
		return Verbatim, sw, dw
	case dw.Protected(dst.Port()):
		return InboundPlain, sw, dw
	}
	return Verbatim, sw, dw
}

// CapturePolicy is the classifier's policy of the node named node: the
// connections Decide captures, by reg's current model.
func CapturePolicy(reg *registry.Registry, node string, fromNode func(netip.Addr) bool) classify.Policy {
	return classify.PolicyFunc(func(src, dst netip.AddrPort) bool {
		f, _, _ := Decide(reg.Load(), node, src, dst, fromNode)
		return f != Verbatim
	})
}
