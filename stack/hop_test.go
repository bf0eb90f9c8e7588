package stack

import (
	"testing"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
)

func ipv4Packet(ttl uint8, id uint16) []byte {
	b := make([]byte, header.IPv4MinimumSize+8)
	ip := header.IPv4(b)
	ip.Encode(&header.IPv4Fields{
		TotalLength: uint16(len(b)), ID: id, TTL: ttl, Protocol: uint8(header.UDPProtocolNumber),
		SrcAddr: tcpip.AddrFrom4([4]byte{10, 0, 0, 1}), DstAddr: tcpip.AddrFrom4([4]byte{10, 0, 1, 2}),
	})
	ip.SetChecksum(^ip.CalculateChecksum())
	return b
}

func TestRestoreHopIPv4(t *testing.T) {
	// Every TTL and enough IDs to cover carries in the checksum.
	for ttl := 0; ttl <= 255; ttl++ {
		for _, id := range []uint16{0, 1, 0x00ff, 0x1234, 0xfeff, 0xffff} {
			b := ipv4Packet(uint8(ttl), id)
			restoreHop(b)
			ip := header.IPv4(b)
			want := uint8(ttl + 1)
			if ttl == 255 {
				want = 255
			}
			if ip.TTL() != want {
				t.Fatalf("TTL %d → %d, want %d", ttl, ip.TTL(), want)
			}
			if !ip.IsChecksumValid() {
				t.Fatalf("TTL %d, id %#x: checksum %#x invalid after the update", ttl, id, ip.Checksum())
			}
		}
	}
}

func TestRestoreHopIPv6AndShortPackets(t *testing.T) {
	b := make([]byte, header.IPv6MinimumSize)
	ip := header.IPv6(b)
	ip.Encode(&header.IPv6Fields{HopLimit: 63, TransportProtocol: header.UDPProtocolNumber})
	restoreHop(b)
	if ip.HopLimit() != 64 {
		t.Errorf("hop limit 63 → %d, want 64", ip.HopLimit())
	}
	ip.SetHopLimit(255)
	restoreHop(b)
	if ip.HopLimit() != 255 {
		t.Errorf("hop limit 255 → %d, want 255", ip.HopLimit())
	}
	for _, short := range [][]byte{nil, {0x45}, make([]byte, 19), append([]byte{0x60}, make([]byte, 38)...)} {
		orig := append([]byte(nil), short...)
		restoreHop(short) // must not panic or change a truncated header
		if string(orig) != string(short) {
			t.Errorf("short packet %x changed to %x", orig, short)
		}
	}
}
