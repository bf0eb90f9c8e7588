package tun

import (
	"bytes"
	"encoding/binary"
	"testing"
)

func TestVnetHdrEncodeDecode(t *testing.T) {
	h := VnetHdr{Flags: VnetNeedsCsum, GSOType: GSOTCPv6 | GSOECN, HdrLen: 0x0102, GSOSize: 1440, CsumStart: 40, CsumOffset: 16}
	b := make([]byte, VnetHdrLen+3)
	for i := range b {
		b[i] = 0xee
	}
	h.Encode(b)
	// struct virtio_net_hdr { u8 flags; u8 gso_type; __virtio16 hdr_len,
	// gso_size, csum_start, csum_offset; } in the host's byte order.
	want := []byte{1, 0x84, 0, 0, 0, 0, 0, 0, 0, 0}
	binary.NativeEndian.PutUint16(want[2:], 0x0102)
	binary.NativeEndian.PutUint16(want[4:], 1440)
	binary.NativeEndian.PutUint16(want[6:], 40)
	binary.NativeEndian.PutUint16(want[8:], 16)
	if !bytes.Equal(b[:VnetHdrLen], want) {
		t.Fatalf("encoded % x, want % x", b[:VnetHdrLen], want)
	}
	if !bytes.Equal(b[VnetHdrLen:], []byte{0xee, 0xee, 0xee}) {
		t.Fatal("Encode wrote past the header")
	}
	var g VnetHdr
	if err := g.Decode(b); err != nil {
		t.Fatal(err)
	}
	if g != h {
		t.Fatalf("decoded %+v, want %+v", g, h)
	}
	if err := g.Decode(b[:VnetHdrLen-1]); err == nil {
		t.Fatal("Decode accepted a 9-byte header")
	}
}

func TestVnetHdrIsGSO(t *testing.T) {
	for _, c := range []struct {
		typ  uint8
		want bool
	}{
		{GSONone, false}, {GSOECN, false}, {GSOTCPv4, true}, {GSOTCPv4 | GSOECN, true},
		{GSOTCPv6, true}, {GSOUDPL4, true}, {GSOUDP, true},
	} {
		h := VnetHdr{GSOType: c.typ}
		if got := h.IsGSO(); got != c.want {
			t.Errorf("IsGSO(%#x) = %v, want %v", c.typ, got, c.want)
		}
	}
}
