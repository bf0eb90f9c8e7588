// Package tun owns meshtun's kernel footprint: the TUN device that pod
// traffic is routed into, and the policy routing and sysctls that route it
// there.
//
// Everything here is done through /dev/net/tun and netlink. Nothing uses
// iptables, nftables, eBPF, TPROXY or conntrack. Every rule and route meshtun
// installs carries its own routing table number and rule priority (see
// [DefaultTable] and [DefaultPriority]), so that a later start can recognise
// and adopt what an earlier run left behind: the rules and blocking routes
// stay when meshtun stops, so that captured traffic is refused while no
// proxy runs, until [Uninstall] removes them.
package tun
