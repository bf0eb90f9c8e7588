//go:build !nolab

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/cmd/meshtun/internal/demo"
)

// readyFD is the descriptor on which a demo daemon tells the process that
// started it that the cluster is up and handed over (ExtraFiles[0]).
const readyFD = 3

// startDaemon runs `meshtun demo --keep` as root: the cluster must outlive
// this command, so a background process in a session of its own holds it.
// The daemon writes the demo's output to our stdout until it signals
// readiness on readyFD; then this process exits and the daemon waits for
// `meshtun demo --down` (SIGTERM).
func startDaemon(ctx context.Context, args []string) error {
	if k, ok, err := demo.ReadKept(); err != nil {
		return err
	} else if ok && k.Running() {
		return fmt.Errorf("a demo cluster is already up (%s, pid %d); tear it down first: meshtun demo --down", k.Cluster, k.PID)
	}
	if err := os.MkdirAll(demo.StateDir(), 0o755); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	logf, err := os.OpenFile(demo.DaemonLog(), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return fmt.Errorf("demo: daemon log: %w", err)
	}
	defer logf.Close()
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	defer r.Close()
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("demo: find own binary: %w", err)
	}
	cmd := exec.Command(self, append([]string{"demo"}, args...)...)
	cmd.Env = append(os.Environ(), demo.StageEnv+"="+demo.StageDaemon)
	cmd.Stdout, cmd.Stderr = os.Stdout, logf
	cmd.ExtraFiles = []*os.File{w}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	w.Close()
	if err != nil {
		return fmt.Errorf("demo: start the daemon holding the cluster: %w", err)
	}
	ready := make(chan bool, 1)
	go func() {
		b := make([]byte, len("ready"))
		_, err := io.ReadFull(r, b)
		ready <- err == nil && string(b) == "ready"
	}()
	select {
	case ok := <-ready:
		if ok {
			return cmd.Process.Release()
		}
		if err := cmd.Wait(); err != nil {
			return fmt.Errorf("demo failed (%v); its log: %s", err, demo.DaemonLog())
		}
		return errors.New("demo ended without leaving the cluster up")
	case <-ctx.Done():
		// The daemon is in its own session: Ctrl-C did not reach it.
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
		return errors.New("interrupted; everything was torn down")
	}
}

// keepUp leaves the cluster up: it prints how to reach it, then, as the
// daemon of a root run (ready is its readiness pipe), records it for
// --down, tells the starting process and detaches from the terminal;
// rootless, it stays in the foreground. Either way it returns when ctx
// ends (--down, Ctrl-C).
func keepUp(ctx context.Context, d *demo.Demo, mode string, jsonOut bool, ready *os.File) error {
	var w io.Writer = os.Stdout
	if jsonOut {
		w = os.Stderr
	}
	// In rootless mode the namespaces are reachable through the user and
	// mount namespaces of this process.
	enter := ""
	if mode == "rootless" {
		enter = fmt.Sprintf("nsenter -t %d -U -m --preserve-credentials ", os.Getpid())
	}
	if mode == "rootless" {
		fmt.Fprintf(w, "\nThe cluster stays up. Each pod is a network namespace; as the same user, from another\nterminal, run a command in one with (nsenter joins this process's user and mount namespaces):\n")
	} else {
		fmt.Fprintf(w, "\nThe cluster stays up. Each pod is a network namespace; as root, run a command in one with:\n")
	}
	for _, e := range d.Endpoints() {
		fmt.Fprintf(w, "  %-9s %-12s %sip netns exec %s sh\n", e.Name, e.IPv4, enter, e.NS.Name())
	}
	for _, n := range d.Nodes() {
		fmt.Fprintf(w, "  node %-4s %-12s %sip netns exec %s sh   (meshtun node pid %d, admin http://127.0.0.1:15000/config_dump inside)\n",
			n.Name, n.IPv4, enter, n.NetNS, n.PID)
	}
	var client, echo demo.Endpoint
	for _, e := range d.Endpoints() {
		switch e.Name {
		case "client":
			client = e
		case "echo":
			echo = e
		}
	}
	fmt.Fprintf(w, "For example, through meshtun from client to echo:\n  %sip netns exec %s bash -c 'exec 3<>/dev/tcp/%s/8080; echo hi >&3; head -1 <&3'\n", enter, client.NS.Name(), echo.IPv4)
	fmt.Fprintf(w, "  %sip netns exec %s ping -c1 %s\n", enter, client.NS.Name(), echo.IPv4)
	fmt.Fprintf(w, "Watch node n1's port on the node-to-node link: %sip netns exec %s tcpdump -ni n1\n", enter, d.FabricNS())
	fmt.Fprintf(w, "Generated configs, the built-in CA's root and the node logs: %s (config.json, mesh.yaml and ca/ of meshtun ca, node.yaml and nodes/<node>/ of the nodes, ca.log, node-n1.log, node-n2.log)\n", d.Dir())

	if ready == nil {
		fmt.Fprintf(w, "Rootless: the namespaces live only as long as this process. Press Ctrl-C to tear everything down.\n")
		<-ctx.Done()
		return nil
	}
	fmt.Fprintf(w, "Demo log: %s\nTear down: meshtun demo --down\n", demo.DaemonLog())
	if err := demo.WriteKept(demo.Kept{PID: os.Getpid(), Cluster: d.Cluster(), Dir: d.Dir(),
		Namespaces: d.Namespaces(), Nodes: d.Nodes()}); err != nil {
		return err
	}
	// Hand over: tell the starting process, and write nothing more to the
	// terminal it shares with us.
	if _, err := ready.WriteString("ready"); err != nil {
		return fmt.Errorf("demo: signal readiness: %w", err)
	}
	ready.Close()
	if null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0); err == nil {
		unix.Dup2(int(null.Fd()), 1)
		null.Close()
	}
	<-ctx.Done()
	return nil
}

// daemonReady returns the readiness pipe of a daemon and keeps it from
// leaking into the processes the daemon starts (which would hold it open).
func daemonReady() *os.File {
	unix.CloseOnExec(readyFD)
	return os.NewFile(readyFD, "ready")
}

// demoDown tears down a demo left up by --keep.
func demoDown() error {
	did, err := demo.Down()
	if len(did) == 0 && err == nil {
		fmt.Println("No demo cluster is up. (A rootless --keep demo lives in its own terminal: stop it with Ctrl-C there.)")
		return nil
	}
	for _, s := range did {
		fmt.Println(s)
	}
	return err
}
