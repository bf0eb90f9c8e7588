package e2e

import (
	"io"
	"net"
	"syscall"
	"testing"
	"time"
)

// TestAckDelay: with --ack-delay, request/response traffic on passthrough
// (both ends of the connection in node 1's netstack) sends the pure ACKs
// only rarely: the requests' ACKs are carried by the responses and the
// responses' by the next requests (meshtun_netstack_acks_held_total{outcome=
// "elided"}, up to two per round trip). A cross-node mesh connection, one
// netstack end per node, holds none. With --ack-delay=0 nothing is held. The
// echoes arrive byte-exact either way.
func TestAckDelay(t *testing.T) {
	const rounds = 200
	top := t
	mc := newMeshCluster(t, "ad")
	elided := func(t *testing.T) float64 {
		return value(scrape(t, mc.n1), "meshtun_netstack_acks_held_total", map[string]string{"outcome": "elided"})
	}
	roundTrips := func(t *testing.T, c net.Conn) {
		t.Helper()
		c.SetDeadline(time.Now().Add(30 * time.Second))
		msg, buf := make([]byte, 64), make([]byte, 64)
		for i := range rounds {
			msg[0] = byte(i)
			if _, err := c.Write(msg); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(c, buf); err != nil {
				t.Fatal(err)
			}
			if buf[0] != byte(i) {
				t.Fatalf("round %d: echo %d", i, buf[0])
			}
		}
		c.Close()
	}
	serve(t, mc.p21, 7301, func(c net.Conn) { io.Copy(c, c) }) // mesh
	serve(t, mc.p22, 7302, func(c net.Conn) { io.Copy(c, c) }) // outside the mesh: passthrough
	// run returns how many ACKs node 1 elided on the mesh path and on
	// passthrough.
	run := func(t *testing.T, extra ...string) (mesh, passthrough float64) {
		extra = append(extra, "--drain-period=0s")
		// Started on the parent test: the config file lives in its
		// directory.
		mc.m1 = mc.start(top, mc.n1, extra...)
		mc.m2 = mc.start(top, mc.n2, extra...)
		defer func() {
			for _, m := range []nodeProc{mc.m1, mc.m2} {
				if err := m.stop(syscall.SIGTERM); err != nil {
					t.Error(err)
				}
			}
		}()
		before := elided(t)
		roundTrips(t, dial(t, mc.p11.NS, mc.p21.IPv4, 7301))
		mid := elided(t)
		roundTrips(t, dial(t, mc.p11.NS, mc.p22.IPv4, 7302))
		return mid - before, elided(t) - mid
	}
	t.Run("off", func(t *testing.T) {
		if m, p := run(t, "--ack-delay=0"); m != 0 || p != 0 {
			t.Errorf("ACKs elided with --ack-delay=0: %v mesh, %v passthrough", m, p)
		}
	})
	t.Run("on", func(t *testing.T) {
		m, p := run(t) // the default
		t.Logf("ACKs elided on node 1 for %d request/responses: %v mesh, %v passthrough", rounds, m, p)
		if m != 0 {
			t.Errorf("%v ACKs of a cross-node mesh connection elided, want none", m)
		}
		// Most: a response on this loaded machine may now and then
		// take longer than the delay.
		if p < rounds {
			t.Errorf("%v passthrough ACKs elided for %d request/responses; want most of %d", p, rounds, 2*rounds)
		}
	})
}
