package registry

import (
	"sync"
	"testing"
)

// TestMailboxNewestWins: an unread snapshot is replaced by the next Put,
// and concurrent Puts never block (one of them is what is read).
func TestMailboxNewestWins(t *testing.T) {
	var m Mailbox
	a, b := &Snapshot{RootNamespace: "a"}, &Snapshot{RootNamespace: "b"}
	m.Put(a)
	m.Put(b)
	if got := <-m.Updates(); got != b {
		t.Fatalf("read %q, want the newest (b)", got.RootNamespace)
	}
	select {
	case got := <-m.Updates():
		t.Fatalf("read %q after the newest: a replaced snapshot was kept", got.RootNamespace)
	default:
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { m.Put(a) })
	}
	wg.Wait() // a Put that blocked would hang here
	if got := <-m.Updates(); got != a {
		t.Fatalf("read %v after concurrent Puts", got)
	}
}
