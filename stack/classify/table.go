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
	stateSyn               // SYN seen, no reply and no ACK yet
	stateEstablished       // a reply or an ACK seen
	stateClosed            // RST seen, or FIN in both directions
)

// Flow flag bits.
const (
	flagInitLo uint8 = 1 << iota // the initiator is the key's low endpoint
	flagFinLo                    // the low endpoint sent a FIN
	flagFinHi                    // the high endpoint sent a FIN
)

// flow is one slot of the open-addressing table (56 bytes).
type flow struct {
	key   flowKey
	last  int64  // coarse clock when the state last changed or a packet was seen
	hash  uint32 // low bits of the key's hash, for deletion without rehashing
	state uint8
	flags uint8
}

// shard is one mutex-protected open-addressing table with linear probing and
// backward-shift deletion (no tombstones, so it never needs rebuilding).
type shard struct {
	mu     sync.Mutex
	slots  []flow
	mask   uint32
	n      int // occupied slots
	limit  int // at most this many, so probe chains always end
	closed int // slots in stateClosed
	_      [64]byte
}

func (s *shard) init(slots int) {
	s.slots = make([]flow, slots)
	s.mask = uint32(slots - 1)
	s.limit = slots - slots/8
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

// track updates flow f for a packet from the low (fromLo) or high endpoint.
func (s *shard) track(f *flow, fromLo bool, tcpFlags uint8, now int64) {
	if f.state == stateClosed {
		// Grace period: the packet still goes to the netstack, but
		// the close timer keeps running.
		return
	}
	if tcpFlags&tcpRST != 0 {
		s.close(f, now)
		return
	}
	if f.state == stateSyn {
		fromInit := fromLo == (f.flags&flagInitLo != 0)
		if !fromInit || tcpFlags&(tcpACK|tcpSYN) == tcpACK {
			f.state = stateEstablished
		}
	}
	if tcpFlags&tcpFIN != 0 {
		if fromLo {
			f.flags |= flagFinLo
		} else {
			f.flags |= flagFinHi
		}
		if f.flags&(flagFinLo|flagFinHi) == flagFinLo|flagFinHi {
			s.close(f, now)
			return
		}
	}
	if f.last != now {
		f.last = now
	}
}

func (s *shard) close(f *flow, now int64) {
	f.state = stateClosed
	f.last = now
	s.closed++
}

// reopen turns closed flow f into a new flow started by a SYN from the low
// (initLo) or high endpoint.
func (s *shard) reopen(f *flow, initLo bool, now int64) {
	s.closed--
	f.state = stateSyn
	f.flags = 0
	if initLo {
		f.flags = flagInitLo
	}
	f.last = now
}

// put stores a new flow in empty slot i.
func (s *shard) put(i int, k *flowKey, h uint32, initLo bool, now int64) {
	f := &s.slots[i]
	f.key = *k
	f.hash = h
	f.state = stateSyn
	f.flags = 0
	if initLo {
		f.flags = flagInitLo
	}
	f.last = now
	s.n++
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
