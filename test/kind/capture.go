package kind

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"time"
)

// Capture reads every frame crossing one interface of this host (AF_PACKET,
// all protocols, both directions) and remembers which of its markers it
// has seen in a frame. On the kind network's bridge it sees everything the
// nodes send each other.
type Capture struct {
	fd      int
	markers [][]byte
	mu      sync.Mutex
	seen    map[string]int
	frames  int
	bytes   int64
	done    chan struct{}
	err     error
}

// StartCapture opens the capture on iface; Stop ends it.
func StartCapture(iface string, markers ...string) (*Capture, error) {
	ifi, err := net.InterfaceByName(iface)
	if err != nil {
		return nil, fmt.Errorf("capture on %s: %w", iface, err)
	}
	proto := htons(syscall.ETH_P_ALL)
	fd, err := syscall.Socket(syscall.AF_PACKET, syscall.SOCK_RAW, int(proto))
	if err != nil {
		return nil, fmt.Errorf("capture on %s: AF_PACKET socket: %w", iface, err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrLinklayer{Protocol: proto, Ifindex: ifi.Index}); err != nil {
		syscall.Close(fd)
		return nil, fmt.Errorf("capture on %s: bind: %w", iface, err)
	}
	tv := syscall.NsecToTimeval((200 * time.Millisecond).Nanoseconds())
	if err := syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_RCVTIMEO, &tv); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_RCVBUF, 8<<20)
	c := &Capture{fd: fd, seen: map[string]int{}, done: make(chan struct{})}
	for _, m := range markers {
		c.markers = append(c.markers, []byte(m))
	}
	go c.loop(fd)
	return c, nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func (c *Capture) loop(fd int) {
	defer close(c.done)
	buf := make([]byte, 256<<10) // GSO frames are up to 64 KiB and more
	for {
		n, _, err := syscall.Recvfrom(fd, buf, 0)
		if err != nil {
			if errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EINTR) {
				c.mu.Lock()
				stop := c.fd < 0
				c.mu.Unlock()
				if stop {
					return
				}
				continue
			}
			c.mu.Lock()
			if c.fd >= 0 {
				c.err = err
			}
			c.mu.Unlock()
			return
		}
		c.mu.Lock()
		c.frames++
		c.bytes += int64(n)
		for _, m := range c.markers {
			if bytes.Contains(buf[:n], m) {
				c.seen[string(m)]++
			}
		}
		c.mu.Unlock()
	}
}

// Seen is how many frames carried marker so far.
func (c *Capture) Seen(marker string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.seen[marker]
}

// Stats is the frames and bytes captured so far.
func (c *Capture) Stats() (frames int, bytes int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.frames, c.bytes
}

// Stop ends the capture and returns its read error, if any.
func (c *Capture) Stop() error {
	c.mu.Lock()
	fd := c.fd
	c.fd = -1
	c.mu.Unlock()
	<-c.done
	syscall.Close(fd)
	return c.err
}
