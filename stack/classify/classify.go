package classify

import (
	"context"
	"encoding/binary"
	"math/bits"
	"math/rand/v2"
	"net/netip"
	"strconv"
	"sync/atomic"
	"time"
)

// Verdict is what to do with a packet read from the TUN.
type Verdict uint8

const (
	// Verbatim: write the packet back into the TUN unchanged.
	Verbatim Verdict = iota
	// Intercept: hand the packet to the netstack.
	Intercept
	// Drop: discard the packet; the DropReason says why.
	Drop
)

// String returns "verbatim", "intercept" or "drop".
func (v Verdict) String() string {
	switch v {
	case Verbatim:
		return "verbatim"
	case Intercept:
		return "intercept"
	case Drop:
		return "drop"
	}
	return "verdict(" + strconv.Itoa(int(v)) + ")"
}

// DropReason says why a packet was dropped.
type DropReason uint8

const (
	// NoDrop is the reason returned with Verbatim and Intercept.
	NoDrop DropReason = iota
	// TooShort: shorter than the fixed IPv4 (20 bytes) or IPv6 (40 bytes)
	// header, or empty.
	TooShort
	// BadVersion: the version nibble is neither 4 nor 6.
	BadVersion
	// BadHeaderLength: IPv4 IHL below 5.
	BadHeaderLength
	// HeaderTruncated: the IPv4 header (IHL) extends past the packet.
	HeaderTruncated
	// BadTotalLength: IPv4 total length smaller than the header.
	BadTotalLength
	// Truncated: the packet is shorter than its IPv4 total length or its
	// IPv6 payload length says.
	Truncated
	// ExtHeaderTruncated: an IPv6 extension header extends past the
	// payload.
	ExtHeaderTruncated
	// TooManyExtHeaders: more than 8 IPv6 extension headers before TCP.
	TooManyExtHeaders
	// TCPTruncated: the TCP header (20 bytes, or its data offset) extends
	// past the IP payload.
	TCPTruncated
	// BadTCPDataOffset: TCP data offset below 5.
	BadTCPDataOffset
	// TableFull: a SYN the policy selects arrived while the flow table was
	// full. It is dropped, not forwarded, so that mesh traffic never
	// bypasses the mesh; the client will retransmit.
	TableFull
	// FragmentedTCP: an IPv4 fragment of a TCP segment, or an IPv6
	// fragment whose next header is TCP or an extension header that may
	// lead to TCP. The classifier cannot see the ports of a later
	// fragment, and the receiving pod would reassemble the segment, so
	// letting TCP fragments through verbatim would let a connection
	// bypass interception. TCP sets DF and does path-MTU discovery, so
	// real TCP is not fragmented.
	FragmentedTCP
	// RSTOutOfWindow: a RST whose sequence number is outside the window
	// of its flow (RFC 5961 §3). Blind injection: it neither ends the
	// flow nor reaches either end.
	RSTOutOfWindow
	// HalfOpenPerSource: a SYN from a source that already has
	// Config.MaxHalfOpenPerSource handshakes pending.
	HalfOpenPerSource
	// HalfOpenFull: a SYN while Config.MaxHalfOpen handshakes are pending
	// and no source holds more than the SYN's own would.
	HalfOpenFull

	numDropReasons = iota
)

var dropReasonNames = [numDropReasons]string{
	NoDrop:             "none",
	TooShort:           "too-short",
	BadVersion:         "bad-version",
	BadHeaderLength:    "bad-header-length",
	HeaderTruncated:    "header-truncated",
	BadTotalLength:     "bad-total-length",
	Truncated:          "truncated",
	ExtHeaderTruncated: "ext-header-truncated",
	TooManyExtHeaders:  "too-many-ext-headers",
	TCPTruncated:       "tcp-truncated",
	BadTCPDataOffset:   "bad-tcp-data-offset",
	TableFull:          "table-full",
	FragmentedTCP:      "fragmented-tcp",
	RSTOutOfWindow:     "rst-out-of-window",
	HalfOpenPerSource:  "half-open-per-source",
	HalfOpenFull:       "half-open-full",
}

