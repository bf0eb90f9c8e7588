package stack

import (
	"encoding/binary"
	"sync"
	"sync/atomic"
	"time"
)

// ackDelayer holds the netstack's pure ACKs back for a short time, so that
// the reply that usually follows carries the acknowledgment instead.
//
// gVisor's TCP has no delayed ACK: its processor goroutine acknowledges
// every batch of received segments at once, after it has readied the
// reader of the data (the relay). On a request/response connection that
// ACK is written into the TUN (and forwarded onwards by the kernel inside
// that write) while the relay waits for the processor's thread, and it is
// redundant: the response, a few tens of microseconds later, acknowledges
// the same bytes. Linux's own TCP does the same (a delayed ACK, piggybacked
// on the reply), with a longer timer.
//
// Only flows whose both ends are the netstack's (the classifier's Own
// count: passthrough, which accepts the client and dials the server with
// the same addresses, and same-node traffic) are concerned: there the
// processor's ACK write sat between a request and its relay on both legs,
// and same-run A/Bs measured request/response p50 -7 to -14 µs; on a
// cross-node mesh connection (one netstack end per node) they measured no
// gain beyond the noise (docs/decisions/2026-12-01-levers-round-two.md).
//
// An ACK is held when it carries no data, no SYN, FIN or RST, no SACK
// block (a duplicate ACK reporting a loss goes at once), and acknowledges
// more than one byte beyond the netstack's previous ACK on the flow, but
// less than two segments (the classifier remembers the previous one). So
// these go at once: the handshake's ACK, which a server may be waiting for
// before it speaks (it has no previous one); window updates and duplicate
// ACKs (they acknowledge nothing new); the ACK of a FIN (one byte: often
// the connection's last packet, which nothing would supersede); and ACKs
// of bulk data.
// The next packet of the same flow supersedes it: a data segment or FIN
// carries a newer acknowledgment, so the held ACK is dropped; another pure
// ACK goes out at once, after the held one if both acknowledge the same
// byte (a window update or a duplicate ACK must not be lost). Otherwise
// the held ACK is written when the delay expires.
type ackDelayer struct {
	delay time.Duration
	write func(frame []byte) error // writes one frame, virtio-net header included

	pending atomic.Int32 // len(held), read without mu

	mu     sync.Mutex
	held   map[ackKey]*heldAck
	free   []*heldAck
	timer  *time.Timer
	armed  bool
	closed bool
	base   time.Time

	// Counters, for tests and the data-plane metrics.
	dropped atomic.Uint64 // held ACKs superseded by a later packet
	flushed atomic.Uint64 // held ACKs written when their delay expired
}

// ackKey identifies the flow of an outbound packet: source and destination
// addresses (IPv4 in the first 4 bytes of each) and ports.
type ackKey struct {
	src, dst   [16]byte
	sport, dpt uint16
	v6         bool
}

// heldAck is one held frame.
type heldAck struct {
	frame    [maxHeldFrame]byte
	n        int
	ack      uint32
	deadline time.Duration // since ackDelayer.base
}

// maxHeldFrame bounds a held frame: virtio-net header, IPv6 header and a
// TCP header with the largest options.
const maxHeldFrame = 10 + 40 + 60

// defaultMSS is the segment size assumed for the two-segment rule when the
// packet does not carry its connection's MSS.
const defaultMSS = 1460

func newAckDelayer(delay time.Duration, write func([]byte) error) *ackDelayer {
	d := &ackDelayer{delay: delay, write: write, held: make(map[ackKey]*heldAck), base: time.Now()}
	d.timer = time.AfterFunc(time.Hour, d.expire)
	d.timer.Stop()
	return d
}

