package node

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// The admin socket: the endpoints that change the node (POST /logging) or
// read its memory (/debug/pprof/) are served only on a Unix socket that
// only root (the node's user) can connect to: mode 0600, in a directory
// only its owner may write to, and each connection's peer checked
// (SO_PEERCRED) to be root or the node's own user.

// listenAdminSocket makes the directory of path (0700 if new; tightened to
// 0700 if it is ours and others may write to it), binds a socket beside
// path, sets it to 0600 and renames it over path, so that the path never
// names a socket others may connect to.
func listenAdminSocket(path string, log zerolog.Logger) (*peerCheckListener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir():
		return nil, fmt.Errorf("admin socket %s: %s is not a directory", path, dir)
	case !ok || int(st.Uid) != os.Geteuid():
		return nil, fmt.Errorf("admin socket %s: directory %s is not owned by uid %d (others could replace the socket)", path, dir, os.Geteuid())
	case fi.Mode().Perm()&0o022 != 0 && fi.Mode()&os.ModeSticky == 0:
		// Ours but writable by others (an emptyDir volume is 0777):
		// nobody else may rename or replace what is in it.
		if err := os.Chmod(dir, 0o700); err != nil {
			return nil, fmt.Errorf("admin socket %s: tighten directory %s (%v) to 0700: %w", path, dir, fi.Mode().Perm(), err)
		}
		log.Warn().Str("dir", dir).Str("was", fi.Mode().Perm().String()).Msg("admin socket directory was writable by others; set to 0700")
	}
	// A short name beside it: a Unix socket path has at most 107 bytes.
	tmp := filepath.Join(dir, fmt.Sprintf(".s%d", os.Getpid()))
	if err := os.Remove(tmp); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("admin socket %s: remove stale %s: %w", path, tmp, err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(false) // renamed below; Close removes path itself
	fail := func(err error) (*peerCheckListener, error) {
		ln.Close()
		os.Remove(tmp)
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail(err)
	}
	sfi, err := os.Lstat(path)
	if err != nil {
		return fail(err)
	}
	return &peerCheckListener{UnixListener: ln, path: path, fi: sfi, log: log}, nil
}

// peerCheckListener accepts connections only from root or the node's own
// user, and removes its socket file on Close if it is still there.
type peerCheckListener struct {
	*net.UnixListener
	path string
	fi   os.FileInfo
	log  zerolog.Logger
}

func (l *peerCheckListener) Accept() (net.Conn, error) {
	for {
		c, err := l.UnixListener.AcceptUnix()
		if err != nil {
			return nil, err
		}
		cred, err := peerCred(c)
		if err != nil || (cred.Uid != 0 && int(cred.Uid) != os.Geteuid()) {
			ev := l.log.Warn().Str("socket", l.path)
			if cred != nil {
				ev = ev.Uint32("uid", cred.Uid).Int32("pid", cred.Pid)
			}
			ev.AnErr("peer_error", err).Msg("admin socket: connection from another user refused")
			c.Close()
			continue
		}
		return &credConn{UnixConn: c, cred: *cred}, nil
	}
}

func (l *peerCheckListener) Close() error {
	err := l.UnixListener.Close()
	// Remove the path only if it is still our socket: another node
	// process (tests run several) may have replaced it.
	if fi, serr := os.Lstat(l.path); serr == nil && os.SameFile(fi, l.fi) {
		os.Remove(l.path)
	}
	return err
}

func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, serr
}

// credConn is an admin socket connection and its peer's credentials.
type credConn struct {
	*net.UnixConn
	cred unix.Ucred
}

type peerKey struct{}

// withPeer puts the peer's credentials of an admin socket connection into
// the request context (http.Server.ConnContext).
func withPeer(ctx context.Context, c net.Conn) context.Context {
	if cc, ok := c.(*credConn); ok {
		return context.WithValue(ctx, peerKey{}, cc.cred)
	}
	return ctx
}

// peerOf returns the credentials of the request's peer on the admin
// socket.
func peerOf(ctx context.Context) (unix.Ucred, bool) {
	c, ok := ctx.Value(peerKey{}).(unix.Ucred)
	return c, ok
}