// String returns a short kebab-case name such as "table-full".
func (r DropReason) String() string {
	if int(r) < len(dropReasonNames) {
		return dropReasonNames[r]
	}
	return "drop-reason(" + strconv.Itoa(int(r)) + ")"
}

// Policy decides which new TCP connections are taken into the netstack.
// InterceptTCP is called once per SYN from the TUN, with the SYN's source
// and destination; it must not allocate and must be safe for concurrent
// use. For a segment of no known flow the classifier asks it about both
// orientations (whichever endpoint may have opened the connection): when
// both say yes, no verbatim connection can carry the segment, and it goes
// to the netstack (which answers with a RST unless it has the connection)
// instead of out in the clear.
type Policy interface {
	InterceptTCP(src netip.AddrPort, dst netip.AddrPort) bool
}

// PolicyFunc adapts a function to Policy.
type PolicyFunc func(src, dst netip.AddrPort) bool

// InterceptTCP calls f(src, dst).
func (f PolicyFunc) InterceptTCP(src, dst netip.AddrPort) bool { return f(src, dst) }

// Config configures a Classifier. Zero fields take the defaults.
type Config struct {
	// MaxFlows bounds the flow table; default 65536.
	MaxFlows int
	// SynTimeout expires half-open flows (the initiator has not
	// acknowledged the responder's SYN) that the netstack does not own;
	// default 5s.
	SynTimeout time.Duration
	// IdleTimeout expires established flows without packets; default
	// 24h. Expiring a live proxied connection breaks it, so keep it long.
	IdleTimeout time.Duration
	// CloseTimeout is how long a flow stays after a RST or the second FIN,
	// so that packets in flight still reach the netstack; default 15s.
	CloseTimeout time.Duration
	// MaxHalfOpen bounds the half-open flows started by SYNs from the
	// TUN; default MaxFlows/4. When it is reached, a SYN from a source
	// with fewer pending handshakes displaces one of a source with more.
	MaxHalfOpen int
	// MaxHalfOpenPerSource bounds the half-open flows one source address
	// may have; default 1024.
	MaxHalfOpenPerSource int
	// Policy selects the SYNs to intercept; nil intercepts nothing.
	Policy Policy
	// Exempt, if set, holds meshtun's own kernel sockets: a segment from
	// one of them is never intercepted, whatever the policy says.
	Exempt *Exempt
}

// Defaults for zero Config fields.
const (
	DefaultMaxFlows   = 65536
	DefaultSynTimeout = 5 * time.Second
	// DefaultMaxHalfOpenPerSource is the default of
	// Config.MaxHalfOpenPerSource.
	DefaultMaxHalfOpenPerSource = 1024
	DefaultIdleTimeout          = 24 * time.Hour
	DefaultCloseTimeout         = 15 * time.Second
)

// Proto is the coarse protocol class packets and bytes are counted by.
type Proto uint8

// Protocol classes. Other covers every other IP protocol, and IPv6 packets
// whose first header is an extension header.
const (
	ProtoTCP Proto = iota
	ProtoUDP
	ProtoICMP
	ProtoOther
	numProtos
)

var protoNames = [numProtos]string{"tcp", "udp", "icmp", "other"}

// String returns "tcp", "udp", "icmp" or "other".
func (p Proto) String() string {
	if p < numProtos {
		return protoNames[p]
	}
	return "proto(" + strconv.Itoa(int(p)) + ")"
}

// protoOf returns the class of a packet from its IP header's protocol
// field (IPv4) or first next-header (IPv6).
func protoOf(pkt []byte) Proto {
	var n byte
	switch {
	case len(pkt) >= 20 && pkt[0]>>4 == 4:
		n = pkt[9]
	case len(pkt) >= 40 && pkt[0]>>4 == 6:
		n = pkt[6]
	default:
		return ProtoOther
	}
	switch n {
	case 6:
		return ProtoTCP
	case 17:
		return ProtoUDP
	case 1, 58:
		return ProtoICMP
	}
	return ProtoOther
}

