package stack

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip/header"
)

// TestDialSameSourceTwoDestinations: the netstack stands in for clients
// whose kernels reuse a source port towards different destinations, so two
// spoofed dials from one address and port to two destinations must both
// go out (the port is bound to the tuple, not reserved for the address).
func TestDialSameSourceTwoDestinations(t *testing.T) {
	dev := newFakeDev(0)
	st, _ := newTestStack(t, dev)
	defer st.Close()
	defer dev.close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	src := netip.MustParseAddrPort("198.18.1.11:41274")
	dsts := []netip.AddrPort{netip.MustParseAddrPort("198.18.2.11:7001"), netip.MustParseAddrPort("198.18.2.12:7002")}
	errs := make(chan error, len(dsts))
	for _, dst := range dsts {
		go func() {
			_, err := st.DialTCP(ctx, src, dst)
			errs <- err
		}()
	}
	// Each dial sends its SYN from src; nothing answers, so both then wait
	// for ctx.
	seen := map[netip.AddrPort]bool{}
	for len(seen) < len(dsts) {
		select {
		case p := <-dev.Out:
			ip := header.IPv4(p)
			tcp := header.TCP(ip.Payload())
			from := netip.AddrPortFrom(netip.AddrFrom4(ip.SourceAddress().As4()), tcp.SourcePort())
			to := netip.AddrPortFrom(netip.AddrFrom4(ip.DestinationAddress().As4()), tcp.DestinationPort())
			if tcp.Flags().Contains(header.TCPFlagSyn) && from == src {
				seen[to] = true
			}
		case err := <-errs:
			t.Fatalf("dial failed before sending its SYN: %v (seen SYNs to %v)", err, seen)
		case <-ctx.Done():
			t.Fatalf("SYNs seen only to %v", seen)
		}
	}
	cancel()
	for range dsts {
		if err := <-errs; !errors.Is(err, context.Canceled) {
			t.Errorf("dial ended with %v, want context.Canceled", err)
		}
	}
}
