package proxy

import (
	"bytes"
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"
)

// tcpPair returns the two ends of a loopback TCP connection.
func tcpPair(t *testing.T) (client, server *net.TCPConn) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	s, err := ln.AcceptTCP()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); s.Close() })
	return c, s
}

// startKernelRelay relays between two kernel connections and returns the far
// ends: the client's (whose peer is the relay's a) and the server's.
func startKernelRelay(t *testing.T) (client, server *net.TCPConn, result <-chan relayResult) {
	client, a := tcpPair(t)
	b, server := tcpPair(t)
	res := make(chan relayResult, 1)
	go func() { res <- relayAndWait(a, b, nil, nil) }()
	return client, server, res
}

func waitResult(t *testing.T, res <-chan relayResult) relayResult {
	t.Helper()
	select {
	case r := <-res:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("relay did not end")
	}
	return relayResult{}
}

// TestRelayHalfClose: data crosses both ways (more than one copy buffer's
// worth), the client's FIN reaches the server while the server's reply
// still flows, and the relay ends after both directions ended.
func TestRelayHalfClose(t *testing.T) {
	client, server, res := startKernelRelay(t)
	req := bytes.Repeat([]byte("request."), 3*relayBufSize/8)
	go func() {
		client.Write(req)
		client.CloseWrite()
	}()
	got, err := io.ReadAll(server)
	if err != nil || !bytes.Equal(got, req) {
		t.Fatalf("server read %d bytes (%v), want the %d sent then EOF", len(got), err, len(req))
	}
	reply := []byte("the reply after the client's FIN")
	if _, err := server.Write(reply); err != nil {
		t.Fatal(err)
	}
	server.CloseWrite()
	got, err = io.ReadAll(client)
	if err != nil || !bytes.Equal(got, reply) {
		t.Fatalf("client read %q (%v), want %q then EOF", got, err, reply)
	}
	r := waitResult(t, res)
	if r.Reset || r.AToB != int64(len(req)) || r.BToA != int64(len(reply)) {
		t.Fatalf("relay result %+v, want %d and %d bytes, no reset", r, len(req), len(reply))
	}
}

// TestRelayReset: a reset from the server reaches the client as a reset,
// not a FIN, while the client's side is idle.
func TestRelayReset(t *testing.T) {
	client, server, res := startKernelRelay(t)
	server.SetLinger(0)
	server.Close()
	client.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := client.Read(make([]byte, 1))
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("client read %v, want a reset", err)
	}
	if r := waitResult(t, res); !r.Reset {
		t.Fatalf("relay result %+v, want a reset", r)
	}
}

// TestRelayCloseWhileIdle: closing the relayed connections from outside
// (as a drain's abort does) ends a relay whose both directions are idle.
func TestRelayCloseWhileIdle(t *testing.T) {
	client, a := tcpPair(t)
	b, _ := tcpPair(t)
	res := make(chan relayResult, 1)
	go func() { res <- relayAndWait(a, b, nil, nil) }()
	// The relay is idle once the client's data has crossed.
	if _, err := client.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	reset(b)
	if r := waitResult(t, res); !r.Reset {
		t.Fatalf("relay result %+v, want a reset", r)
	}
}

// relayAndWait relays between a and b and returns what moved once both
// directions are done.
func relayAndWait(a, b net.Conn, onAB, onBA func(int)) relayResult {
	ch := make(chan relayResult, 1)
	startRelay(a, b, onAB, onBA, func(r relayResult) { ch <- r })
	return <-ch
}
