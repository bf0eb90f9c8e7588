package node

import (
	"errors"
	"net/netip"
	"os"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/stack/classify"
	"github.com/meshtun/meshtun/tun"
)

// SinkName returns the name of the spoof sink device of the TUN tunName:
// the name with "s" appended (to its first 14 bytes if it is 15 long, and
// then "z" if that would be tunName itself).
func SinkName(tunName string) string {
	if len(tunName) <= 14 {
		return tunName + "s"
	}
	if s := tunName[:14] + "s"; s != tunName {
		return s
	}
	return tunName[:14] + "z"
}

// spoofSink reads the packets that policy routing sends to the sink
// device (a capture link's packets whose source is not one of that link's
// pods), counts them and drops them. It logs the first one and then at
// most one summary every spoofLogEvery.
type spoofSink struct {
	dev     *tun.Device
	dropped atomic.Uint64
	log     zerolog.Logger
}

const spoofLogEvery = 10 * time.Second

func (s *spoofSink) run() {
	buf := make([]byte, 1<<16)
	var lastLog time.Time
	var sinceLog uint64
	for {
		n, err := s.dev.Read(buf)
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				s.log.Error().Err(err).Str("tun", s.dev.Name()).Msg("spoof sink read")
			}
			return
		}
		src, dst := addrs(buf[s.dev.VnetHdrLen():n])
		if dst.IsMulticast() {
			// The device's own (MLD reports): routing never sends
			// a forwarded multicast packet here.
			continue
		}
		s.dropped.Add(1)
		sinceLog++
		if now := time.Now(); now.Sub(lastLog) >= spoofLogEvery {
			s.log.Warn().Str("src", src.String()).Str("dst", dst.String()).Uint64("dropped", sinceLog).
				Msg("dropped packets from a capture link whose source is not that link's pod (spoofed-source)")
			lastLog, sinceLog = now, 0
		}
	}
}

// addrs returns the source and destination of an IPv4 or IPv6 packet
// (invalid addresses if it is neither), read by the classifier's parser.
func addrs(pkt []byte) (src, dst netip.Addr) {
	var h classify.IPHeader
	classify.ParseIP(pkt, false, &h) // the addresses are known even if the rest is malformed
	s, d := h.Addrs(pkt)
	src, _ = netip.AddrFromSlice(s)
	dst, _ = netip.AddrFromSlice(d)
	return src, dst
}
