package tun

import (
	"fmt"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// IPv4 per-device settings by their index in the kernel's devconf table
// (linux/ip.h, IPV4_DEVCONF_*).
const (
	devconfForwarding  = 1
	devconfRPFilter    = 8
	devconfAcceptLocal = 23
)

// setDevconf sets IPv4 per-device settings of link name over netlink
// (RTM_SETLINK with IFLA_AF_SPEC/AF_INET/IFLA_INET_CONF), which needs
// CAP_NET_ADMIN only: the way in when /proc/sys is mounted read-only, as
// container runtimes do for unprivileged containers, host network or not.
func setDevconf(name string, vals map[uint16]uint32) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return fmt.Errorf("tun: devconf of %s: %w", name, err)
	}
	req := nl.NewNetlinkRequest(unix.RTM_SETLINK, unix.NLM_F_ACK)
	msg := nl.NewIfInfomsg(unix.AF_UNSPEC)
	msg.Index = int32(l.Attrs().Index)
	req.AddData(msg)
	spec := nl.NewRtAttr(unix.IFLA_AF_SPEC, nil)
	conf := spec.AddRtAttr(unix.AF_INET, nil).AddRtAttr(unix.IFLA_INET_CONF, nil)
	for k, v := range vals {
		conf.AddRtAttr(int(k), nl.Uint32Attr(v))
	}
	req.AddData(spec)
	if _, err := req.Execute(unix.NETLINK_ROUTE, 0); err != nil {
		return fmt.Errorf("tun: set IPv4 devconf of %s over netlink: %w", name, err)
	}
	return nil
}
