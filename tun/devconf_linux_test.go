package tun

import (
	"testing"

	"github.com/vishvananda/netlink"
)

// setDevconf sets the same settings /proc/sys shows.
func TestSetDevconf(t *testing.T) {
	inNewNetns(t)
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "mtdev0"}, PeerName: "mtdev0p"}); err != nil {
		t.Fatal(err)
	}
	if err := writeSysctl("net/ipv4/conf/mtdev0/rp_filter", "1"); err != nil {
		t.Fatal(err)
	}
	if err := setDevconf("mtdev0", map[uint16]uint32{devconfRPFilter: 0, devconfAcceptLocal: 1}); err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]string{"rp_filter": "0", "accept_local": "1"} {
		got, err := readSysctl("net/ipv4/conf/mtdev0/" + key)
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("%s = %s after setDevconf, want %s", key, got, want)
		}
	}
}
