package kube

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/mesh/identity"
)

// buildInterop builds the command cmd/<name> of test/interop (Istio's own
// code as a process: istio-hbone-peer, ztunnel-config) into a temporary
// directory, in the interop module: that module requires istio.io/istio,
// this one does not, and the commands compile nothing the interop tests
// do not (only their main packages are new), so a cold `make test` pays
// for their links alone.
func buildInterop(t *testing.T, name string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), name)
	start := time.Now()
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/"+name)
	cmd.Dir = "../interop"
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build %s in test/interop: %v\n%s", name, err, out)
	}
	t.Logf("built %s in %s", name, time.Since(start).Round(10*time.Millisecond))
	return bin
}

// istiodCA dials istiod's certificate service from node n's namespace
// with the node credential token (a trusted node account's token bound to
// a pod on n): it issues the identities of n's pods, as ztunnel asks for
// them.
func istiodCA(t *testing.T, d *Istiod, root, token string, n *cluster.Node) *identity.RemoteIssuer {
	t.Helper()
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	rootPEM, err := os.ReadFile(root)
	if err != nil {
		t.Fatal(err)
	}
	roots, err := identity.ParseCertsPEM(rootPEM)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := identity.DialCA(identity.RemoteConfig{
		Address: d.Addr.String(), ServerName: d.ServerName, TrustDomain: td,
		Bundle: identity.NewTrustBundle(td, roots), Token: identity.TokenFile(token), ClusterID: "Kubernetes",
		Dial: func(ctx context.Context, addr string) (net.Conn, error) { return n.NS.Dial(ctx, "tcp", addr) },
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ca.Close() })
	return ca
}

// svidFiles writes an SVID's chain and key as PEM files into dir for the
// Istio peer, named after name.
func svidFiles(t *testing.T, dir, name string, svid *x509svid.SVID) (cert, key string) {
	t.Helper()
	certPEM, keyPEM, err := svid.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	cert, key = filepath.Join(dir, name+"-cert.pem"), filepath.Join(dir, name+"-key.pem")
	if err := os.WriteFile(cert, certPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(key, keyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	return cert, key
}

// istioPeer is a running istio-hbone-peer: its JSON lines on stdout, its
// stderr (net/http's and Istio's own complaints) for failure reports.
type istioPeer struct {
	proc   *cluster.Proc
	mu     sync.Mutex
	cond   *sync.Cond
	lines  []noderun.Line
	stderr bytes.Buffer
	eof    bool
}

// startIstioPeer starts the peer in ns with args and returns once it has
// written the line with message ready ("" to return at once).
func startIstioPeer(t *testing.T, ns *cluster.NS, bin, ready string, args ...string) *istioPeer {
	t.Helper()
	p := &istioPeer{}
	p.cond = sync.NewCond(&p.mu)
	cmd := ns.Command(context.Background(), bin, args...)
	// A pipe of our own rather than StdoutPipe: the reader sees every
	// line up to EOF whenever the process is reaped.
	out, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout = w
	cmd.Stderr = lockedWriter{&p.mu, &p.stderr}
	proc, err := ns.Start(cmd)
	w.Close()
	if err != nil {
		out.Close()
		t.Fatal(err)
	}
	p.proc = proc
	t.Cleanup(func() { p.stop() })
	go func() {
		defer out.Close()
		dec := json.NewDecoder(out)
		for {
			var l noderun.Line
			if err := dec.Decode(&l); err != nil {
				break
			}
			p.mu.Lock()
			p.lines = append(p.lines, l)
			p.cond.Broadcast()
			p.mu.Unlock()
		}
		p.mu.Lock()
		p.eof = true
		p.cond.Broadcast()
		p.mu.Unlock()
	}()
	if ready != "" {
		if _, err := p.waitSince(0, func(l noderun.Line) bool { return l.Str("message") == ready }); err != nil {
			t.Fatalf("istio-hbone-peer %s: %v", args[0], err)
		}
	}
	return p
}

// waitSince returns the first line from index mark on that matches pred,
// waiting up to 30s, or an error once the peer's output ended without one.
func (p *istioPeer) waitSince(mark int, pred func(noderun.Line) bool) (noderun.Line, error) {
	var gaveUp atomic.Bool
	timer := time.AfterFunc(30*time.Second, func() {
		p.mu.Lock()
		gaveUp.Store(true)
		p.cond.Broadcast()
		p.mu.Unlock()
	})
	defer timer.Stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := mark; ; p.cond.Wait() {
		for ; i < len(p.lines); i++ {
			if pred(p.lines[i]) {
				return p.lines[i], nil
			}
		}
		if p.eof || gaveUp.Load() {
			return nil, fmt.Errorf("no such line; output:\n%s\nstderr:\n%s", p.outputLocked(), p.stderr.String())
		}
	}
}

// since returns the lines from index mark on.
func (p *istioPeer) since(mark int) []noderun.Line {
	p.mu.Lock()
	defer p.mu.Unlock()
	if mark > len(p.lines) {
		return nil
	}
	return append([]noderun.Line(nil), p.lines[mark:]...)
}

func (p *istioPeer) len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.lines)
}

func (p *istioPeer) outputLocked() string {
	var b strings.Builder
	for _, l := range p.lines {
		j, _ := json.Marshal(l)
		b.Write(j)
		b.WriteByte('\n')
	}
	return b.String()
}

// output returns what the peer wrote, for failure reports.
func (p *istioPeer) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.outputLocked() + "stderr:\n" + p.stderr.String()
}

func (p *istioPeer) stop() {
	p.proc.Stop(5 * time.Second)
}

// istioDial runs the peer's dial mode in ns to completion: its last line
// and whether it exited 0.
func istioDial(t *testing.T, ns *cluster.NS, bin string, args ...string) (noderun.Line, *istioPeer, error) {
	t.Helper()
	p := startIstioPeer(t, ns, bin, "", append([]string{"dial"}, args...)...)
	err := p.proc.Wait()
	p.mu.Lock()
	for !p.eof {
		p.cond.Wait()
	}
	var last noderun.Line
	if len(p.lines) > 0 {
		last = p.lines[len(p.lines)-1]
	}
	p.mu.Unlock()
	return last, p, err
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (w lockedWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.w.Write(b)
}

// hasLineSince reports whether a log line of m from index mark on matches
// pred.
func hasLineSince(m *noderun.Process, mark int, pred func(noderun.Line) bool) bool {
	lines := m.Lines()
	if mark > len(lines) {
		return false
	}
	for _, l := range lines[mark:] {
		if pred(l) {
			return true
		}
	}
	return false
}
