package classify

import (
	"math/bits"
	"sync"
)

// flowKey identifies a TCP connection independently of direction: the two
// endpoints are stored in a canonical order (lower address, then port,
// first), so both directions of a connection hash to the same entry.
// Addresses are big-endian halves; IPv4 uses only the low half.
type flowKey struct {
	loHi, loLo uint64
	hiHi, hiLo uint64
	loPort     uint16
	hiPort     uint16
	v6         bool
}

// equal is k == *o, spelled out so that it inlines (the generated struct
// comparison calls memequal).
func (k *flowKey) equal(o *flowKey) bool {
	return k.loLo == o.loLo && k.hiLo == o.hiLo && k.loHi == o.loHi && k.hiHi == o.hiHi &&
		k.loPort == o.loPort && k.hiPort == o.hiPort && k.v6 == o.v6
}

// hash mixes the key with the classifier's random secret (wyhash-style
// 64x64->128 multiplies), so that remote peers cannot aim SYNs at one probe
// chain without knowing the secret.
func (k *flowKey) hash(s *[6]uint64) uint64 {
	ports := uint64(k.loPort)<<32 | uint64(k.hiPort)<<16
	if k.v6 {
		ports |= 1
	}
	a := mum(k.loHi^s[0], k.loLo^s[1])
	b := mum(k.hiHi^s[2], k.hiLo^s[3])
	return mum(a^ports^s[4], b^s[5])
}

func mum(x, y uint64) uint64 {
	hi, lo := bits.Mul64(x, y)
	return hi ^ lo
}

// Flow states. stateEmpty marks a free slot.
const (
	stateEmpty       uint8 = iota
	stateSyn               // half-open: the initiator has not acknowledged the responder's SYN yet
	stateEstablished       // the initiator's ACK of the responder's SYN seen
	stateClosed            // ended: closing grace period before removal
)

// Flow flag bits.
const (
	flagInitLo    uint16 = 1 << iota // the initiator is the key's low endpoint
	flagInitKnown                    // the initiator is known (a SYN was seen)
	flagFinLo                        // the low endpoint sent a FIN
	flagFinHi                        // the high endpoint sent a FIN
	flagOwned                        // the netstack holds the connection (owners > 0): it alone ends the flow
	flagHalf                         // counted as half-open (stateSyn, not owned, from Inbound)
	flagSeqLo                        // end[0] and win[0] are known
	flagSeqHi                        // end[1] and win[1] are known
	flagWSLo                         // the low endpoint offered window scaling (ws[0])
	flagWSHi                         // the high endpoint offered window scaling (ws[1])
	flagAckLo                        // ack[0] is known: the netstack sent an ACK from the low endpoint
	flagAckHi                        // ack[1] is known
)

// Sides of a flow, as indexes of its per-endpoint fields.
const (
	sideLo = 0
	sideHi = 1
)

func sideOf(fromLo bool) int {
	if fromLo {
		return sideLo
	}
	return sideHi
}

// flow is one slot of the open-addressing table (88 bytes).
type flow struct {
	key    flowKey
	last   int64     // coarse clock when the state last changed or a packet was seen
	end    [2]uint32 // per side: highest sequence number sent, plus one past its data, SYN and FIN
	win    [2]uint32 // per side: largest receive window advertised, scaled
	ack    [2]uint32 // per side: acknowledgment number of the netstack's last ACK from it (flagAckLo)
	hash   uint32    // low bits of the key's hash, for deletion without rehashing
	flags  uint16
	ws     [2]uint8 // per side: window scale offered in its SYN
	state  uint8
	owners uint8 // netstack endpoints holding the flow (both legs of a passthrough share it)
}

func (f *flow) initSide() int {
	if f.flags&flagInitLo != 0 {
		return sideLo
	}
	return sideHi
}

func seqFlag(side int) uint16 { return flagSeqLo << side }

// advance records the sequence space and window of a segment from side.
func (f *flow) advance(side int, seg *segment) {
	end := seg.seq + seg.plen
	if seg.flags&(tcpSYN|tcpFIN) != 0 {
		end++
	}
	win := uint32(seg.win)
	if seg.flags&tcpSYN == 0 && f.flags&(flagWSLo|flagWSHi) == flagWSLo|flagWSHi {
		win <<= f.ws[side] // RFC 7323: never scaled in a SYN
	}
	if f.flags&seqFlag(side) == 0 {
		f.end[side], f.win[side] = end, win
		f.flags |= seqFlag(side)
		return
	}
	if int32(end-f.end[side]) > 0 {
		f.end[side] = end
	}
	if win > f.win[side] {
		f.win[side] = win
	}
}

