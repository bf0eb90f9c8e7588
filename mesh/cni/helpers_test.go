package cni

import "net/netip"

type netipAddr = netip.Addr

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

func fill(as []netip.Addr) {
	for i := range as {
		as[i] = netip.AddrFrom4([4]byte{10, 244, 1, byte(i + 1)})
	}
}
