package gen

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
)

// Holder is a service that accepts connections and holds them open,
// counting them: the far end of idle connections.
type Holder interface {
	// Addr is where it listens.
	Addr() netip.AddrPort
	// Held returns how many connections it holds.
	Held(ctx context.Context) (int, error)
	// WaitHeld returns once it holds at least n connections.
	WaitHeld(ctx context.Context, n int) error
}

// Holder returns the server's Hold service as a Holder.
func (s *Server) Holder() Holder { return localHolder{s} }

type localHolder struct{ s *Server }

func (h localHolder) Addr() netip.AddrPort                      { return h.s.Hold }
func (h localHolder) Held(context.Context) (int, error)         { return h.s.Held(), nil }
func (h localHolder) WaitHeld(ctx context.Context, n int) error { return h.s.WaitHeld(ctx, n) }

// The hold protocol, for a Holder in another process (each process has
// its own open-file limit, and 10,000 connections with both ends in one
// process need 20,000 descriptors): the serving process writes
// "ready <addr:port>" once it listens; then for each line "wait <n>" it
// answers "held <m>" as soon as it holds m ≥ n connections, and for
// "count" it answers "held <m>" at once. It exits when its input ends.

// ServeHold holds every connection ln accepts and answers the hold
// protocol's commands from cmds on out, until cmds ends. It closes ln and
// every held connection before it returns.
func ServeHold(ln net.Listener, cmds io.Reader, out io.Writer) error {
	var (
		mu      sync.Mutex
		held    int
		conns   = map[net.Conn]bool{}
		changed = make(chan struct{})
	)
	done := make(chan struct{})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				close(done)
				return
			}
			mu.Lock()
			held++
			conns[c] = true
			close(changed)
			changed = make(chan struct{})
			mu.Unlock()
			go func() {
				buf := make([]byte, 64)
				for {
					if _, err := c.Read(buf); err != nil {
						break
					}
				}
				c.Close()
				mu.Lock()
				if conns[c] {
					delete(conns, c)
					held--
				}
				mu.Unlock()
			}()
		}
	}()
	defer func() {
		ln.Close()
		<-done
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
	}()
	addr, _ := ln.Addr().(*net.TCPAddr)
	if _, err := fmt.Fprintf(out, "ready %s\n", addr.AddrPort()); err != nil {
		return err
	}
	sc := bufio.NewScanner(cmds)
	for sc.Scan() {
		cmd, arg, _ := strings.Cut(strings.TrimSpace(sc.Text()), " ")
		want := 0
		switch cmd {
		case "count":
		case "wait":
			n, err := strconv.Atoi(arg)
			if err != nil {
				return fmt.Errorf("gen: hold: command %q: %w", sc.Text(), err)
			}
			want = n
		default:
			return fmt.Errorf("gen: hold: unknown command %q", sc.Text())
		}
		for {
			mu.Lock()
			n, ch := held, changed
			mu.Unlock()
			if n >= want {
				if _, err := fmt.Fprintf(out, "held %d\n", n); err != nil {
					return err
				}
				break
			}
			select {
			case <-ch:
			case <-done:
				return fmt.Errorf("gen: hold: listener closed while waiting for %d connections", want)
			}
		}
	}
	return sc.Err()
}

// RemoteHolder is a Holder served by ServeHold in another process, spoken
// to over that process's input and output.
type RemoteHolder struct {
	addr netip.AddrPort
	mu   sync.Mutex
	in   io.Writer
	out  *bufio.Reader
}

// DialHolder reads the "ready" line from out (the serving process's
// output) and returns a RemoteHolder that sends commands to in.
func DialHolder(in io.Writer, out io.Reader) (*RemoteHolder, error) {
	r := bufio.NewReader(out)
	line, err := r.ReadString('\n')
	if err != nil {
		return nil, fmt.Errorf("gen: hold server did not say ready: %w (got %q)", err, line)
	}
	rest, ok := strings.CutPrefix(strings.TrimSpace(line), "ready ")
	if !ok {
		return nil, fmt.Errorf("gen: hold server said %q, want \"ready <addr>\"", line)
	}
	addr, err := netip.ParseAddrPort(rest)
	if err != nil {
		return nil, fmt.Errorf("gen: hold server address: %w", err)
	}
	return &RemoteHolder{addr: netip.AddrPortFrom(addr.Addr().Unmap(), addr.Port()), in: in, out: r}, nil
}

// Addr implements Holder.
func (h *RemoteHolder) Addr() netip.AddrPort { return h.addr }

// Held implements Holder.
func (h *RemoteHolder) Held(ctx context.Context) (int, error) { return h.ask(ctx, "count") }

// WaitHeld implements Holder.
func (h *RemoteHolder) WaitHeld(ctx context.Context, n int) error {
	_, err := h.ask(ctx, "wait "+strconv.Itoa(n))
	return err
}

// ask sends one command and reads the answer. If ctx ends first the
// answer is abandoned and the holder must not be used again.
func (h *RemoteHolder) ask(ctx context.Context, cmd string) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	type answer struct {
		n   int
		err error
	}
	ch := make(chan answer, 1)
	go func() {
		if _, err := fmt.Fprintln(h.in, cmd); err != nil {
			ch <- answer{err: err}
			return
		}
		line, err := h.out.ReadString('\n')
		if err != nil {
			ch <- answer{err: fmt.Errorf("%w (got %q)", err, line)}
			return
		}
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "held ")
		n, cerr := strconv.Atoi(rest)
		if !ok || cerr != nil {
			ch <- answer{err: fmt.Errorf("answer %q, want \"held <n>\"", line)}
			return
		}
		ch <- answer{n: n}
	}()
	select {
	case a := <-ch:
		if a.err != nil {
			return 0, fmt.Errorf("gen: hold server, %q: %w", cmd, a.err)
		}
		return a.n, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}
