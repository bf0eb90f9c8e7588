package classify

import (
	"net/netip"
	"testing"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
)

// TestGVisorPackets cross-checks the parser against packets built by
// gVisor's own encoders (the netstack meshtun runs), and the test
// builders against gVisor's validation.
func TestGVisorPackets(t *testing.T) {
	tcpFields := func(src, dst netip.AddrPort, flags header.TCPFlags) *header.TCPFields {
		return &header.TCPFields{
			SrcPort: src.Port(), DstPort: dst.Port(), SeqNum: 7, AckNum: 8,
			DataOffset: header.TCPMinimumSize, Flags: flags, WindowSize: 1024,
		}
	}
	gv4 := func(src, dst netip.AddrPort, flags header.TCPFlags) []byte {
		b := make([]byte, header.IPv4MinimumSize+header.TCPMinimumSize)
		header.IPv4(b).Encode(&header.IPv4Fields{
			TotalLength: uint16(len(b)), TTL: 64, Protocol: uint8(header.TCPProtocolNumber),
			SrcAddr: tcpip.AddrFrom4(src.Addr().As4()), DstAddr: tcpip.AddrFrom4(dst.Addr().As4()),
		})
		header.TCP(b[header.IPv4MinimumSize:]).Encode(tcpFields(src, dst, flags))
		return b
	}
	gv6 := func(src, dst netip.AddrPort, flags header.TCPFlags) []byte {
		ext := header.IPv6ExtHdrSerializer{header.IPv6SerializableHopByHopExtHdr{
			&header.IPv6RouterAlertOption{Value: header.IPv6RouterAlertMLD},
		}}
		b := make([]byte, header.IPv6MinimumSize+ext.Length()+header.TCPMinimumSize)
		header.IPv6(b).Encode(&header.IPv6Fields{
			PayloadLength:     uint16(len(b) - header.IPv6MinimumSize),
			TransportProtocol: header.TCPProtocolNumber, HopLimit: 64,
			SrcAddr: tcpip.AddrFrom16(src.Addr().As16()), DstAddr: tcpip.AddrFrom16(dst.Addr().As16()),
			ExtensionHeaders: ext,
		})
		header.TCP(b[header.IPv6MinimumSize+ext.Length():]).Encode(tcpFields(src, dst, flags))
		return b
	}

	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			build := gv4
			if fam.a.Addr().Is6() {
				build = gv6
			}
			var gotSrc, gotDst netip.AddrPort
			c := New(Config{Policy: PolicyFunc(func(src, dst netip.AddrPort) bool {
				gotSrc, gotDst = src, dst
				return true
			})})
			syn := build(fam.a, fam.b, header.TCPFlagSyn)
			if fam.a.Addr().Is6() && syn[6] != protoHopByHop {
				t.Fatalf("gVisor packet has next header %d, want hop-by-hop", syn[6])
			}
			expect(t, c, syn, Intercept, NoDrop)
			if gotSrc != fam.a || gotDst != fam.b {
				t.Fatalf("policy saw %v -> %v, want %v -> %v", gotSrc, gotDst, fam.a, fam.b)
			}
			c.Outbound(build(fam.b, fam.a, header.TCPFlagSyn|header.TCPFlagAck))
			if f := c.flowOf(t, fam.a, fam.b); f.state != stateSyn {
				t.Fatalf("state %d after gVisor SYN-ACK, want half-open", f.state)
			}
			expect(t, c, build(fam.a, fam.b, header.TCPFlagAck), Intercept, NoDrop)
			if f := c.flowOf(t, fam.a, fam.b); f.state != stateEstablished {
				t.Fatalf("state %d after the client's ACK, want established", f.state)
			}
			c.Outbound(build(fam.b, fam.a, header.TCPFlagRst))
			if f := c.flowOf(t, fam.a, fam.b); f.state != stateClosed {
				t.Fatalf("state %d after gVisor RST, want closed", f.state)
			}
		})
	}

	// The hand-built IPv4 packets carry a header gVisor accepts.
	p := tcp(podA4, podB4, tcpSYN)
	h := header.IPv4(p)
	if !h.IsValid(len(p)) || !h.IsChecksumValid() || h.Protocol() != uint8(header.TCPProtocolNumber) {
		t.Fatalf("test builder's IPv4 packet is not valid to gVisor: % x", p)
	}
	if got := header.TCP(h.Payload()).DestinationPort(); got != podB4.Port() {
		t.Fatalf("gVisor reads destination port %d, want %d", got, podB4.Port())
	}
	p6 := tcp(podA6, podB6, tcpSYN)
	if h6 := header.IPv6(p6); !h6.IsValid(len(p6)) || netip.AddrFrom16(h6.DestinationAddress().As16()) != podB6.Addr() {
		t.Fatalf("test builder's IPv6 packet is not valid to gVisor: % x", p6)
	}
}
