package e2e

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"
)

// stream returns n deterministic pseudo-random bytes for seed as a reader.
func stream(seed uint64, n int64) io.Reader {
	var s [32]byte
	s[0] = byte(seed)
	s[1] = byte(seed >> 8)
	return io.LimitReader(rand.NewChaCha8(s), n)
}

// streamSum is the SHA-256 of stream(seed, n).
func streamSum(seed uint64, n int64) [32]byte {
	h := sha256.New()
	io.Copy(h, stream(seed, n))
	var s [32]byte
	h.Sum(s[:0])
	return s
}

// server is a TCP listener in a namespace whose accepted connections are
// served by a handler; it records the peer address of every connection.
type server struct {
	ln    net.Listener
	peers chan netip.AddrPort
	wg    sync.WaitGroup
}

type listener interface {
	Listen(network, address string) (net.Listener, error)
}

func serve(t testing.TB, ns listener, port int, handle func(net.Conn)) *server {
	t.Helper()
	ln, err := ns.Listen("tcp", fmt.Sprintf(":%d", port))
	if err != nil {
		t.Fatalf("listen on :%d: %v", port, err)
	}
	s := &server{ln: ln, peers: make(chan netip.AddrPort, 1024)}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p := c.RemoteAddr().(*net.TCPAddr).AddrPort()
			select { // the first 1024 are kept; benchmarks make more
			case s.peers <- netip.AddrPortFrom(p.Addr().Unmap(), p.Port()):
			default:
			}
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer c.Close()
				handle(c)
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); s.wg.Wait() })
	return s
}

// peer returns the address the server saw for its next connection.
func (s *server) peer(t testing.TB) netip.AddrPort {
	t.Helper()
	select {
	case p := <-s.peers:
		return p
	case <-time.After(10 * time.Second):
		t.Fatal("server saw no connection")
		return netip.AddrPort{}
	}
}

// exchangeServer reads the client's stream to EOF while sending n bytes of
// stream(2); after the client's EOF it appends the SHA-256 of what it read.
func exchangeServer(n int64) func(net.Conn) {
	return func(c net.Conn) {
		sum := make(chan []byte, 1)
		go func() {
			h := sha256.New()
			io.Copy(h, c)
			sum <- h.Sum(nil)
		}()
		if _, err := io.Copy(c, stream(2, n)); err != nil {
			return
		}
		c.Write(<-sum)
	}
}

// exchange sends n bytes of stream(1) and half-closes, reads the server's
// reply to EOF, and checks both directions arrived byte-exact.
func exchange(t testing.TB, c net.Conn, n int64) {
	t.Helper()
	werr := make(chan error, 1)
	go func() {
		_, err := io.Copy(c, stream(1, n))
		if err == nil {
			err = c.(interface{ CloseWrite() error }).CloseWrite()
		}
		werr <- err
	}()
	h := sha256.New()
	got, err := io.CopyN(h, c, n)
	if err != nil {
		t.Fatalf("read reply: %v after %d of %d bytes", err, got, n)
	}
	tail, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("read digest: %v", err)
	}
	if err := <-werr; err != nil {
		t.Fatalf("send: %v", err)
	}
	if want := streamSum(2, n); !bytes.Equal(h.Sum(nil), want[:]) {
		t.Errorf("server→client: %d bytes arrived but differ (SHA-256 mismatch)", n)
	}
	if want := streamSum(1, n); !bytes.Equal(tail, want[:]) {
		t.Errorf("client→server: server's SHA-256 %x, want %x", tail, want)
	}
}

// isReset reports whether err is a connection reset.
func isReset(err error) bool {
	return errors.Is(err, syscall.ECONNRESET)
}
