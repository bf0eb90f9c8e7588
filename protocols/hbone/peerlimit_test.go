package hbone

import (
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// waitPeerLoad waits until the server's load of the fixture's client is
// streams and connecting (the server updates it as streams end).
func waitPeerLoad(t *testing.T, f *fixture, streams, connecting int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		s, c := f.srv.PeerLoad(f.client)
		if s == streams && c == connecting {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("peer load: %d streams, %d connecting; want %d, %d", s, c, streams, connecting)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestPeerLimits: one peer identity's streams and pending dials are
// bounded over all its connections to the server, not per connection;
// streams past a bound are refused (REFUSED_STREAM), room comes back as
// streams end, and nothing is left counted once the connections close.
func TestPeerLimits(t *testing.T) {
	ah := &attackHandler{}
	f := newFixture(t, ah, func(s *ServerConfig, _ *ClientConfig) {
		s.MaxStreamsPerPeer = 4
		s.MaxConnectingPerPeer = 2
	})
	a, b := newRawClient(t, f), newRawClient(t, f)
	a.echoWorks(1)
	a.connect(3, blockTarget)
	b.connect(1, blockTarget)
	waitPeerLoad(t, f, 3, 2)
	// Two dials pending, over two connections: a third request is refused.
	b.connect(3, echoTarget)
	if code := b.rst(3); code != http2.ErrCodeRefusedStream {
		t.Errorf("third pending dial: RST_STREAM %v, want REFUSED_STREAM", code)
	}
	// One pending dial ends: room for one more stream, up to 4 in all.
	a.fr.WriteRSTStream(3, http2.ErrCodeCancel)
	waitPeerLoad(t, f, 2, 1)
	b.echoWorks(5)
	b.echoWorks(7)
	waitPeerLoad(t, f, 4, 1)
	b.connect(9, echoTarget)
	if code := b.rst(9); code != http2.ErrCodeRefusedStream {
		t.Errorf("fifth stream: RST_STREAM %v, want REFUSED_STREAM", code)
	}
	if n := ah.maxSeen.Load(); n > 2 {
		t.Errorf("%d dials pending at once, want at most 2", n)
	}
	a.tc.Close()
	b.tc.Close()
	waitPeerLoad(t, f, 0, 0)
}
