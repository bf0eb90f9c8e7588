// Package hbone implements HBONE, the mesh tunnel of Istio's ambient mode:
// one TCP connection carried as an HTTP/2 CONNECT stream over mutual TLS 1.3
// (ALPN h2, no SNI), wire-compatible with Istio's ztunnel.
//
// A Client opens streams (Dial) to <destination pod IP>:15008 with
// :authority = <destination pod IP>:<target port>, pooling its TLS
// connections by (source identity, destination identity, endpoint). A Server
// accepts such streams, asks a Handler to authorize the request and dial the
// upstream, answers 200 only once the upstream is connected (401, 503 or 400
// otherwise), and then relays bytes between the stream and the upstream.
//
// Both ends run their own HTTP/2 connection state machine for CONNECT
// streams on golang.org/x/net/http2's Framer (frames, HEADERS with
// CONTINUATION decoded by its hpack decoder) and http2/hpack, with
// ztunnel's settings: stream window 4 MiB, connection window 16 MiB, frames
// up to 1 MiB, a PING after 10 s without frames (20 s to answer), at most
// 100 streams per connection. Each TLS connection has one reader goroutine,
// which handles SETTINGS, PING, WINDOW_UPDATE, RST_STREAM and GOAWAY
// inline and appends DATA to the stream's receive buffer (pooled chunks,
// held only while they hold data). A stream's Write puts DATA frames
// straight onto the connection and flushes; no goroutine of the package
// runs per client stream. Conn implements io.WriterTo, so a relay can hand
// received data to its destination without a buffer of its own.
//
// # Half-close and reset
//
// End of data travels as END_STREAM and is mapped to and from TCP half-close,
// each direction on its own and exactly: Conn.CloseWrite on the client ends
// the request body and the server then calls CloseWrite on the upstream;
// the upstream's EOF makes the server send END_STREAM at once, and the
// client's Read returns io.EOF, while bytes the client still sends keep
// reaching the upstream until the client ends its half too.
//
// Abortive closes travel as RST_STREAM. Conn.Abort on the client cancels the
// stream (RST_STREAM CANCEL); the server then aborts the upstream (Aborter,
// or SO_LINGER 0 on a *net.TCPConn, which makes the kernel send a TCP RST).
// An upstream read error other than EOF (a TCP RST), or an upstream that
// refuses data, makes the server reset the stream (RST_STREAM
// INTERNAL_ERROR); the client's Read and Write then return an error
// wrapping ErrReset. After a complete response, RST_STREAM(NO_ERROR) from
// the server (as net/http-based servers send when they stop reading) only
// fails further Writes; the response stays readable up to io.EOF.
//
// # Protocol errors
//
// A malformed frame or header block of one stream resets that stream
// (RST_STREAM PROTOCOL_ERROR, FLOW_CONTROL_ERROR, ...); a connection-level
// error sends GOAWAY with its code and closes the connection. Either is
// logged with the peer. The server defends against the known HTTP/2
// attacks: header lists over 64 KiB are answered 431 and CONTINUATION
// floods close the connection (the Framer's limits); SETTINGS and PING
// floods, a peer that does not read its control frames, and rapid reset
// (streams reset before their answer, or refused past the stream limit,
// counted per second; Handler.Connect calls in progress bounded by the
// stream limit) close it with ENHANCE_YOUR_CALM; window overflows are
// FLOW_CONTROL_ERROR.
//
// # Drain
//
// Server.Drain sends GOAWAY(NO_ERROR) naming the last stream processed;
// open streams finish, new ones are refused (REFUSED_STREAM), and the
// connection closes once idle. The client stops using a connection that
// received GOAWAY, and Dial retries a stream the server did not process
// (beyond the GOAWAY's last stream, or REFUSED_STREAM) once on another
// connection.
package hbone

import (
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"net/url"
	"sort"
	"strings"
	"time"
)

// Port is the HBONE port on every mesh pod IP.
const Port = 15008