// Stats is a snapshot of a Classifier's counters.
type Stats struct {
	// Packets passed to Inbound, by verdict.
	Verbatim, Intercepted, Dropped uint64
	// Verbatim and intercepted packets and bytes (IP packets, headers
	// included) by protocol class, indexed by Proto.
	VerbatimPackets, VerbatimBytes, InterceptedPackets, InterceptedBytes [numProtos]uint64
	// DropsByReason counts Inbound drops, indexed by DropReason.
	DropsByReason [numDropReasons]uint64

	// Packets passed to Outbound.
	Outbound uint64
	// OutboundMalformed counts Outbound packets that could not be parsed.
	OutboundMalformed uint64
	// OutboundNoFlow counts Outbound TCP packets (not SYNs) of no known
	// flow, typically packets sent after their flow expired.
	OutboundNoFlow uint64
	// OutboundTableFull counts Outbound SYNs not registered because the
	// table was full.
	OutboundTableFull uint64
	// UnknownIntercepted counts segments of no known flow that the policy
	// says would have been intercepted whichever side opened the
	// connection: they go to the netstack, which resets them unless it
	// has the connection, never out verbatim.
	UnknownIntercepted uint64
	// OwnFull counts Own calls for a flow that did not fit in the table.
	OwnFull uint64

	// FlowsInserted counts flows started (by Inbound or Outbound SYNs).
	FlowsInserted uint64
	// FlowsExpired counts flows removed by Sweep.
	FlowsExpired uint64
	// FlowsReplaced counts closed flows removed before their
	// CloseTimeout, to make room in a full table or because a new SYN
	// reused their addresses and ports.
	FlowsReplaced uint64
	// Flows is the current number of flows in the table.
	Flows int
	// HalfOpen is the current number of half-open flows started by SYNs
	// from the TUN and not yet owned by the netstack.
	HalfOpen int
}

// counters are the Classifier's statistics.
type counters struct {
	dropped                     atomic.Uint64
	byProto                     [2][numProtos]struct{ packets, bytes atomic.Uint64 } // [verdict]
	drops                       [numDropReasons]atomic.Uint64
	outbound, outMalformed      atomic.Uint64
	outNoFlow, outTableFull     atomic.Uint64
	inserted, expired, replaced atomic.Uint64
	unknown, ownFull            atomic.Uint64
}

// srcBuckets is the number of per-source half-open counters; sources
// that share one share its bound.
const srcBuckets = 1 << 16

type policyBox struct{ p Policy }

// Classifier classifies the packets of one TUN device. Create it with New.
type Classifier struct {
	seed       [6]uint64
	shards     []shard
	shardShift uint // 64 - log2(len(shards))
	maxFlows   int64
	count      atomic.Int64 // flows in all shards

	synTimeout, idleTimeout, closeTimeout int64 // nanoseconds

	halfBySrc    []atomic.Int32 // half-open flows per initiator address bucket
	halfTotal    atomic.Int64
	maxPerSource int32

	base  time.Time    // origin of the coarse clock
	clock atomic.Int64 // nanoseconds since base, advanced by Sweep

	policy atomic.Pointer[policyBox]
	exempt *Exempt
	st     counters
}

