package stack

import (
	"net/netip"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/meshtun/meshtun/tun"
)

// TestWhenReadable: on an idle connection WhenReadable arms its callback
// and returns false; the callback runs once, when data arrives; with data
// buffered it returns true and never calls the callback; the peer's FIN
// and a local close fire an armed callback too.
func TestWhenReadable(t *testing.T) {
	fam := families[0]
	dev := newFakeDev(tun.VnetHdrLen)
	st, conns := newTestStack(t, dev)
	defer func() { dev.close(); st.Close() }()

	fired := make(chan struct{}, 4)
	notify := func() { fired <- struct{}{} }
	// A local close.
	src2 := netip.AddrPortFrom(fam.src.Addr(), fam.src.Port()+1)
	c2, _, _ := handshake(t, dev, conns, src2, fam.dst)
	if c2.WhenReadable(notify) {
		t.Fatal("WhenReadable on a new idle connection: true")
	}
	c2.Close()
	select {
	case <-fired:
	case <-time.After(10 * time.Second):
		t.Fatal("callback not called after Close")
	}
	dev.recv(t) // the FIN of the close

	c, seq, ack := handshake(t, dev, conns, fam.src, fam.dst)
	if c.WhenReadable(notify) {
		t.Fatal("WhenReadable on an idle connection: true")
	}
	dev.send(t, tun.VnetHdr{}, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: []byte("hello")}.build())
	select {
	case <-fired:
	case <-time.After(10 * time.Second):
		t.Fatal("callback not called after data arrived")
	}
	seq += 5
	if !c.WhenReadable(func() { t.Error("callback called although data was buffered") }) {
		t.Fatal("WhenReadable with data buffered: false")
	}
	buf := make([]byte, 16)
	if n, err := c.Read(buf); err != nil || string(buf[:n]) != "hello" {
		t.Fatalf("Read: %q, %v", buf[:n], err)
	}

	// The peer's FIN.
	if c.WhenReadable(notify) {
		t.Fatal("WhenReadable after reading everything: true")
	}
	dev.send(t, tun.VnetHdr{}, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagFin}.build())
	select {
	case <-fired:
	case <-time.After(10 * time.Second):
		t.Fatal("callback not called after the peer's FIN")
	}
	c.Close()

	select {
	case <-fired:
		t.Fatal("a callback ran twice")
	case <-time.After(20 * time.Millisecond):
	}
}
