package demo

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/bench/cluster"
)

// wire captures every frame in the fabric namespace (both ends of every
// bridge port see each frame that crosses the node-to-node link) and
// records which of the watched markers appeared in plaintext.
//
// A sync token sent over the fabric's loopback orders the capture: once
// the token has been read, every frame that crossed the link before it
// was sent has been read too, because each frame reached the capture
// socket's queue before the bridge passed it on.
type wire struct {
	sock *os.File
	sync net.PacketConn // unconnected UDP: sync tokens over the fabric's loopback

	mu      sync.Mutex
	markers map[string]bool            // marker → seen
	waiting map[string]chan<- struct{} // sync token → reader of it
	done    chan struct{}              // closed when the reader stops
}

// openWire opens an AF_PACKET socket for every protocol on every interface
// of ns and starts reading it.
func openWire(ns *cluster.NS) (*wire, error) {
	w := &wire{markers: map[string]bool{}, waiting: map[string]chan<- struct{}{}, done: make(chan struct{})}
	err := ns.Do(func() error {
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
		if err != nil {
			return fmt.Errorf("AF_PACKET socket: %w", err)
		}
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4<<20)
		w.sock = os.NewFile(uintptr(fd), "capture")
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("demo: capture in %s: %w", ns.Name(), err)
	}
	if w.sync, err = ns.ListenPacket("udp4", "127.0.0.1:0"); err != nil {
		w.sock.Close()
		return nil, fmt.Errorf("demo: capture sync socket: %w", err)
	}
	go w.read()
	return w, nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// syncPrefix starts every sync token.
const syncPrefix = "meshtun-demo-sync-"

func (w *wire) read() {
	defer close(w.done)
	buf := make([]byte, 256<<10)
	for {
		n, err := w.sock.Read(buf)
		if err != nil {
			return
		}
		frame := buf[:n]
		w.mu.Lock()
		if i := bytes.Index(frame, []byte(syncPrefix)); i >= 0 {
			tok := string(frame[i:min(n, i+len(syncPrefix)+tokenLen)])
			if ch, ok := w.waiting[tok]; ok {
				close(ch)
				delete(w.waiting, tok)
			}
		}
		for m, seen := range w.markers {
			if !seen && bytes.Contains(frame, []byte(m)) {
				w.markers[m] = true
			}
		}
		w.mu.Unlock()
	}
}

const tokenLen = 8

// watch starts looking for marker in captured frames.
func (w *wire) watch(marker string) {
	w.mu.Lock()
	w.markers[marker] = false
	w.mu.Unlock()
}

// seen reports whether marker has appeared in a captured frame, up to the
// last sync, and stops watching it.
func (w *wire) seen(ctx context.Context, marker string) (bool, error) {
	if err := w.flush(ctx); err != nil {
		return false, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	seen := w.markers[marker]
	delete(w.markers, marker)
	return seen, nil
}

// flush returns once every frame sent before the call has been read.
func (w *wire) flush(ctx context.Context) error {
	tok := syncPrefix + rand.Text()[:tokenLen]
	ch := make(chan struct{})
	w.mu.Lock()
	w.waiting[tok] = ch
	w.mu.Unlock()
	defer func() {
		w.mu.Lock()
		delete(w.waiting, tok)
		w.mu.Unlock()
	}()
	// To the discard port on the fabric's loopback: nothing listens, and
	// the socket is unconnected, so the port unreachable errors are
	// ignored.
	to := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9}
	if _, err := w.sync.WriteTo([]byte(tok), to); err != nil {
		return fmt.Errorf("demo: capture sync: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, deadline)
	defer cancel()
	select {
	case <-ch:
		return nil
	case <-w.done:
		return errors.New("demo: capture stopped")
	case <-ctx.Done():
		return fmt.Errorf("demo: capture sync: %w", ctx.Err())
	}
}

// Close stops the capture.
func (w *wire) Close() {
	w.sock.Close()
	w.sync.Close()
	<-w.done
}