// rstAcceptable reports whether a RST from side is in the window of the
// connection as far as the classifier can tell (RFC 5961 §3): its sequence
// number must lie within the receiver's window of what side has sent. A
// RST answering the SYN (the flow is half-open and side is the responder)
// must acknowledge the SYN (RFC 793). Where the classifier has not seen
// side's sequence numbers it cannot check, and accepts.
func (f *flow) rstAcceptable(side int, seg *segment) bool {
	other := 1 - side
	if f.state == stateSyn && f.flags&flagInitKnown != 0 && side != f.initSide() && f.flags&seqFlag(side) == 0 {
		init := f.initSide()
		if f.flags&seqFlag(init) == 0 {
			return true
		}
		return seg.flags&tcpACK != 0 && seg.ack == f.end[init]
	}
	if f.flags&seqFlag(side) == 0 {
		return true
	}
	win := int64(65535)
	if f.flags&seqFlag(other) != 0 && f.win[other] > 0 {
		win = int64(f.win[other])
	}
	d := int64(int32(seg.seq - f.end[side]))
	return d >= -win && d <= win
}

// shard is one mutex-protected open-addressing table with linear probing and
// backward-shift deletion (no tombstones, so it never needs rebuilding).
type shard struct {
	mu        sync.Mutex
	slots     []flow
	mask      uint32
	n         int // occupied slots
	limit     int // at most this many, so probe chains always end
	closed    int // slots in stateClosed
	half      int // slots with flagHalf
	halfLimit int // at most this many half-open flows
	c         *Classifier
	_         [64]byte
}

func (s *shard) init(c *Classifier, slots, halfLimit int) {
	s.c = c
	s.slots = make([]flow, slots)
	s.mask = uint32(slots - 1)
	s.limit = slots - slots/8
	s.halfLimit = halfLimit
}

// unhalf takes f out of the half-open accounting, if it is in it.
func (s *shard) unhalf(f *flow) {
	if f.flags&flagHalf == 0 {
		return
	}
	f.flags &^= flagHalf
	s.half--
	s.c.halfTotal.Add(-1)
	s.c.halfBySrc[s.c.srcBucket(&f.key, f.flags&flagInitLo != 0)].Add(-1)
}

// lookup returns the slot holding k and true, or the empty slot where k
// would go and false.
func (s *shard) lookup(k *flowKey, h uint32) (int, bool) {
	i := h & s.mask
	for {
		f := &s.slots[i]
		if f.state == stateEmpty {
			return int(i), false
		}
		if f.hash == h && f.key.equal(k) {
			return int(i), true
		}
		i = (i + 1) & s.mask
	}
}

// remove empties slot i, shifting later members of the probe chain back.
func (s *shard) remove(i int) {
	if s.slots[i].state == stateClosed {
		s.closed--
	}
	s.unhalf(&s.slots[i])
	s.n--
	hole := uint32(i)
	j := hole
	for {
		j = (j + 1) & s.mask
		f := &s.slots[j]
		if f.state == stateEmpty {
			break
		}
		// f may move into the hole unless its home slot lies
		// cyclically in (hole, j].
		home := f.hash & s.mask
		if (j-home)&s.mask >= (j-hole)&s.mask {
			s.slots[hole] = *f
			hole = j
		}
	}
	s.slots[hole] = flow{}
}

// evictOldestClosed removes the closed flow that has been closed the
// longest, if any. It scans the whole shard: it runs only when the table is
// full.
func (s *shard) evictOldestClosed() bool {
	if s.closed == 0 {
		return false
	}
	best := -1
	for i := range s.slots {
		f := &s.slots[i]
		if f.state == stateClosed && (best < 0 || f.last < s.slots[best].last) {
			best = i
		}
	}
	if best < 0 {
		return false
	}
	s.remove(best)
	return true
}

