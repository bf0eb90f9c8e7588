package classify

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestConcurrent drives Inbound, Outbound, Sweep, SetPolicy and Stats from
// several goroutines at once, on shared flows; run it with -race.
func TestConcurrent(t *testing.T) {
	const (
		workers = 2
		flows   = 400 // per worker
	)
	c := New(Config{MaxFlows: 4 * workers * flows, Policy: toPort(80)})
	server := netip.AddrPortFrom(podB4.Addr(), 80)
	client := func(w, i int) netip.AddrPort {
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, 10, byte(w)}), uint16(10000+i))
	}
	netstackClient := func(w, i int) netip.AddrPort {
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, 20, byte(w)}), uint16(10000+i))
	}

	// A server the netstack dials from spoofed client addresses.
	dialed := netip.AddrPortFrom(podB4.Addr(), 9090)

	var wg sync.WaitGroup
	var failures atomic.Int32
	fail := func(format string, args ...any) {
		if failures.Add(1) <= 10 {
			t.Errorf(format, args...)
		}
	}
	in := func(p []byte, want Verdict) {
		if v, r := c.Inbound(p); v != want {
			fail("Inbound = %v/%v, want %v", v, r, want)
		}
	}
	done := make(chan struct{})

	// Pod-initiated flows: the TUN reader sees the client side, a
	// netstack goroutine answers on the same flow at the same time.
	for w := range workers {
		synced := make(chan int, flows)
		wg.Add(2)
		go func() {
			defer wg.Done()
			defer close(synced)
			for i := range flows {
				a := client(w, i)
				in(tcp(a, server, tcpSYN), Intercept)
				synced <- i
				in(tcpPayload(a, server, tcpACK, 64), Intercept)
				in(tcp(a, server, tcpFIN|tcpACK), Intercept)
				in(udp(a, server, 10), Verbatim)
				in(tcp(a, podB4, tcpSYN), Verbatim) // port 8080: not selected
			}
		}()
		go func() {
			defer wg.Done()
			for i := range synced {
				a := client(w, i)
				c.Outbound(tcp(server, a, tcpSYN|tcpACK))
				c.Outbound(tcpPayload(server, a, tcpACK, 64))
				c.Outbound(tcp(server, a, tcpFIN|tcpACK))
			}
		}()
	}
	// Netstack-originated flows: SYN out, replies in.
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range flows {
				a := netstackClient(w, i)
				c.Outbound(tcp(a, dialed, tcpSYN))
				in(tcp(dialed, a, tcpSYN|tcpACK), Intercept)
				c.Outbound(tcp(a, dialed, tcpRST))
				in(tcp(dialed, a, tcpACK), Intercept) // grace
			}
		}()
	}
	// Sweeper, policy flipper and stats reader.
	var bg sync.WaitGroup
	bg.Add(1)
	go func() {
		defer bg.Done()
		for n := 0; ; n++ {
			select {
			case <-done:
				return
			default:
			}
			c.Sweep(time.Now())
			if n%2 == 0 {
				c.SetPolicy(toPort(80))
			} else {
				c.SetPolicy(PolicyFunc(func(_, dst netip.AddrPort) bool { return dst.Port() == 80 }))
			}
			st := c.Stats()
			if st.Flows > int(c.maxFlows) {
				fail("Flows = %d > MaxFlows", st.Flows)
			}
		}
	}()
	wg.Wait()
	close(done)
	bg.Wait()

	st := c.Stats()
	total := workers * flows
	if st.Intercepted != uint64(5*total) || st.Verbatim != uint64(2*total) || st.Dropped != 0 {
		t.Fatalf("Stats = %+v; want %d intercepted, %d verbatim", st, 5*total, 2*total)
	}
	if st.FlowsInserted != uint64(2*total) || st.Flows != 2*total || st.FlowsExpired != 0 {
		t.Fatalf("Stats = %+v; want %d flows", st, 2*total)
	}
	if got := c.closedFlows(); got != 2*total {
		t.Fatalf("%d closed flows, want %d (all FIN/FIN or RST)", got, 2*total)
	}
	if n := c.Sweep(time.Now().Add(DefaultCloseTimeout)); n != 2*total || c.Len() != 0 {
		t.Fatalf("final sweep removed %d, Len %d; want %d, 0", n, c.Len(), 2*total)
	}
}