// New returns a Classifier with its flow table allocated up front (160 to
// 320 bytes per flow of MaxFlows, and 256 KiB of per-source counters).
func New(cfg Config) *Classifier {
	if cfg.MaxFlows <= 0 {
		cfg.MaxFlows = DefaultMaxFlows
	}
	if cfg.MaxHalfOpen <= 0 {
		cfg.MaxHalfOpen = max(cfg.MaxFlows/4, 1)
	}
	if cfg.MaxHalfOpenPerSource <= 0 {
		cfg.MaxHalfOpenPerSource = DefaultMaxHalfOpenPerSource
	}
	if cfg.SynTimeout <= 0 {
		cfg.SynTimeout = DefaultSynTimeout
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = DefaultIdleTimeout
	}
	if cfg.CloseTimeout <= 0 {
		cfg.CloseTimeout = DefaultCloseTimeout
	}
	c := &Classifier{
		maxFlows:     int64(cfg.MaxFlows),
		synTimeout:   int64(cfg.SynTimeout),
		idleTimeout:  int64(cfg.IdleTimeout),
		closeTimeout: int64(cfg.CloseTimeout),
		base:         time.Now(),
		halfBySrc:    make([]atomic.Int32, srcBuckets),
		maxPerSource: int32(cfg.MaxHalfOpenPerSource),
		exempt:       cfg.Exempt,
	}
	for i := range c.seed {
		c.seed[i] = rand.Uint64() | 1
	}
	// One shard per 1024 flows, at most 64; each shard has room for
	// twice its share, so an uneven spread does not fill one early.
	nShards := 1
	for nShards < 64 && nShards*1024 < cfg.MaxFlows {
		nShards *= 2
	}
	c.shardShift = uint(64 - bits.TrailingZeros(uint(nShards)))
	per := (cfg.MaxFlows + nShards - 1) / nShards
	slots := 8
	for slots < 2*per {
		slots *= 2
	}
	c.shards = make([]shard, nShards)
	halfPer := max((cfg.MaxHalfOpen+nShards-1)/nShards, 1)
	for i := range c.shards {
		c.shards[i].init(c, slots, halfPer)
	}
	c.SetPolicy(cfg.Policy)
	return c
}

// SetPolicy replaces the policy for SYNs that arrive from now on; flows
// already in the table are not affected. Nil intercepts nothing. Safe to
// call while packets are being classified.
func (c *Classifier) SetPolicy(p Policy) {
	c.policy.Store(&policyBox{p})
}

func (c *Classifier) shardFor(h uint64) *shard {
	if len(c.shards) == 1 {
		return &c.shards[0]
	}
	return &c.shards[h>>c.shardShift]
}

// Inbound classifies a packet read from the TUN.
func (c *Classifier) Inbound(pkt []byte) (Verdict, DropReason) {
	var seg segment
	res, reason := parse(pkt, true, &seg)
	var v Verdict
	switch res {
	case parsedOther:
		v = Verbatim
	case parsedMalformed:
		v = Drop
	default:
		v, reason = c.inboundTCP(pkt, &seg)
	}
	switch v {
	case Verbatim, Intercept:
		// The verdict totals are the sums over protocols (Stats).
		bp := &c.st.byProto[v][protoOf(pkt)]
		bp.packets.Add(1)
		bp.bytes.Add(uint64(len(pkt)))
	default:
		c.st.dropped.Add(1)
		c.st.drops[reason].Add(1)
	}
	return v, reason
}

// isSYN reports whether TCP flags open a connection.
func isSYN(flags uint8) bool {
	return flags&(tcpSYN|tcpACK|tcpRST|tcpFIN) == tcpSYN
}

