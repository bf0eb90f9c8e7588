package tun

import (
	"context"
	"fmt"
	"net/netip"
	"sync/atomic"

	"github.com/rs/zerolog"
	"github.com/vishvananda/netlink"
)

// LocalAddrs is the set of the node's own addresses (every address of
// every link in the current network namespace), kept current from
// netlink address notifications. The kernel drops a packet that arrives
// from outside with one of these as its source (a martian), so a packet
// the TUN reads with a local source was sent by the node itself.
type LocalAddrs struct {
	set atomic.Pointer[map[netip.Addr]struct{}]
}

// Contains reports whether a is one of the node's addresses. It does not
// allocate and is safe for concurrent use.
func (l *LocalAddrs) Contains(a netip.Addr) bool {
	m := l.set.Load()
	if m == nil {
		return false
	}
	_, ok := (*m)[a.Unmap()]
	return ok
}

// WatchLocalAddrs lists the node's addresses and keeps the set current
// until ctx is done.
func WatchLocalAddrs(ctx context.Context, log zerolog.Logger) (*LocalAddrs, error) {
	l := &LocalAddrs{}
	updates := make(chan netlink.AddrUpdate, 64)
	if err := netlink.AddrSubscribeWithOptions(updates, ctx.Done(), netlink.AddrSubscribeOptions{
		ErrorCallback: func(err error) { log.Warn().Err(err).Msg("address notifications") },
	}); err != nil {
		return nil, fmt.Errorf("tun: watch addresses: %w", err)
	}
	if err := l.refresh(); err != nil {
		return nil, err
	}
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case _, ok := <-updates:
				if !ok {
					return
				}
				if err := l.refresh(); err != nil {
					log.Warn().Err(err).Msg("list the node's addresses")
				}
			}
		}
	}()
	return l, nil
}

// refresh replaces the set with the addresses the kernel lists now.
func (l *LocalAddrs) refresh() error {
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return fmt.Errorf("tun: list addresses: %w", err)
	}
	m := make(map[netip.Addr]struct{}, len(addrs))
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			m[ip.Unmap()] = struct{}{}
		}
	}
	l.set.Store(&m)
	return nil
}
