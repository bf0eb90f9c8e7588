package cluster

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"runtime"
	"sync"
	"syscall"
	"time"
)

// stopGrace is how long Close waits after SIGTERM before it sends SIGKILL.
const stopGrace = 2 * time.Second

// Command returns a command that runs name with args inside the namespace.
// It runs as `ip netns exec <ns> <name> <args…>`: ip enters the namespace,
// remounts /sys for it and then execs name, so the process ID of the
// returned command is that of the program itself.
//
// The command runs in its own process group, gets SIGKILL if the test
// process dies (Pdeathsig; see procTable for why Start, not cmd.Start, must
// start it), and on ctx cancellation its whole process group is killed.
// Start it with (*NS).Start so that Close stops it.
func (n *NS) Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", n.name, name}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error {
		return signalGroup(cmd, syscall.SIGKILL)
	}
	cmd.WaitDelay = stopGrace
	return cmd
}

// Proc is a process started with (*NS).Start. Its Wait replaces
// exec.Cmd.Wait, which must not be called.
type Proc struct {
	// Cmd is the started command.
	Cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// Done is closed when the process has exited and been reaped.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Wait waits for the process to exit and returns the error of cmd.Wait.
func (p *Proc) Wait() error {
	<-p.done
	return p.err
}

// Stop sends SIGTERM to the process group, SIGKILL after grace if it is
// still running, and waits for the process to be reaped. It returns an
// error only if signalling failed; the exit status is Wait's.
func (p *Proc) Stop(grace time.Duration) error {
	select {
	case <-p.done:
		return nil
	default:
	}
	if err := signalGroup(p.Cmd, syscall.SIGTERM); err != nil {
		return err
	}
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.done:
		return nil
	case <-t.C:
	}
	if err := signalGroup(p.Cmd, syscall.SIGKILL); err != nil {
		return err
	}
	<-p.done
	return nil
}

// signalGroup signals the process group of a started command (its own,
// from Setpgid), or only the process if it was not started in its own
// group. A process that is already gone is not an error.
func signalGroup(cmd *exec.Cmd, sig syscall.Signal) error {
	if cmd.Process == nil {
		return nil
	}
	pid := cmd.Process.Pid
	target := pid
	if cmd.SysProcAttr != nil && cmd.SysProcAttr.Setpgid && cmd.SysProcAttr.Pgid == 0 {
		target = -pid
	}
	if err := syscall.Kill(target, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("signal %v to pid %d: %w", sig, target, err)
	}
	return nil
}

// Start starts cmd, which must come from this namespace's Command, and
// tracks it so that the cluster's Close stops it.
func (n *NS) Start(cmd *exec.Cmd) (*Proc, error) {
	if len(cmd.Args) < 5 || cmd.Args[1] != "netns" || cmd.Args[2] != "exec" || cmd.Args[3] != n.name {
		return nil, fmt.Errorf("netns %s: start %q: command was not made by this namespace's Command", n.name, cmd.Args)
	}
	return n.procs.start(cmd)
}

// procTable tracks the processes started in a cluster. Commands are started
// from one goroutine locked to its OS thread for the table's lifetime: the
// children's Pdeathsig fires when the thread that forked them exits, and a
// thread that never exits before Close makes that signal mean "the test
// process died" and nothing else.
type procTable struct {
	mu     sync.Mutex
	closed bool
	procs  []*Proc
	reqs   chan startReq // nil until the first start
}

type startReq struct {
	cmd *exec.Cmd
	err chan error
}

// starter starts the commands it receives on its locked thread until reqs
// is closed, then lets the thread go.
func starter(reqs <-chan startReq) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for r := range reqs {
		r.err <- r.cmd.Start()
	}
}

func (t *procTable) start(cmd *exec.Cmd) (*Proc, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, fmt.Errorf("start %q: cluster is closed", cmd.Args)
	}
	if t.reqs == nil {
		t.reqs = make(chan startReq)
		go starter(t.reqs)
	}
	errc := make(chan error, 1)
	t.reqs <- startReq{cmd: cmd, err: errc}
	if err := <-errc; err != nil {
		return nil, fmt.Errorf("start %q: %w", cmd.Args, err)
	}
	p := &Proc{Cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.procs = append(t.procs, p)
	return p, nil
}

// stopAll refuses further starts and stops every tracked process that is
// still running, all at once.
func (t *procTable) stopAll(grace time.Duration) error {
	t.mu.Lock()
	t.closed = true
	procs := t.procs
	t.procs = nil
	if t.reqs != nil {
		close(t.reqs)
		t.reqs = nil
	}
	t.mu.Unlock()
	errs := make([]error, len(procs))
	var wg sync.WaitGroup
	for i, p := range procs {
		wg.Go(func() {
			if err := p.Stop(grace); err != nil {
				errs[i] = fmt.Errorf("stop %q: %w", p.Cmd.Args, err)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}