func (c *Classifier) inboundTCP(pkt []byte, seg *segment) (Verdict, DropReason) {
	h := seg.key.hash(&c.seed)
	s := c.shardFor(h)
	now := c.clock.Load()
	if !isSYN(seg.flags) {
		s.mu.Lock()
		i, ok := s.lookup(&seg.key, uint32(h))
		inWindow := true
		if ok {
			inWindow = s.track(&s.slots[i], seg, false, now)
		}
		s.mu.Unlock()
		switch {
		case !inWindow:
			return Drop, RSTOutOfWindow
		case ok:
			return Intercept, NoDrop
		case c.wants(pkt, seg, false) && c.wants(pkt, seg, true):
			// Whichever side opened this connection, its SYN was
			// intercepted: there is no verbatim connection it can
			// belong to. The flow's state is gone (a restart, an
			// expiry, a RST): the netstack resets it unless it still
			// has the connection. Never out in the clear.
			c.st.unknown.Add(1)
			return Intercept, NoDrop
		}
		return Verbatim, NoDrop
	}

	// A SYN: ask the policy before taking the lock (it may be slow).
	want := c.wants(pkt, seg, false)
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.lookup(&seg.key, uint32(h))
	if ok {
		f := &s.slots[i]
		if f.state != stateClosed {
			// A retransmitted SYN of a live flow.
			s.track(f, seg, false, now)
			return Intercept, NoDrop
		}
		// The addresses and ports of a closed flow are being reused.
		c.st.replaced.Add(1)
		s.remove(i)
		c.count.Add(-1)
		i, _ = s.lookup(&seg.key, uint32(h))
	}
	if !want {
		return Verbatim, NoDrop
	}
	// A half-open flow: bounded per source and in total.
	b := c.srcBucket(&seg.key, seg.fromLo)
	mine := c.halfBySrc[b].Load() + 1
	if mine > c.maxPerSource {
		return Drop, HalfOpenPerSource
	}
	if s.half >= s.halfLimit {
		if !s.evictHalfOpen(uint32(h), mine) {
			return Drop, HalfOpenFull
		}
		c.count.Add(-1)
		c.st.replaced.Add(1)
		i, _ = s.lookup(&seg.key, uint32(h))
	}
	f := c.insert(s, i, &seg.key, uint32(h), seg, now)
	if f == nil {
		return Drop, TableFull
	}
	f.flags |= flagHalf
	s.half++
	c.halfTotal.Add(1)
	c.halfBySrc[b].Add(1)
	return Intercept, NoDrop
}

// srcBucket returns the index of the per-source counter of the initiator
// (the low endpoint of k if initLo) of a flow.
func (c *Classifier) srcBucket(k *flowKey, initLo bool) int {
	hi, lo := k.hiHi, k.hiLo
	if initLo {
		hi, lo = k.loHi, k.loLo
	}
	return int(mum(hi^c.seed[0], lo^c.seed[3]) >> (64 - 16))
}

// wants asks the policy about the connection seg of pkt belongs to, as if
// opened by seg's source, or by its destination if reverse.
func (c *Classifier) wants(pkt []byte, seg *segment, reverse bool) bool {
	p := c.policy.Load().p
	if p == nil {
		return false
	}
	var src, dst netip.Addr
	if seg.v6 {
		src = netip.AddrFrom16([16]byte(pkt[8:24]))
		dst = netip.AddrFrom16([16]byte(pkt[24:40]))
	} else {
		src = netip.AddrFrom4([4]byte(pkt[12:16]))
		dst = netip.AddrFrom4([4]byte(pkt[16:20]))
	}
	a, b := netip.AddrPortFrom(src, seg.sport), netip.AddrPortFrom(dst, seg.dport)
	if reverse {
		a, b = b, a
	}
	// The registry only when the policy says yes: verbatim traffic does
	// not pay for it.
	return p.InterceptTCP(a, b) && !c.exempt.Has(a, b)
}

// insert adds a new flow to shard s (locked), whose empty slot for the key
// is i; syn is its SYN, or nil. If the table is full it first evicts the
// oldest closed flow of s. It returns nil if there is no room.
func (c *Classifier) insert(s *shard, i int, k *flowKey, h uint32, syn *segment, now int64) *flow {
	if s.n >= s.limit || c.count.Load() >= c.maxFlows {
		if !s.evictOldestClosed() {
			return nil
		}
		c.count.Add(-1)
		c.st.replaced.Add(1)
		// The eviction may have shifted the probe chain.
		i, _ = s.lookup(k, h)
	}
	if c.count.Add(1) > c.maxFlows {
		c.count.Add(-1)
		return nil
	}
	c.st.inserted.Add(1)
	return s.put(i, k, h, syn, now)
}

