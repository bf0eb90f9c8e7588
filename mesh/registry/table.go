package registry

import (
	"encoding/binary"
	"math/bits"
	"net/netip"
)

// addrTable is an immutable open-addressing hash table from an address
// and a port to a V, for the lookups that run on every new connection.
// Against a Go map keyed by netip.Addr it saves the generic hashing and
// the zone handle comparison: the key is the address's 16 bytes (an IPv4
// address and its IPv4-mapped IPv6 form are the same key) and the port,
// hashed by one multiplication. It is at most half full, so probes are
// short.
type addrTable[V any] struct {
	mask  uint64
	slots []slot[V]
}

type slot[V any] struct {
	hi, lo uint64
	port   uint16
	used   bool
	v      V
}

func addrKey(a netip.Addr) (hi, lo uint64) {
	b := a.As16()
	return binary.BigEndian.Uint64(b[:8]), binary.BigEndian.Uint64(b[8:])
}

func hashKey(hi, lo uint64, port uint16) uint64 {
	h, l := bits.Mul64(hi^0x9e3779b97f4a7c15, lo^uint64(port)<<48^0xd6e8feb86659fd93)
	return h ^ l
}

// newAddrTable returns a table with room for n keys.
func newAddrTable[V any](n int) *addrTable[V] {
	size := 8
	for size < 2*n {
		size <<= 1
	}
	return &addrTable[V]{mask: uint64(size - 1), slots: make([]slot[V], size)}
}

// put adds or replaces the value of (a, port). The table must not be
// filled beyond the n it was made for.
func (t *addrTable[V]) put(a netip.Addr, port uint16, v V) {
	hi, lo := addrKey(a)
	for i := hashKey(hi, lo, port) & t.mask; ; i = (i + 1) & t.mask {
		s := &t.slots[i]
		if !s.used || (s.hi == hi && s.lo == lo && s.port == port) {
			*s = slot[V]{hi: hi, lo: lo, port: port, used: true, v: v}
			return
		}
	}
}

// get returns the value of (a, port).
func (t *addrTable[V]) get(a netip.Addr, port uint16) (V, bool) {
	hi, lo := addrKey(a)
	for i := hashKey(hi, lo, port) & t.mask; ; i = (i + 1) & t.mask {
		s := &t.slots[i]
		if !s.used {
			var zero V
			return zero, false
		}
		if s.hi == hi && s.lo == lo && s.port == port {
			return s.v, true
		}
	}
}
