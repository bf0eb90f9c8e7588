package topo

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/mesh/node"
)

// readyTimeout bounds the wait for a proxy to say it is ready.
const readyTimeout = 30 * time.Second

// keptLines is how many log lines of a starting proxy are kept to explain
// a failed start.
const keptLines = 40

// startLogged starts name in n's namespace with stdout and stderr on one
// pipe, waits for a line that ready accepts (not at all if ready is nil:
// the caller has its own readiness check) and returns the process.
// Later output is read and discarded, so a proxy that logs every
// connection (both meshtun and tun2socks do at their default level) never
// blocks on a full pipe, and the benchmark does not spend its CPU parsing
// logs. The cluster stops the process on Close.
func startLogged(ctx context.Context, n *cluster.Node, env []string, ready func(line []byte) bool, name string, args ...string) (*cluster.Proc, error) {
	cmd := n.Command(context.WithoutCancel(ctx), name, args...)
	if len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("topo: start %s in %s: %w", name, n.Name(), err)
	}
	cmd.Stdout, cmd.Stderr = pw, pw
	proc, err := n.Start(cmd)
	pw.Close() // the child has its own copy; EOF on pr once it exits
	if err != nil {
		pr.Close()
		return nil, fmt.Errorf("topo: start %s in %s: %w", name, n.Name(), err)
	}
	if ready == nil {
		go func() {
			defer pr.Close()
			io.Copy(io.Discard, pr)
		}()
		return proc, nil
	}
	type outcome struct {
		ready bool
		kept  []string
	}
	found := make(chan outcome, 1)
	go func() {
		defer pr.Close()
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		var o outcome
		for sc.Scan() {
			if ready(sc.Bytes()) {
				o.ready = true
				break
			}
			o.kept = append(o.kept, sc.Text())
			if len(o.kept) > keptLines {
				o.kept = o.kept[1:]
			}
		}
		found <- o
		io.Copy(io.Discard, pr)
	}()
	t := time.NewTimer(readyTimeout)
	defer t.Stop()
	fail := func(why string, kept []string) (*cluster.Proc, error) {
		proc.Stop(time.Second)
		return nil, fmt.Errorf("topo: %s in %s %s; its last lines:\n%s", name, n.Name(), why, strings.Join(kept, "\n"))
	}
	select {
	case o := <-found:
		if !o.ready {
			return fail(fmt.Sprintf("exited (%v) before it was ready", proc.Wait()), o.kept)
		}
		return proc, nil
	case <-t.C:
		return fail(fmt.Sprintf("not ready within %v", readyTimeout), nil)
	case <-ctx.Done():
		return fail("interrupted: "+ctx.Err().Error(), nil)
	}
}

// startMeshtun runs `meshtun node --node <n> <args>` in n's namespace,
// with env (KEY=VALUE) added to its environment, and waits for its ready
// message.
func startMeshtun(ctx context.Context, bin string, env []string, n *cluster.Node, args ...string) (*cluster.Proc, error) {
	args = append(append([]string{"node"}, noderun.Args(n)...), args...)
	return startLogged(ctx, n, env, func(line []byte) bool {
		if !bytes.Contains(line, []byte(node.ReadyMessage)) {
			return false
		}
		var rec struct {
			Message string `json:"message"`
		}
		return json.Unmarshal(line, &rec) == nil && rec.Message == node.ReadyMessage
	}, bin, args...)
}
