// Package proxy joins the intercepted flows to their destinations. It
// receives every TCP connection the classifier took into the netstack and
// decides how it travels on: today, passthrough to the original
// destination over a kernel socket.
package proxy

import (
	"context"
	"errors"
	"net"
	"syscall"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/stack"
)

// DefaultConnectTimeout bounds the upstream connect of a passthrough
// connection. The client's own SYN is held pending meanwhile.
const DefaultConnectTimeout = 10 * time.Second

// Config configures a Proxy.
type Config struct {
	Logger         zerolog.Logger
	ConnectTimeout time.Duration // 0: DefaultConnectTimeout
}

// Proxy handles intercepted TCP connections.
type Proxy struct {
	log    zerolog.Logger
	dialer net.Dialer
	ctx    context.Context
}

// New returns a Proxy whose connections live until ctx is done.
func New(ctx context.Context, cfg Config) *Proxy {
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = DefaultConnectTimeout
	}
	return &Proxy{
		log:    cfg.Logger,
		dialer: net.Dialer{Timeout: cfg.ConnectTimeout},
		ctx:    ctx,
	}
}

// HandleTCP is the stack.TCPHandler of the proxy.
func (p *Proxy) HandleTCP(req *stack.TCPRequest) {
	p.passthrough(req)
}

// passthrough connects to the original destination with a kernel socket
// first, and only then completes the client's handshake, so that a refused
// or unreachable destination looks to the client as it would without
// meshtun: a reset.
func (p *Proxy) passthrough(req *stack.TCPRequest) {
	start := time.Now()
	log := p.log.With().Str("src.addr", req.Src.String()).Str("dst.addr", req.Dst.String()).Str("direction", "outbound").Str("route", "passthrough").Logger()
	up, err := p.dialer.DialContext(p.ctx, "tcp", req.Dst.String())
	if err != nil {
		req.Reject()
		log.Info().Err(err).Str("error", connectError(err)).Msg("upstream connect failed; client reset")
		return
	}
	down, err := req.Accept()
	if err != nil {
		reset(up)
		log.Info().Err(err).Msg("client handshake failed")
		return
	}
	res := relay(down, up)
	ev := log.Info()
	if res.Reset {
		ev = ev.Str("error", "reset")
	}
	ev.Int64("bytes_sent", res.BToA).Int64("bytes_recv", res.AToB).
		Dur("duration", time.Since(start)).Msg("connection complete")
}

func connectError(err error) string {
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection refused"
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return "unreachable"
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, syscall.ETIMEDOUT):
		return "timeout"
	}
	return "connect"
}
