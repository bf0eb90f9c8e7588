package e2e

import (
	"io"
	"net"
	"syscall"
	"testing"
	"time"
)

// TestAckDelay: with --ack-delay, request/response traffic through the
// netstack sends the pure ACKs of the requests only rarely: the responses
// carry the acknowledgments (meshtun_netstack_acks_held_total{outcome=
// "elided"} counts one per request on the client's node, on the mesh path
// and on passthrough). Without the flag nothing is held. The echoes arrive
// byte-exact either way.
func TestAckDelay(t *testing.T) {
	const rounds = 200
	top := t
	mc := newMeshCluster(t, "ad")
	held := func(t *testing.T, outcome string) float64 {
		return value(scrape(t, mc.n1), "meshtun_netstack_acks_held_total", map[string]string{"outcome": outcome})
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
	}
	serve(t, mc.p21, 7301, func(c net.Conn) { io.Copy(c, c) }) // mesh
	serve(t, mc.p22, 7302, func(c net.Conn) { io.Copy(c, c) }) // outside the mesh: passthrough
	run := func(t *testing.T, extra ...string) (elided float64) {
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
		before := held(t, "elided")
		for _, to := range []struct {
			ns   func() net.Conn
			name string
		}{
			{func() net.Conn { return dial(t, mc.p11.NS, mc.p21.IPv4, 7301) }, "mesh"},
			{func() net.Conn { return dial(t, mc.p11.NS, mc.p22.IPv4, 7302) }, "passthrough"},
		} {
			c := to.ns()
			roundTrips(t, c)
			c.Close()
		}
		return held(t, "elided") - before
	}
	t.Run("off", func(t *testing.T) {
		if n := run(t); n != 0 {
			t.Errorf("%v ACKs elided without --ack-delay", n)
		}
	})
	t.Run("on", func(t *testing.T) {
		// Most of the 2×200 requests' ACKs are elided: a response on
		// this loaded machine may now and then take longer than the
		// delay.
		n := run(t, "--ack-delay=5ms")
		t.Logf("%v ACKs elided on node 1 for %d request/responses (passthrough's two netstack legs both on node 1)", n, 2*rounds)
		if n < rounds {
			t.Errorf("%v ACKs elided on node 1 for %d request/responses; want most", n, 2*rounds)
		}
	})
}