// track updates flow f for segment seg. trusted is set for the
// netstack's own packets. It returns false for a RST that is not in the
// window: such a RST neither ends the flow nor reaches anyone.
func (s *shard) track(f *flow, seg *segment, trusted bool, now int64) bool {
	side := sideOf(seg.fromLo)
	if seg.flags&tcpRST != 0 {
		// A flow held twice is a connection the netstack both accepted
		// and dialled on the same addresses (passthrough keeping the
		// pod's address): two sequence spaces share the entry, and the
		// netstack's two endpoints check RSTs themselves (RFC 5961).
		if !trusted && f.owners < 2 && !f.rstAcceptable(side, seg) {
			return false
		}
		// A flow the netstack owns ends when the netstack lets go of
		// it (Release), which also covers a RST it rejects (RFC 5961
		// challenge ACK); others end here.
		if f.state != stateClosed && f.flags&flagOwned == 0 {
			s.close(f, now)
		}
		return true
	}
	if f.state == stateClosed {
		// Grace period: the packet still goes to the netstack, but
		// the close timer keeps running.
		return true
	}
	if seg.flags&tcpSYN != 0 {
		if seg.flags&tcpACK == 0 && f.flags&flagInitKnown == 0 {
			// A flow registered by Own before its SYN: the SYN names
			// the initiator.
			f.flags |= flagInitKnown
			if seg.fromLo {
				f.flags |= flagInitLo
			}
		}
		if seg.wscale >= 0 {
			f.ws[side] = uint8(seg.wscale)
			f.flags |= flagWSLo << side
		}
		f.flags &^= seqFlag(side) | flagAckLo<<side // a SYN (re)starts the side's sequence space
		f.advance(side, seg)
	} else {
		f.advance(side, seg)
		// Established only once the initiator acknowledges the
		// responder's SYN: a SYN-ACK alone (which the netstack sends to
		// any SYN, spoofed or not) does not make a flow live.
		if f.state == stateSyn && seg.flags&tcpACK != 0 && f.flags&flagInitKnown != 0 && side == f.initSide() {
			resp := 1 - side
			if f.flags&seqFlag(resp) == 0 || seg.ack == f.end[resp] {
				f.state = stateEstablished
				s.unhalf(f)
			}
		}
	}
	if seg.flags&tcpFIN != 0 && f.flags&flagOwned == 0 {
		if seg.fromLo {
			f.flags |= flagFinLo
		} else {
			f.flags |= flagFinHi
		}
		if f.flags&(flagFinLo|flagFinHi) == flagFinLo|flagFinHi {
			s.close(f, now)
			return true
		}
	}
	if f.last != now {
		f.last = now
	}
	return true
}

func (s *shard) close(f *flow, now int64) {
	s.unhalf(f)
	f.state = stateClosed
	f.last = now
	s.closed++
}

// put stores a new flow in empty slot i; seg, if not nil, is its SYN.
func (s *shard) put(i int, k *flowKey, h uint32, seg *segment, now int64) *flow {
	f := &s.slots[i]
	*f = flow{key: *k, hash: h, state: stateSyn, last: now}
	if seg != nil {
		f.flags = flagInitKnown
		if seg.fromLo {
			f.flags |= flagInitLo
		}
		side := sideOf(seg.fromLo)
		if seg.wscale >= 0 {
			f.ws[side] = uint8(seg.wscale)
			f.flags |= flagWSLo << side
		}
		f.advance(side, seg)
	}
	s.n++
	return f
}

// evictHalfOpen makes room for a half-open flow whose initiator's bucket
// will then hold mine flows: among the first few half-open flows found
// from slot start on, it removes the oldest whose initiator holds more (a
// source with none pending yet may also displace another with one).
// Sources with fewer pending handshakes thus displace those with more,
// which converges to an equal share per source, and a flooding source
// with its share is refused at once. It reports whether it removed one. The shard is at its half-open limit, so at least one
// half-open flow is found; with the default sizes one in eight slots
// holds one, and the walk is short.
func (s *shard) evictHalfOpen(start uint32, mine int32) bool {
	const sample = 8
	best, seen := -1, 0
	for n, i := 0, start&s.mask; n < len(s.slots) && seen < sample; n, i = n+1, (i+1)&s.mask {
		f := &s.slots[i]
		if f.flags&flagHalf == 0 {
			continue
		}
		seen++
		if n := s.c.halfBySrc[s.c.srcBucket(&f.key, f.flags&flagInitLo != 0)].Load(); n <= mine && !(mine == 1 && n == 1) {
			continue
		}
		if best < 0 || f.last < s.slots[best].last {
			best = int(i)
		}
	}
	if best < 0 {
		return false
	}
	s.remove(best)
	return true
}

// sweep removes flows idle for longer than their state's timeout and
// returns how many.
func (s *shard) sweep(now int64, synTimeout, idleTimeout, closeTimeout int64) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	removed := 0
	for i := 0; i < len(s.slots); {
		f := &s.slots[i]
		var timeout int64
		switch f.state {
		case stateEmpty:
			i++
			continue
		case stateSyn:
			timeout = synTimeout
		case stateEstablished:
			timeout = idleTimeout
		default:
			timeout = closeTimeout
		}
		if f.flags&flagOwned != 0 {
			// The netstack holds the connection: the flow lives as
			// long as its endpoint does.
			i++
			continue
		}
		if now-f.last < timeout {
			i++
			continue
		}
		// remove may shift a later entry into slot i: look at i again.
		// Entries only move backwards, and one that wraps around to
		// the end was already looked at, so every entry is seen.
		s.remove(i)
		removed++
	}
	return removed
}