// pureACK parses the IP and TCP headers hdr of an outbound packet with
// payload bytes after them. It returns the flow's key and ok if hdr is a
// TCP segment, and whether it is a pure ACK that may be held: ACK as the
// only flag (PSH, URG, ECE and CWR excluded too), no payload, no SACK
// option.
func pureACK(hdr []byte, payload int) (k ackKey, ack uint32, pure, ok bool) {
	if len(hdr) < 1 {
		return k, 0, false, false
	}
	var tcp []byte
	switch hdr[0] >> 4 {
	case 4:
		if len(hdr) < 20 || hdr[9] != 6 {
			return k, 0, false, false
		}
		ihl := int(hdr[0]&0x0f) * 4
		if ihl < 20 || len(hdr) < ihl+20 {
			return k, 0, false, false
		}
		copy(k.src[:4], hdr[12:16])
		copy(k.dst[:4], hdr[16:20])
		tcp = hdr[ihl:]
	case 6:
		// The netstack writes no extension headers.
		if len(hdr) < 60 || hdr[6] != 6 {
			return k, 0, false, false
		}
		copy(k.src[:], hdr[8:24])
		copy(k.dst[:], hdr[24:40])
		k.v6 = true
		tcp = hdr[40:]
	default:
		return k, 0, false, false
	}
	k.sport = binary.BigEndian.Uint16(tcp[0:2])
	k.dpt = binary.BigEndian.Uint16(tcp[2:4])
	ack = binary.BigEndian.Uint32(tcp[8:12])
	if tcp[13] != 0x10 || payload != 0 {
		return k, ack, false, true
	}
	doff := int(tcp[12]>>4) * 4
	if doff < 20 || doff > len(tcp) {
		return k, ack, false, true
	}
	for opts := tcp[20:doff]; len(opts) > 0; {
		switch opts[0] {
		case 0: // end of options
			return k, ack, true, true
		case 1: // no-op
			opts = opts[1:]
			continue
		case 5: // SACK blocks: a loss is being reported
			return k, ack, false, true
		}
		if len(opts) < 2 || int(opts[1]) < 2 || int(opts[1]) > len(opts) {
			return k, ack, false, true
		}
		opts = opts[opts[1]:]
	}
	return k, ack, true, true
}

// packet is called for every outbound TCP packet of flow k before it is
// written, with frame the whole packet as written (nil unless it may be
// held). It returns true if the packet was held: the caller must not write
// it.
func (d *ackDelayer) packet(k *ackKey, ack uint32, pure bool, frame [][]byte) bool {
	if frame == nil && d.pending.Load() == 0 {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if h, ok := d.held[*k]; ok {
		delete(d.held, *k)
		d.pending.Add(-1)
		if pure && h.ack == ack {
			// Same acknowledgment: a window update or a duplicate
			// ACK. Both go, in order.
			d.flushed.Add(1)
			_ = d.write(h.frame[:h.n])
		} else {
			d.dropped.Add(1)
		}
		d.free = append(d.free, h)
		return false
	}
	if frame == nil || d.closed {
		return false
	}
	h := d.alloc()
	h.n = 0
	for _, b := range frame {
		if h.n+len(b) > len(h.frame) {
			d.free = append(d.free, h)
			return false
		}
		h.n += copy(h.frame[h.n:], b)
	}
	h.ack = ack
	now := time.Since(d.base)
	h.deadline = now + d.delay
	d.held[*k] = h
	d.pending.Add(1)
	if !d.armed {
		d.armed = true
		d.timer.Reset(d.delay)
	}
	return true
}

func (d *ackDelayer) alloc() *heldAck {
	if n := len(d.free); n > 0 {
		h := d.free[n-1]
		d.free = d.free[:n-1]
		return h
	}
	return new(heldAck)
}

// expire writes the held ACKs whose delay has passed and re-arms the timer
// for the others. Writing under mu keeps a held ACK ahead of any later
// packet of its flow.
func (d *ackDelayer) expire() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.armed = false
	if d.closed {
		return
	}
	now := time.Since(d.base)
	next := time.Duration(-1)
	for k, h := range d.held {
		if h.deadline <= now {
			delete(d.held, k)
			d.pending.Add(-1)
			d.flushed.Add(1)
			_ = d.write(h.frame[:h.n])
			d.free = append(d.free, h)
			continue
		}
		if next < 0 || h.deadline < next {
			next = h.deadline
		}
	}
	if next >= 0 {
		d.armed = true
		d.timer.Reset(next - now)
	}
}

// close stops the timer; held ACKs are dropped with the device.
func (d *ackDelayer) close() {
	d.mu.Lock()
	d.closed = true
	d.timer.Stop()
	clear(d.held)
	d.pending.Store(0)
	d.mu.Unlock()
}
