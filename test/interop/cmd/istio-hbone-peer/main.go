// Command istio-hbone-peer runs Istio's own Go HBONE implementation,
// istio.io/istio/pkg/hbone, as a process: test/kube starts it inside a
// network namespace of its test cluster (a socket belongs to the namespace
// of the thread that creates it, and pkg/hbone creates its sockets on
// goroutines of its own, so it cannot run inside the test process) to talk
// HBONE to meshtun nodes with certificates istiod's CA issued.
//
// It lives in the interop module because that module already requires
// istio.io/istio (at the version test/kube builds istiod from), so neither
// the product's nor test/kube's go.mod carries Istio's module graph.
//
//	istio-hbone-peer serve --listen :15008 --cert C --key K --root R
//	istio-hbone-peer dial --proxy IP:15008 --target IP:PORT --want-server ID --bytes N --cert C --key K --root R
//
// Both verify the peer the way Istio does: the certificate chain against
// the roots of --root for --trust-domain (pkg/spiffe.PeerCertVerifier, as
// Istio loads a root file), the identity read with Istio's SAN parser.
//
// serve runs pkg/hbone.NewServer with ServeTLS (a client certificate
// required) and writes one JSON line to stdout when it listens
// ("listening") and one per CONNECT ("connect", with the client's identity
// and the :authority), until SIGTERM.
//
// dial runs pkg/hbone.NewDialer to --proxy for --target, requires the
// server's identity to be --want-server, writes --bytes pseudo-random bytes
// while reading as many back (the target echoes), and writes one JSON line
// ("echoed", with the server's identity and the counts) and exits 0, or
// writes "failed" with the error and exits 1.
package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	istiohbone "istio.io/istio/pkg/hbone"
	istiolog "istio.io/istio/pkg/log"
	istiospiffe "istio.io/istio/pkg/spiffe"

	"github.com/meshtun/meshtun/test/interop/internal/istioid"
)

func main() {
	log := zerolog.New(os.Stdout).With().Timestamp().Logger()
	if len(os.Args) < 2 {
		log.Error().Msg("usage: istio-hbone-peer serve|dial [flags]")
		os.Exit(2)
	}
	// pkg/hbone logs every CONNECT at info level on its own scope; the
	// lines this program writes are the ones the test reads.
	for _, s := range istiolog.Scopes() {
		s.SetOutputLevel(istiolog.WarnLevel)
	}
	var err error
	switch mode, args := os.Args[1], os.Args[2:]; mode {
	case "serve":
		err = serve(log, args)
	case "dial":
		err = dial(log, args)
	default:
		err = fmt.Errorf("unknown mode %q (want serve or dial)", mode)
	}
	if err != nil {
		log.Error().Err(err).Msg("failed")
		os.Exit(1)
	}
}

// creds are the flags both modes share: the certificate, its key and the
// trust roots.
type creds struct {
	cert, key, root, trustDomain string
}

func (c *creds) register(fs *flag.FlagSet) {
	fs.StringVar(&c.cert, "cert", "", "PEM file of the certificate chain, leaf first")
	fs.StringVar(&c.key, "key", "", "PEM file of the certificate's private key")
	fs.StringVar(&c.root, "root", "", "PEM file of the trust roots (istio-ca-root-cert)")
	fs.StringVar(&c.trustDomain, "trust-domain", "cluster.local", "trust domain of the roots")
}

// load returns the certificate and Istio's verifier for the roots.
func (c *creds) load() (tls.Certificate, *istiospiffe.PeerCertVerifier, error) {
	cert, err := tls.LoadX509KeyPair(c.cert, c.key)
	if err != nil {
		return cert, nil, fmt.Errorf("certificate %s, key %s: %w", c.cert, c.key, err)
	}
	rootPEM, err := os.ReadFile(c.root)
	if err != nil {
		return cert, nil, err
	}
	v := istiospiffe.NewPeerCertVerifier()
	if err := v.AddMappingFromPEM(c.trustDomain, rootPEM); err != nil {
		return cert, nil, fmt.Errorf("roots %s: %w", c.root, err)
	}
	return cert, v, nil
}

type connKey struct{}

