package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/meshtun/meshtun/mesh/metrics"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/stack"
	"github.com/meshtun/meshtun/stack/classify"
	"github.com/meshtun/meshtun/test/fixture"
)

// memDev is test/fixture's device in memory, without a virtio-net
// header; a write the test does not read in time is dropped.
type memDev struct{ *fixture.MemDevice }

func newMemDev() memDev {
	d := fixture.NewMemDevice(0, 1024)
	d.Drop = true
	return memDev{d}
}

// syn returns an IPv4 TCP SYN from src to dst.
func syn(src, dst netip.AddrPort) []byte {
	b := make([]byte, header.IPv4MinimumSize+header.TCPMinimumSize)
	s, d := tcpip.AddrFrom4(src.Addr().As4()), tcpip.AddrFrom4(dst.Addr().As4())
	ip := header.IPv4(b)
	ip.Encode(&header.IPv4Fields{TotalLength: uint16(len(b)), TTL: 64, Protocol: uint8(header.TCPProtocolNumber), SrcAddr: s, DstAddr: d})
	ip.SetChecksum(^ip.CalculateChecksum())
	th := header.TCP(b[header.IPv4MinimumSize:])
	th.Encode(&header.TCPFields{SrcPort: src.Port(), DstPort: dst.Port(), SeqNum: 1000, DataOffset: header.TCPMinimumSize, Flags: header.TCPFlagSyn, WindowSize: 65535})
	th.SetChecksum(^checksum.Checksum(th, header.PseudoHeaderChecksum(header.TCPProtocolNumber, s, d, header.TCPMinimumSize)))
	return b
}

// segment is a TCP segment the device saw going out.
type segment struct {
	src, dst netip.AddrPort
	flags    header.TCPFlags
}

// next returns the next TCP segment written to d that match accepts.
func (d memDev) next(t *testing.T, match func(segment) bool) (segment, bool) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case p := <-d.Out:
			ip := header.IPv4(p)
			if len(p) < header.IPv4MinimumSize || ip.TransportProtocol() != header.TCPProtocolNumber {
				continue
			}
			th := header.TCP(ip.Payload())
			s := segment{
				src:   netip.AddrPortFrom(netip.AddrFrom4(ip.SourceAddress().As4()), th.SourcePort()),
				dst:   netip.AddrPortFrom(netip.AddrFrom4(ip.DestinationAddress().As4()), th.DestinationPort()),
				flags: th.Flags(),
			}
			if match(s) {
				return s, true
			}
		case <-deadline:
			return segment{}, false
		}
	}
}

// stackEnv is a Proxy of node n1 with a real netstack on a device in
// memory, every SYN intercepted.
type stackEnv struct {
	p      *Proxy
	dev    memDev
	access *syncBuffer
}

var (
	client11 = netip.MustParseAddr("198.18.1.11") // default/client, n1
	server12 = netip.MustParseAddr("198.18.1.12") // default/server, n1
)