// HTTP/2 settings, the values ztunnel uses.
const (
	MaxFrameSize      = 1 << 20 // SETTINGS_MAX_FRAME_SIZE advertised by both ends
	StreamWindow      = 4 << 20 // initial flow-control window of each stream
	ConnWindow        = 16 << 20
	MaxStreamsPerConn = 100
	PingInterval      = 10 * time.Second // PING after this long without frames
	PingTimeout       = 20 * time.Second // close the connection if unanswered
)

// Header names HBONE uses besides the pseudo-headers.
const (
	HeaderForwarded   = "Forwarded"
	HeaderBaggage     = "Baggage"
	HeaderTraceParent = "Traceparent"
)

// Errors a Handler returns (wrapped, with details) to choose the response
// status, and that a client's StatusError matches with errors.Is.
var (
	// ErrBadRequest: the request is malformed; 400.
	ErrBadRequest = errors.New("hbone: bad request")
	// ErrDenied: authorization policy denies the request; 401.
	ErrDenied = errors.New("hbone: denied by policy")
	// ErrUnreachable: the upstream could not be connected; 503. Handler
	// errors that match none of these sentinels map to 503 too.
	ErrUnreachable = errors.New("hbone: upstream unreachable")
)

// ErrReset is wrapped by the errors of a stream that ended abnormally: reset
// by the peer (RST_STREAM), or unable to carry more data because the peer
// ended it. A proxy should turn it into a TCP RST on its side.
var ErrReset = errors.New("hbone: stream reset")

// Status returns the HTTP status a Server answers for a Handler error.
func Status(err error) int {
	switch {
	case err == nil:
		return http.StatusOK
	case errors.Is(err, ErrBadRequest):
		return http.StatusBadRequest
	case errors.Is(err, ErrDenied):
		return http.StatusUnauthorized
	default:
		return http.StatusServiceUnavailable
	}
}

// StatusError is the error of a Dial that the server answered with a status
// other than 200. errors.Is matches it against ErrBadRequest (400),
// ErrDenied (401) and ErrUnreachable (503).
type StatusError struct {
	Code    int    // HTTP status
	Message string // start of the response body, for diagnosis
	Target  netip.AddrPort
}

func (e *StatusError) Error() string {
	msg := fmt.Sprintf("hbone: CONNECT %s: %d %s", e.Target, e.Code, http.StatusText(e.Code))
	if e.Message != "" {
		msg += ": " + e.Message
	}
	return msg
}

// Is reports whether target is the sentinel error of e's status.
func (e *StatusError) Is(target error) bool {
	switch e.Code {
	case http.StatusBadRequest:
		return target == ErrBadRequest
	case http.StatusUnauthorized:
		return target == ErrDenied
	case http.StatusServiceUnavailable:
		return target == ErrUnreachable
	}
	return false
}

// Forwarded is the first element of a Forwarded header (RFC 7239): where the
// tunnelled connection came from and, when a service was the target, its
// host name. ztunnel sends for="<src ip>:<src port>" and ;host=<service
// FQDN>.
type Forwarded struct {
	// For is the original client; port 0 when the header gave none, the
	// zero AddrPort when absent or not an address ("unknown", obfuscated).
	For netip.AddrPort
	// Host is the host parameter, empty when absent.
	Host string
}

// IsZero reports whether f carries nothing.
func (f Forwarded) IsZero() bool { return !f.For.Addr().IsValid() && f.Host == "" }

// String formats f as a Forwarded header value; "" when f is zero.
func (f Forwarded) String() string {
	var parts []string
	if f.For.Addr().IsValid() {
		v := f.For.Addr().String()
		if f.For.Port() != 0 {
			v = f.For.String()
		} else if f.For.Addr().Is6() {
			v = "[" + v + "]"
		}
		parts = append(parts, `for="`+v+`"`)
	}
	if f.Host != "" {
		parts = append(parts, "host="+quoteIfNeeded(f.Host))
	}
	return strings.Join(parts, ";")
}

