package hbone

import (
	"context"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/meshtun/meshtun/protocols/relay"
)

// meteredTCP is an upstream that brings its relay meter (relay.Metered).
type meteredTCP struct {
	*net.TCPConn
	done chan relay.Result
}

func (c *meteredTCP) RelayMeter() relay.Meter {
	return relay.Meter{Done: func(r relay.Result) { c.done <- r }}
}

// TestServerReportsToMeteredUpstream: the server's relay tells a
// relay.Metered upstream what moved each way once the stream ended, and
// that it ended in a reset when the client aborts.
func TestServerReportsToMeteredUpstream(t *testing.T) {
	results := make(chan relay.Result, 2)
	f := newFixture(t, HandlerFunc(func(ctx context.Context, req *Request) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", req.Target.String())
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrUnreachable, err)
		}
		return &meteredTCP{TCPConn: c.(*net.TCPConn), done: results}, nil
	}))
	wait := func() relay.Result {
		t.Helper()
		select {
		case r := <-results:
			return r
		case <-time.After(10 * time.Second):
			t.Fatal("the relay told the upstream's meter nothing")
		}
		return relay.Result{}
	}

	up := newUpstream(t)
	conn, err := f.dial(ctxTimeout(t, 5*time.Second), up.addr)
	if err != nil {
		t.Fatal(err)
	}
	uc := up.accept(t)
	req, reply := make([]byte, 100_000), make([]byte, 3_000)
	go func() { conn.Write(req); conn.CloseWrite() }()
	if n, err := io.Copy(io.Discard, uc); err != nil || n != int64(len(req)) {
		t.Fatalf("upstream read %d bytes (%v), want %d", n, err, len(req))
	}
	uc.Write(reply)
	uc.CloseWrite()
	if n, err := io.Copy(io.Discard, conn); err != nil || n != int64(len(reply)) {
		t.Fatalf("client read %d bytes (%v), want %d", n, err, len(reply))
	}
	conn.Close()
	if r := wait(); r.AToB != int64(len(req)) || r.BToA != int64(len(reply)) || r.Reset {
		t.Errorf("meter told %+v, want %d bytes to the upstream, %d back, no reset", r, len(req), len(reply))
	}

	conn, err = f.dial(ctxTimeout(t, 5*time.Second), up.addr)
	if err != nil {
		t.Fatal(err)
	}
	up.accept(t)
	conn.Abort()
	if r := wait(); !r.Reset {
		t.Errorf("meter told %+v after the client's abort, want a reset", r)
	}
}
