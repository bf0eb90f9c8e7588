package tun

import (
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
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
	if err := setDevconf("mtdev0", map[uint16]uint32{devconfRPFilter: 2, devconfAcceptLocal: 1, devconfForwarding: 1}); err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]string{"rp_filter": "2", "accept_local": "1", "forwarding": "1"} {
		got, err := readSysctl("net/ipv4/conf/mtdev0/" + key)
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("%s = %s after setDevconf, want %s", key, got, want)
		}
	}
}

// TestIPv6DevconfReadOnly measures why IPv6 forwarding needs /proc/sys:
// the kernel takes no IFLA_INET6_CONF in RTM_SETLINK (only the token and
// the address generation mode), so a device's IPv6 forwarding cannot be
// set over netlink the way IPv4's can.
func TestIPv6DevconfReadOnly(t *testing.T) {
	inNewNetns(t)
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "mtdev0"}, PeerName: "mtdev0p"}); err != nil {
		t.Fatal(err)
	}
	l, err := netlink.LinkByName("mtdev0")
	if err != nil {
		t.Fatal(err)
	}
	const devconf6Forwarding = 0 // DEVCONF_FORWARDING, index 0 of the IPv6 devconf array
	req := nl.NewNetlinkRequest(unix.RTM_SETLINK, unix.NLM_F_ACK)
	msg := nl.NewIfInfomsg(unix.AF_UNSPEC)
	msg.Index = int32(l.Attrs().Index)
	req.AddData(msg)
	spec := nl.NewRtAttr(unix.IFLA_AF_SPEC, nil)
	conf := spec.AddRtAttr(unix.AF_INET6, nil).AddRtAttr(unix.IFLA_INET6_CONF, nil)
	conf.AddRtAttr(devconf6Forwarding+1, nl.Uint32Attr(1))
	req.AddData(spec)
	_, serr := req.Execute(unix.NETLINK_ROUTE, 0)
	got, err := readSysctl("net/ipv6/conf/mtdev0/forwarding")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("RTM_SETLINK with IFLA_INET6_CONF forwarding=1: %v; forwarding now %s", serr, got)
	if serr == nil && got == "1" {
		t.Fatal("the kernel set IPv6 forwarding over netlink: tun.SetSysctls could use it where /proc/sys is read-only")
	}
}