// ParseForwarded parses the first element of a Forwarded header value (the
// original client; proxies append theirs after a comma). Parameter names are
// case-insensitive; values may be tokens or quoted strings. A "for" that is
// not an IP address (RFC 7239 "unknown" or an obfuscated identifier) leaves
// For zero.
func ParseForwarded(s string) (Forwarded, error) {
	var f Forwarded
	elem, err := firstElement(s)
	if err != nil {
		return f, fmt.Errorf("forwarded %q: %w", s, err)
	}
	for _, pair := range elem {
		switch strings.ToLower(pair[0]) {
		case "for":
			f.For, err = parseNode(pair[1])
			if err != nil {
				return Forwarded{}, fmt.Errorf("forwarded %q: for=%q: %w", s, pair[1], err)
			}
		case "host":
			f.Host = pair[1]
		}
	}
	return f, nil
}

// firstElement splits the first element of a Forwarded value into
// name/value pairs.
func firstElement(s string) ([][2]string, error) {
	var pairs [][2]string
	i := 0
	skipSpace := func() {
		for i < len(s) && (s[i] == ' ' || s[i] == '\t') {
			i++
		}
	}
	for {
		skipSpace()
		start := i
		for i < len(s) && isToken(s[i]) {
			i++
		}
		name := s[start:i]
		if name == "" {
			if i >= len(s) && len(pairs) == 0 {
				return nil, errors.New("empty")
			}
			return nil, fmt.Errorf("parameter name expected at offset %d", i)
		}
		if i >= len(s) || s[i] != '=' {
			return nil, fmt.Errorf("'=' expected after %q", name)
		}
		i++
		var value string
		if i < len(s) && s[i] == '"' {
			i++
			var b strings.Builder
			for {
				if i >= len(s) {
					return nil, fmt.Errorf("unterminated quoted value of %q", name)
				}
				c := s[i]
				i++
				if c == '"' {
					break
				}
				if c == '\\' {
					if i >= len(s) {
						return nil, fmt.Errorf("unterminated quoted value of %q", name)
					}
					c = s[i]
					i++
				}
				b.WriteByte(c)
			}
			value = b.String()
		} else {
			// Unquoted: a token, leniently with the ':' '[' ']' of
			// addresses, which RFC 7239 wants quoted.
			start := i
			for i < len(s) && (isToken(s[i]) || s[i] == ':' || s[i] == '[' || s[i] == ']') {
				i++
			}
			value = s[start:i]
			if value == "" {
				return nil, fmt.Errorf("empty value of %q", name)
			}
		}
		pairs = append(pairs, [2]string{name, value})
		skipSpace()
		switch {
		case i >= len(s) || s[i] == ',':
			return pairs, nil
		case s[i] == ';':
			i++
		default:
			return nil, fmt.Errorf("unexpected %q at offset %d", s[i], i)
		}
	}
}

// parseNode parses an RFC 7239 node: IPv4, IPv4:port, [IPv6], [IPv6]:port,
// or an identifier that is not an address.
func parseNode(v string) (netip.AddrPort, error) {
	if v == "unknown" || strings.HasPrefix(v, "_") {
		return netip.AddrPort{}, nil
	}
	if ap, err := netip.ParseAddrPort(v); err == nil {
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
	}
	// A bare IPv6 address is not valid RFC 7239 but is unambiguous.
	host := strings.TrimSuffix(strings.TrimPrefix(v, "["), "]")
	a, err := netip.ParseAddr(host)
	if err != nil {
		return netip.AddrPort{}, errors.New("not an IP address with optional port")
	}
	return netip.AddrPortFrom(a.Unmap(), 0), nil
}

// Baggage holds W3C baggage members (https://www.w3.org/TR/baggage/) by key.
// ztunnel sends k8s.cluster.name, k8s.namespace.name, k8s.<kind>.name,
// service.name, service.version and, when known, cloud.region and
// cloud.availability_zone.
type Baggage map[string]string

