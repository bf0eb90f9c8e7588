package classify

import (
	"net/netip"
	"testing"
)

// BenchmarkParse measures the header parse alone (IP header, IPv6
// extension headers, TCP header), the part of every packet's path that
// ParseIP shares with the link and the spoof sink.
func BenchmarkParse(b *testing.B) {
	for _, tc := range []struct {
		name string
		pkt  []byte
	}{
		{"v4", tcp(netip.MustParseAddrPort("198.18.0.1:1000"), netip.MustParseAddrPort("198.18.0.2:80"), tcpACK)},
		{"v6-ext", tcp(netip.MustParseAddrPort("[fd00::1]:1000"), netip.MustParseAddrPort("[fd00::2]:80"), tcpACK, ext6{protoHopByHop, 8})},
	} {
		b.Run(tc.name, func(b *testing.B) {
			var seg segment
			for b.Loop() {
				if r, _ := parse(tc.pkt, true, &seg); r != parsedTCP {
					b.Fatal(r)
				}
			}
		})
	}
}