// Outbound tells the classifier about a packet the netstack writes to the
// TUN. hdr must hold at least the IP and TCP headers; the payload may be
// cut off. A SYN registers a flow so that its replies are intercepted; other
// TCP packets keep their flow alive and track its sequence numbers, FIN and
// RST.
func (c *Classifier) Outbound(hdr []byte) { c.OutboundAck(hdr) }

// OutboundAck is Outbound, and also reports how far the packet's
// acknowledgment number moves past that of the netstack's previous ACK
// from the same endpoint of the flow (a passthrough flow has the netstack
// at both ends, each with its own). known is false when there is no such
// earlier ACK (the handshake's ACK of a connection the netstack dials, the
// first packet after a SYN), when the packet carries no ACK, or when it is
// not a tracked TCP segment. both reports that the netstack holds the flow
// twice (Own): it is both ends of the connection, as on passthrough and
// same-node mesh traffic.
func (c *Classifier) OutboundAck(hdr []byte) (advance uint32, known, both bool) {
	c.st.outbound.Add(1)
	var seg segment
	switch res, _ := parse(hdr, false, &seg); res {
	case parsedOther:
		return 0, false, false
	case parsedMalformed:
		c.st.outMalformed.Add(1)
		return 0, false, false
	}
	h := seg.key.hash(&c.seed)
	s := c.shardFor(h)
	now := c.clock.Load()
	syn := isSYN(seg.flags)
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.lookup(&seg.key, uint32(h))
	if ok && syn && s.slots[i].state == stateClosed {
		c.st.replaced.Add(1)
		s.remove(i)
		c.count.Add(-1)
		i, ok = s.lookup(&seg.key, uint32(h))
	}
	switch {
	case ok:
		f := &s.slots[i]
		s.track(f, &seg, true, now)
		if seg.flags&tcpACK != 0 {
			side := sideOf(seg.fromLo)
			if f.flags&(flagAckLo<<side) != 0 {
				advance, known = seg.ack-f.ack[side], true
			}
			f.ack[side] = seg.ack
			f.flags |= flagAckLo << side
		}
		both = f.owners >= 2
	case syn:
		if c.insert(s, i, &seg.key, uint32(h), &seg, now) == nil {
			c.st.outTableFull.Add(1)
		}
	default:
		c.st.outNoFlow.Add(1)
	}
	return advance, known, both
}