func newStackEnv(t *testing.T, more ...*registry.Workload) *stackEnv {
	t.Helper()
	snap, err := registry.NewSnapshot(testTD, append([]*registry.Workload{
		{Name: "client", Namespace: "default", Node: "n1", InMesh: true, Addresses: []netip.Addr{client11}},
		{Name: "server", Namespace: "default", Node: "n1", InMesh: true, Addresses: []netip.Addr{server12}},
	}, more...))
	if err != nil {
		t.Fatal(err)
	}
	// The HBONE client is never used (both workloads are on this
	// node), but its presence selects the in-proxy path.
	hc, err := hbone.NewClient(hbone.ClientConfig{TLS: func(_, _ spiffeid.ID) (*tls.Config, error) {
		return nil, errors.New("test: no TLS")
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hc.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	e := &stackEnv{dev: newMemDev(), access: &syncBuffer{}}
	cls := classify.New(classify.Config{Policy: classify.PolicyFunc(func(_, _ netip.AddrPort) bool { return true })})
	st, err := stack.New(stack.Config{Device: e.dev, Classifier: cls, Logger: zerolog.New(zerolog.NewTestWriter(t))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.dev.Close(); st.Close() })
	e.p, err = New(ctx, Config{
		Node: "n1", Registry: registry.New(snap), HBONE: hc, Metrics: metrics.New(),
		Logger: zerolog.New(zerolog.NewTestWriter(t)), AccessLog: zerolog.New(e.access),
		ConnectTimeout: 2 * time.Second, Netstack: st,
		// An HBONE server, so that SYNs to port 15008 of a local
		// workload are inbound HBONE; no test here gets as far as its
		// TLS.
		Inbound: hbone.ServerConfig{
			TLS:    &tls.Config{ClientAuth: tls.RequireAnyClientCert},
			Logger: zerolog.New(zerolog.NewTestWriter(t)),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Start(e.p.HandleTCP); err != nil {
		t.Fatal(err)
	}
	return e
}

// refusedSYN sends a SYN from from to to and checks that the proxy
// answers it with a reset and dials nothing; it returns the connection's
// access record, or false (the failure reported) when there is none.
func (e *stackEnv) refusedSYN(t *testing.T, what string, from, to netip.AddrPort) (map[string]any, bool) {
	t.Helper()
	e.send(t, syn(from, to))
	s, ok := e.dev.next(t, func(s segment) bool {
		return s.dst == from || s.dst == to && s.flags == header.TCPFlagSyn
	})
	switch {
	case !ok:
		t.Fatalf("%s: no answer to the SYN", what)
	case s.dst == to:
		t.Errorf("%s: the proxy dialled %s", what, to)
		return nil, false
	case !s.flags.Contains(header.TCPFlagRst):
		t.Errorf("%s: the client got %v, want a reset", what, s.flags)
	}
	return e.access.WaitLine(t, func(l map[string]any) bool { return l["src.addr"] == from.String() }), true
}

func (e *stackEnv) send(t *testing.T, pkt []byte) {
	t.Helper()
	e.dev.Send(t, pkt)
}

// TestOutboundRefusedWhileDraining: after StopNew, a connection a local
// workload opens is reset at once, nothing is dialled for it, and the
// record says DRAIN; HBONE to a local workload is still taken (the HBONE
// server refuses its requests itself, so that it can say why).
func TestOutboundRefusedWhileDraining(t *testing.T) {
	e := newStackEnv(t)
	target := netip.AddrPortFrom(server12, 8080)

	// Control: before the drain the proxy dials the destination (in
	// proxy, through the netstack: a SYN from the client's address).
	e.send(t, syn(netip.AddrPortFrom(client11, 40000), target))
	if _, ok := e.dev.next(t, func(s segment) bool {
		return s.dst == target && s.src.Addr() == client11 && s.flags == header.TCPFlagSyn
	}); !ok {
		t.Fatal("before the drain: the proxy did not dial the destination")
	}

	e.p.StopNew()
	from := netip.AddrPortFrom(client11, 40001)
	e.send(t, syn(from, target))
	s, ok := e.dev.next(t, func(s segment) bool {
		return s.dst == from || s.dst == target && s.src.Addr() == client11 && s.flags == header.TCPFlagSyn
	})
	switch {
	case !ok:
		t.Fatal("while draining: no answer to the client's SYN")
	case s.dst == target:
		t.Fatalf("while draining: the proxy dialled the destination (%s -> %s)", s.src, s.dst)
	case !s.flags.Contains(header.TCPFlagRst):
		t.Fatalf("while draining: the client got %v, want a reset", s.flags)
	}
	rec := e.access.WaitLine(t, func(l map[string]any) bool { return l["src.addr"] == from.String() })
	if rec["response_flags"] != "DRAIN" || rec["message"] != "connection refused" || rec["route"] != "drain" {
		t.Errorf("access log of the refused connection: %v, want a refusal with response_flags DRAIN", rec)
	}

	// HBONE to a local workload is still accepted by the netstack.
	hb := netip.AddrPortFrom(server12, hbone.Port)
	from = netip.AddrPortFrom(client11, 40002)
	e.send(t, syn(from, hb))
	s, ok = e.dev.next(t, func(s segment) bool { return s.src == hb && s.dst == from })
	if !ok || s.flags != header.TCPFlagSyn|header.TCPFlagAck {
		t.Errorf("while draining, HBONE to a local workload got %v (answered: %v), want SYN-ACK", s.flags, ok)
	}
}