// Bounds of a baggage header, the W3C recommendation's: a receiver need
// not take more.
const (
	MaxBaggageBytes   = 8192
	MaxBaggageMembers = 64
)

// ParseBaggage parses a baggage header value. Member properties (after ';')
// are dropped; values are percent-decoded; empty list members are
// skipped. A member without '=', a key that is not a token, a value with
// an octet the grammar does not allow, or a header over MaxBaggageBytes or
// MaxBaggageMembers is an error: the header as a whole is then to be
// ignored (it is the peer's claim, never a reason to refuse a connection).
func ParseBaggage(s string) (Baggage, error) {
	if len(s) > MaxBaggageBytes {
		return nil, fmt.Errorf("baggage of %d bytes: over %d", len(s), MaxBaggageBytes)
	}
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	b := Baggage{}
	for _, member := range strings.Split(s, ",") {
		member, _, _ = strings.Cut(member, ";")
		if strings.TrimSpace(member) == "" {
			continue
		}
		if len(b) == MaxBaggageMembers {
			return nil, fmt.Errorf("baggage %q: over %d members", s, MaxBaggageMembers)
		}
		k, v, ok := strings.Cut(member, "=")
		k = strings.TrimSpace(k)
		if !ok || k == "" || !allToken(k) {
			return nil, fmt.Errorf("baggage %q: member %q is not key=value", s, strings.TrimSpace(member))
		}
		v = strings.Trim(v, " \t")
		for i := 0; i < len(v); i++ {
			if !isBaggageOctet(v[i]) && v[i] != '%' {
				return nil, fmt.Errorf("baggage %q: value of %q has the octet %#x", s, k, v[i])
			}
		}
		v, err := url.PathUnescape(v)
		if err != nil {
			return nil, fmt.Errorf("baggage %q: value of %q: %w", s, k, err)
		}
		b[k] = v
	}
	return b, nil
}

// String formats b as a baggage header value, keys sorted, values
// percent-encoded where the W3C grammar requires.
func (b Baggage) String() string {
	keys := make([]string, 0, len(b))
	for k := range b {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var sb strings.Builder
	for i, k := range keys {
		if i > 0 {
			sb.WriteByte(',')
		}
		sb.WriteString(k)
		sb.WriteByte('=')
		for _, c := range []byte(b[k]) {
			if isBaggageOctet(c) {
				sb.WriteByte(c)
			} else {
				fmt.Fprintf(&sb, "%%%02X", c)
			}
		}
	}
	return sb.String()
}

func (b Baggage) validate() error {
	if len(b) > MaxBaggageMembers {
		return fmt.Errorf("baggage of %d members: over %d", len(b), MaxBaggageMembers)
	}
	for k := range b {
		if k == "" || !allToken(k) {
			return fmt.Errorf("baggage key %q is not a token", k)
		}
	}
	if n := len(b.String()); n > MaxBaggageBytes {
		return fmt.Errorf("baggage of %d bytes: over %d", n, MaxBaggageBytes)
	}
	return nil
}

// isBaggageOctet: %x21 / %x23-2B / %x2D-3A / %x3C-5B / %x5D-7E, minus '%'
// which must be escaped for the value to decode back.
func isBaggageOctet(c byte) bool {
	return c == 0x21 || (c >= 0x23 && c <= 0x2B && c != '%') || (c >= 0x2D && c <= 0x3A) ||
		(c >= 0x3C && c <= 0x5B) || (c >= 0x5D && c <= 0x7E)
}

func isToken(c byte) bool {
	if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' {
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

func allToken(s string) bool {
	for i := 0; i < len(s); i++ {
		if !isToken(s[i]) {
			return false
		}
	}
	return true
}

func quoteIfNeeded(s string) string {
	if s != "" && allToken(s) {
		return s
	}
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(s) + `"`
}