// Own marks the flow between a and b as held by the netstack: a
// connection request it is deciding, or a connection it has (accepted or
// dialled). An owned flow does not expire and no packet ends it; Release
// does. A flow not in the table is added. It reports false if there was no
// room.
func (c *Classifier) Own(a, b netip.AddrPort) bool {
	k, _ := keyOf(a, b)
	h := k.hash(&c.seed)
	s := c.shardFor(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.lookup(&k, uint32(h))
	var f *flow
	switch {
	case ok && s.slots[i].state == stateClosed:
		// An old flow of the same addresses in its grace period.
		c.st.replaced.Add(1)
		s.remove(i)
		c.count.Add(-1)
		i, _ = s.lookup(&k, uint32(h))
		fallthrough
	case !ok:
		if f = c.insert(s, i, &k, uint32(h), nil, c.clock.Load()); f == nil {
			c.st.ownFull.Add(1)
			return false
		}
	default:
		f = &s.slots[i]
	}
	s.unhalf(f)
	f.flags |= flagOwned
	if f.owners < 255 {
		f.owners++
	}
	return true
}

// Release ends one hold of the netstack on the flow between a and b (see
// Own; a flow owned twice, by the two legs of a connection the netstack
// both accepts and dials with the same addresses, needs two): the flow closes, and is removed after Config.CloseTimeout, during which
// its packets still reach the netstack. It does nothing to a flow that is
// not owned.
func (c *Classifier) Release(a, b netip.AddrPort) {
	k, _ := keyOf(a, b)
	h := k.hash(&c.seed)
	s := c.shardFor(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.lookup(&k, uint32(h))
	if !ok || s.slots[i].flags&flagOwned == 0 {
		return
	}
	f := &s.slots[i]
	if f.owners > 1 {
		f.owners--
		return
	}
	f.owners = 0
	f.flags &^= flagOwned
	if f.state != stateClosed {
		s.close(f, c.clock.Load())
	}
}

// keyOf returns the flow key of the connection between a and b, and
// whether a is its low endpoint.
func keyOf(a, b netip.AddrPort) (flowKey, bool) {
	split := func(ap netip.AddrPort) (uint64, uint64) {
		x := ap.Addr().Unmap()
		if x.Is4() {
			v := x.As4()
			return 0, uint64(binary.BigEndian.Uint32(v[:]))
		}
		v := x.As16()
		return binary.BigEndian.Uint64(v[:8]), binary.BigEndian.Uint64(v[8:])
	}
	aHi, aLo := split(a)
	bHi, bLo := split(b)
	k := flowKey{v6: a.Addr().Unmap().Is6()}
	aLow := endpointLE(aHi, aLo, a.Port(), bHi, bLo, b.Port())
	if aLow {
		k.loHi, k.loLo, k.loPort, k.hiHi, k.hiLo, k.hiPort = aHi, aLo, a.Port(), bHi, bLo, b.Port()
	} else {
		k.loHi, k.loLo, k.loPort, k.hiHi, k.hiLo, k.hiPort = bHi, bLo, b.Port(), aHi, aLo, a.Port()
	}
	return k, aLow
}

// Sweep advances the coarse clock to now and removes the flows that have
// outlived their timeout. It returns the number removed.
func (c *Classifier) Sweep(now time.Time) int {
	t := now.Sub(c.base).Nanoseconds()
	for {
		old := c.clock.Load()
		if t <= old {
			t = old
			break
		}
		if c.clock.CompareAndSwap(old, t) {
			break
		}
	}
	removed := 0
	for i := range c.shards {
		removed += c.shards[i].sweep(t, c.synTimeout, c.idleTimeout, c.closeTimeout)
	}
	if removed > 0 {
		c.count.Add(-int64(removed))
		c.st.expired.Add(uint64(removed))
	}
	return removed
}

// Run calls Sweep every interval (1s if every <= 0) until ctx is done. The
// interval is also the resolution of the clock timeouts are measured with.
func (c *Classifier) Run(ctx context.Context, every time.Duration) {
	if every <= 0 {
		every = time.Second
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			c.Sweep(now)
		}
	}
}

// Len returns the number of flows in the table.
func (c *Classifier) Len() int { return int(c.count.Load()) }

// Stats returns a snapshot of the counters. Counters are read one by one,
// so under load they may be off from each other by a few packets.
func (c *Classifier) Stats() Stats {
	s := Stats{
		Dropped:            c.st.dropped.Load(),
		Outbound:           c.st.outbound.Load(),
		OutboundMalformed:  c.st.outMalformed.Load(),
		OutboundNoFlow:     c.st.outNoFlow.Load(),
		OutboundTableFull:  c.st.outTableFull.Load(),
		UnknownIntercepted: c.st.unknown.Load(),
		OwnFull:            c.st.ownFull.Load(),
		HalfOpen:           int(c.halfTotal.Load()),
		FlowsInserted:      c.st.inserted.Load(),
		FlowsExpired:       c.st.expired.Load(),
		FlowsReplaced:      c.st.replaced.Load(),
		Flows:              c.Len(),
	}
	for i := range s.DropsByReason {
		s.DropsByReason[i] = c.st.drops[i].Load()
	}
	for p := range numProtos {
		s.VerbatimPackets[p] = c.st.byProto[Verbatim][p].packets.Load()
		s.Verbatim += s.VerbatimPackets[p]
		s.Intercepted += c.st.byProto[Intercept][p].packets.Load()
		s.VerbatimBytes[p] = c.st.byProto[Verbatim][p].bytes.Load()
		s.InterceptedPackets[p] = c.st.byProto[Intercept][p].packets.Load()
		s.InterceptedBytes[p] = c.st.byProto[Intercept][p].bytes.Load()
	}
	return s
}
