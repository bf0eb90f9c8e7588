package tun

import (
	"encoding/binary"
	"fmt"
)

// VnetHdrLen is the length of the virtio-net header (struct virtio_net_hdr
// of <linux/virtio_net.h>) that precedes every packet read from or written
// to a device opened with offloads (see [Device.VnetHdrLen]).
const VnetHdrLen = 10

// Flags of [VnetHdr].
const (
	// VnetNeedsCsum (VIRTIO_NET_HDR_F_NEEDS_CSUM): the transport checksum
	// is partial. The checksum field at CsumStart+CsumOffset holds only
	// the pseudo-header sum; whoever sends the packet on completes it over
	// the bytes from CsumStart.
	VnetNeedsCsum uint8 = 1
	// VnetDataValid (VIRTIO_NET_HDR_F_DATA_VALID): the checksum was
	// already verified.
	VnetDataValid uint8 = 2
)

// GSO types of [VnetHdr] (VIRTIO_NET_HDR_GSO_*).
const (
	GSONone  uint8 = 0
	GSOTCPv4 uint8 = 1
	GSOUDP   uint8 = 3 // UFO, IPv4 fragmentation offload (obsolete)
	GSOTCPv6 uint8 = 4
	GSOUDPL4 uint8 = 5 // UDP segmentation (USO)
	// GSOECN is or-ed into a TCP GSO type when the segments carry ECN CWR.
	GSOECN uint8 = 0x80
)

// VnetHdr is the virtio-net header in front of each packet on a TUN opened
// with IFF_VNET_HDR. It describes offloads still to be done: a partial
// checksum to complete (Flags&VnetNeedsCsum) and, for a GSO packet, how to
// cut it into segments of GSOSize payload bytes each after the HdrLen
// bytes of headers that every segment repeats.
//
// Offsets are from the start of the IP header (a TUN has no link-layer
// header). On the wire the fields are in the host's byte order: the TUN is
// in legacy virtio mode, which is native-endian.
type VnetHdr struct {
	Flags      uint8
	GSOType    uint8
	HdrLen     uint16
	GSOSize    uint16
	CsumStart  uint16
	CsumOffset uint16
}

// Decode reads h from the first VnetHdrLen bytes of b.
func (h *VnetHdr) Decode(b []byte) error {
	if len(b) < VnetHdrLen {
		return fmt.Errorf("tun: virtio-net header: %d bytes, need %d", len(b), VnetHdrLen)
	}
	h.Flags = b[0]
	h.GSOType = b[1]
	h.HdrLen = binary.NativeEndian.Uint16(b[2:4])
	h.GSOSize = binary.NativeEndian.Uint16(b[4:6])
	h.CsumStart = binary.NativeEndian.Uint16(b[6:8])
	h.CsumOffset = binary.NativeEndian.Uint16(b[8:10])
	return nil
}

// Encode writes h into the first VnetHdrLen bytes of b, which must be at
// least that long.
func (h *VnetHdr) Encode(b []byte) {
	_ = b[VnetHdrLen-1]
	b[0] = h.Flags
	b[1] = h.GSOType
	binary.NativeEndian.PutUint16(b[2:4], h.HdrLen)
	binary.NativeEndian.PutUint16(b[4:6], h.GSOSize)
	binary.NativeEndian.PutUint16(b[6:8], h.CsumStart)
	binary.NativeEndian.PutUint16(b[8:10], h.CsumOffset)
}

// IsGSO reports whether the packet is a GSO super-packet (to be cut into
// segments), as opposed to a single packet.
func (h *VnetHdr) IsGSO() bool { return h.GSOType&^GSOECN != GSONone }