func serve(log zerolog.Logger, args []string) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	var c creds
	c.register(fs)
	listen := fs.String("listen", ":15008", "address to serve HBONE on")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cert, v, err := c.load()
	if err != nil {
		return err
	}
	srv := istiohbone.NewServer()
	srv.Protocols.SetHTTP2(true)
	srv.TLSConfig = &tls.Config{
		MinVersion:            tls.VersionTLS13,
		Certificates:          []tls.Certificate{cert},
		ClientAuth:            tls.RequireAnyClientCert,
		VerifyPeerCertificate: v.VerifyPeerCert,
		NextProtos:            []string{"h2"},
	}
	srv.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		return context.WithValue(ctx, connKey{}, c)
	}
	connect := srv.Handler
	srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ev := log.Info().Str("method", r.Method).Str("authority", r.Host).Str("proto", r.Proto).Str("remote", r.RemoteAddr)
		// net/http sets r.TLS only for :scheme https, which CONNECT lacks.
		if tc, ok := r.Context().Value(connKey{}).(*tls.Conn); ok {
			cs := tc.ConnectionState()
			ev = ev.Uint16("tls_version", cs.Version).Str("alpn", cs.NegotiatedProtocol)
			if len(cs.PeerCertificates) > 0 {
				id, err := istioid.PeerID(cs.PeerCertificates[0].Raw)
				if err != nil {
					id = "error: " + err.Error()
				}
				ev = ev.Str("peer", id)
			}
		}
		ev.Msg("connect")
		connect.ServeHTTP(w, r)
	})
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- srv.ServeTLS(ln, "", "") }()
	log.Info().Str("addr", ln.Addr().String()).Msg("listening")
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case err := <-done:
		return err
	case <-sig:
		srv.Close()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	}
}

func dial(log zerolog.Logger, args []string) error {
	fs := flag.NewFlagSet("dial", flag.ContinueOnError)
	var c creds
	c.register(fs)
	proxyAddr := fs.String("proxy", "", "HBONE proxy address ip:port")
	target := fs.String("target", "", "target ip:port to CONNECT to")
	want := fs.String("want-server", "", "the SPIFFE ID the proxy must present")
	n := fs.Int("bytes", 64<<10, "bytes to send and expect echoed")
	timeout := fs.Duration("timeout", 30*time.Second, "bound of the whole exchange")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *proxyAddr == "" || *target == "" || *want == "" {
		return errors.New("dial needs --proxy, --target and --want-server")
	}
	cert, v, err := c.load()
	if err != nil {
		return err
	}
	var mu sync.Mutex
	var server string
	d := istiohbone.NewDialer(istiohbone.Config{
		ProxyAddress: *proxyAddr,
		TLS: &tls.Config{
			MinVersion:   tls.VersionTLS13,
			Certificates: []tls.Certificate{cert},
			// Verified below the SPIFFE way, by identity, not host name.
			InsecureSkipVerify: true,
			VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
				if len(raw) == 0 {
					return errors.New("server presented no certificate")
				}
				if err := v.VerifyPeerCert(raw, nil); err != nil {
					return err
				}
				id, err := istioid.PeerID(raw[0])
				if err != nil {
					return err
				}
				mu.Lock()
				server = id
				mu.Unlock()
				if id != *want {
					return fmt.Errorf("server is %s, want %s", id, *want)
				}
				return nil
			},
		},
	})
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	conn, err := d.DialContext(ctx, "tcp", *target)
	if err != nil {
		return fmt.Errorf("HBONE to %s via %s: %w", *target, *proxyAddr, err)
	}
	defer conn.Close()
	// The connection is one end of a net.Pipe: deadlines work, and the
	// whole exchange is bounded.
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	data := make([]byte, *n)
	rand.NewChaCha8([32]byte{'i', 's', 't', 'i', 'o'}).Read(data)
	werr := make(chan error, 1)
	go func() {
		_, err := conn.Write(data)
		werr <- err
	}()
	got := make([]byte, len(data))
	read, err := io.ReadFull(conn, got)
	if err != nil {
		conn.Close() // ends the writer
		<-werr
		return fmt.Errorf("read the echo from %s: %d of %d bytes: %w", *target, read, len(data), err)
	}
	if err := <-werr; err != nil {
		return fmt.Errorf("write to %s: %w", *target, err)
	}
	if !bytes.Equal(got, data) {
		return fmt.Errorf("the echo from %s differs from what was sent", *target)
	}
	mu.Lock()
	defer mu.Unlock()
	log.Info().Str("server", server).Str("target", *target).Int("sent", len(data)).Int("received", read).Msg("echoed")
	return nil
}
