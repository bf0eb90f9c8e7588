package classify

import (
	"net/netip"
	"sync/atomic"
	"testing"
	"time"
)

// synPackets returns n SYNs of distinct flows from IPv4 clients to port 80.
func synPackets(n int) [][]byte {
	server := netip.AddrPortFrom(podB4.Addr(), 80)
	pkts := make([][]byte, n)
	for i := range pkts {
		src := netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, byte(i >> 14), byte(i >> 6)}), uint16(1024+i&63))
		pkts[i] = tcp(src, server, tcpSYN)
	}
	return pkts
}

// TestZeroAllocs enforces that the per-packet paths do not allocate.
func TestZeroAllocs(t *testing.T) {
	const runs = 200
	c := New(Config{MaxFlows: 4096, Policy: toPort(80)})
	server := netip.AddrPortFrom(podB4.Addr(), 80)
	expect(t, c, tcp(podA4, server, tcpSYN), Intercept, NoDrop)
	expect(t, c, tcp(podA6, netip.AddrPortFrom(podB6.Addr(), 80), tcpSYN), Intercept, NoDrop)
	established := tcpPayload(podA4, server, tcpACK, 1000)
	established6 := tcpPayload(podA6, netip.AddrPortFrom(podB6.Addr(), 80), tcpACK, 1000)
	reply := tcp(server, podA4, tcpACK)
	syns := synPackets(2*runs + 2)
	next := 0
	outSyns := make([][]byte, runs+1)
	for i := range outSyns {
		outSyns[i] = tcp(netip.AddrPortFrom(ext4.Addr(), uint16(20000+i)), podB4, tcpSYN)
	}
	nextOut := 0
	udpPkt := udp(podA4, podB4, 0)
	unselected := tcp(podA4, podB4, tcpSYN)

	cases := []struct {
		name string
		f    func()
	}{
		{"inbound-established-v4", func() { c.Inbound(established) }},
		{"inbound-established-v6", func() { c.Inbound(established6) }},
		{"inbound-udp", func() { c.Inbound(udpPkt) }},
		{"inbound-syn-insert", func() {
			if v, _ := c.Inbound(syns[next]); v != Intercept {
				panic("SYN not intercepted")
			}
			next++
		}},
		{"inbound-syn-not-selected", func() { c.Inbound(unselected) }},
		{"inbound-malformed", func() { c.Inbound(established[:30]) }},
		{"outbound-reply", func() { c.Outbound(reply) }},
		{"outbound-syn-insert", func() { c.Outbound(outSyns[nextOut]); nextOut++ }},
		{"sweep", func() { c.Sweep(c.base.Add(time.Second)) }},
	}
	for _, tc := range cases {
		if got := testing.AllocsPerRun(runs, tc.f); got != 0 {
			t.Errorf("%s: %v allocs per packet, want 0", tc.name, got)
		}
	}
	if st := c.Stats(); st.DropsByReason[TableFull] != 0 || st.OutboundTableFull != 0 {
		t.Fatalf("table filled up during the test: %+v", st)
	}
}

func BenchmarkInbound(b *testing.B) {
	server := netip.AddrPortFrom(podB4.Addr(), 80)

	b.Run("established", func(b *testing.B) {
		c := New(Config{Policy: toPort(80)})
		c.Inbound(tcp(podA4, server, tcpSYN))
		p := tcpPayload(podA4, server, tcpACK, 1400)
		b.ReportAllocs()
		b.SetBytes(int64(len(p)))
		for b.Loop() {
			if v, _ := c.Inbound(p); v != Intercept {
				b.Fatal("not intercepted")
			}
		}
	})
	b.Run("established-v6", func(b *testing.B) {
		c := New(Config{Policy: toPort(80)})
		s6 := netip.AddrPortFrom(podB6.Addr(), 80)
		c.Inbound(tcp(podA6, s6, tcpSYN))
		p := tcpPayload(podA6, s6, tcpACK, 1400)
		b.ReportAllocs()
		b.SetBytes(int64(len(p)))
		for b.Loop() {
			if v, _ := c.Inbound(p); v != Intercept {
				b.Fatal("not intercepted")
			}
		}
	})
	b.Run("established-parallel", func(b *testing.B) {
		// Many flows, one per goroutine, as with several TUN queues.
		c := New(Config{Policy: toPort(80)})
		syns := synPackets(64)
		data := make([][]byte, len(syns))
		for i, s := range syns {
			c.Inbound(s)
			data[i] = append([]byte(nil), s...)
			data[i][33] = tcpACK
		}
		var next atomic.Int32
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			p := data[int(next.Add(1))%len(data)]
			for pb.Next() {
				if v, _ := c.Inbound(p); v != Intercept {
					b.Error("not intercepted")
					return
				}
			}
		})
	})
	b.Run("verbatim-udp", func(b *testing.B) {
		c := New(Config{Policy: toPort(80)})
		p := udp(podA4, podB4, 1400)
		b.ReportAllocs()
		b.SetBytes(int64(len(p)))
		for b.Loop() {
			if v, _ := c.Inbound(p); v != Verbatim {
				b.Fatal("not verbatim")
			}
		}
	})
	b.Run("verbatim-tcp-no-flow", func(b *testing.B) {
		c := New(Config{Policy: toPort(80)})
		p := tcpPayload(podA4, podB4, tcpACK, 1400)
		b.ReportAllocs()
		for b.Loop() {
			if v, _ := c.Inbound(p); v != Verbatim {
				b.Fatal("not verbatim")
			}
		}
	})
	b.Run("syn-insert", func(b *testing.B) {
		const n = 1 << 14
		// Every SYN stays half-open: room for twice as many, so the
		// benchmark measures insertion, not the half-open bound.
		c := New(Config{MaxFlows: 2 * n, MaxHalfOpen: 2 * n, Policy: toPort(80)})
		syns := synPackets(n)
		round := 0
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			if i == n {
				// Empty the table outside the timer.
				b.StopTimer()
				round++
				c.Sweep(c.base.Add(time.Duration(round) * time.Hour))
				i = 0
				b.StartTimer()
			}
			if v, _ := c.Inbound(syns[i]); v != Intercept {
				_, d := c.Inbound(syns[i])
				b.Fatalf("SYN %d (round %d) not intercepted: %v", i, round, d)
			}
			i++
		}
	})
}

func BenchmarkOutbound(b *testing.B) {
	server := netip.AddrPortFrom(podB4.Addr(), 80)
	b.Run("established", func(b *testing.B) {
		c := New(Config{Policy: toPort(80)})
		c.Inbound(tcp(podA4, server, tcpSYN))
		p := tcpPayload(server, podA4, tcpACK, 1400)
		b.ReportAllocs()
		for b.Loop() {
			c.Outbound(p)
		}
	})
	b.Run("syn-insert", func(b *testing.B) {
		const n = 1 << 14
		c := New(Config{MaxFlows: n})
		syns := synPackets(n)
		round := 0
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			if i == n {
				b.StopTimer()
				round++
				c.Sweep(c.base.Add(time.Duration(round) * time.Hour))
				i = 0
				b.StartTimer()
			}
			c.Outbound(syns[i])
			i++
		}
		if st := c.Stats(); st.OutboundTableFull != 0 {
			b.Fatalf("table full: %+v", st)
		}
	})
}

func BenchmarkSweep(b *testing.B) {
	c := New(Config{})
	for _, p := range synPackets(1 << 14) {
		c.Outbound(p)
	}
	b.ReportAllocs()
	for b.Loop() {
		c.Sweep(c.base.Add(time.Second)) // scans all 65536 flows' slots
	}
}
