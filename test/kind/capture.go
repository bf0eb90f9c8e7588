package kind

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// Capture reads every frame crossing the ports of a Linux bridge of this
// host (AF_PACKET, all protocols, both directions, one socket per port)
// and remembers which of its markers it has seen in a frame. On the kind
// network's bridge it sees everything the nodes send each other. (A socket
// on the bridge device itself sees only what the bridge delivers to this
// host, not the frames it forwards from node to node.)
type Capture struct {
	bridge  string
	ifaces  map[int]bool // interface indexes of the ports captured
	ports   []*portCapture
	markers [][]byte
	mu      sync.Mutex
	seen    map[string]int
	frames  int
	bytes   int64
}

type portCapture struct {
	fd   int
	done chan struct{}
	err  error
}

// StartCapture opens the capture on every port of bridge; Stop ends it.
func StartCapture(bridge string, markers ...string) (*Capture, error) {
	ports, err := os.ReadDir(filepath.Join("/sys/class/net", bridge, "brif"))
	if err != nil {
		return nil, fmt.Errorf("capture on bridge %s: %w", bridge, err)
	}
	if len(ports) == 0 {
		return nil, fmt.Errorf("capture on bridge %s: no ports", bridge)
	}
	c := &Capture{bridge: bridge, ifaces: map[int]bool{}, seen: map[string]int{}}
	for _, m := range markers {
		c.markers = append(c.markers, []byte(m))
	}
	for _, p := range ports {
		pc, err := c.open(p.Name())
		if err != nil {
			c.Stop()
			return nil, err
		}
		c.ports = append(c.ports, pc)
	}
	return c, nil
}

// AddNewPorts captures on the bridge's ports that appeared since the
// capture started (a restarted node's new veth, which may have the old
// one's name) and returns how many.
func (c *Capture) AddNewPorts() (int, error) {
	ports, err := os.ReadDir(filepath.Join("/sys/class/net", c.bridge, "brif"))
	if err != nil {
		return 0, fmt.Errorf("capture on bridge %s: %w", c.bridge, err)
	}
	n := 0
	for _, p := range ports {
		ifi, err := net.InterfaceByName(p.Name())
		if err != nil || c.ifaces[ifi.Index] {
			continue
		}
		pc, err := c.open(p.Name())
		if err != nil {
			return n, err
		}
		c.ports = append(c.ports, pc)
		n++
	}
	return n, nil
}

func (c *Capture) open(iface string) (*portCapture, error) {
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
	pc := &portCapture{fd: fd, done: make(chan struct{})}
	c.ifaces[ifi.Index] = true
	go c.loop(pc, fd)
	return pc, nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func (c *Capture) loop(pc *portCapture, fd int) {
	defer close(pc.done)
	buf := make([]byte, 256<<10) // GSO frames are up to 64 KiB and more
	for {
		n, _, err := syscall.Recvfrom(fd, buf, 0)
		if err != nil {
			if errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EINTR) {
				c.mu.Lock()
				stop := pc.fd < 0
				c.mu.Unlock()
				if stop {
					return
				}
				continue
			}
			c.mu.Lock()
			if pc.fd >= 0 {
				pc.err = err
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

// Stop ends the capture and returns the first read error, if any.
func (c *Capture) Stop() error {
	var first error
	for _, pc := range c.ports {
		c.mu.Lock()
		fd := pc.fd
		pc.fd = -1
		c.mu.Unlock()
		<-pc.done
		syscall.Close(fd)
		if pc.err != nil && first == nil {
			first = pc.err
		}
	}
	c.ports = nil
	return first
}
