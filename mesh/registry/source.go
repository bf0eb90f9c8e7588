package registry

import (
	"context"
	"sync"
)

// Source is where a node's mesh model comes from: the config file,
// the Kubernetes API server or istiod. The node is given one and does not
// know which it is.
//
// Start begins following the source and returns its first snapshot once
// the source has synced (the file read, the informers' caches filled,
// every xDS type received), or an error if ctx ends first or the source
// cannot start. From then on, until ctx ends, Updates delivers each new
// snapshot; only the newest matters (see Mailbox). SourceStatus is what
// the source last saw, for /config_dump ("source"); it may be called at
// any time, also before Start returns.
type Source interface {
	Start(ctx context.Context) (*Snapshot, error)
	Updates() <-chan *Snapshot
	SourceStatus() any
}

// Mailbox is a source's newest-wins outbox: Put replaces a snapshot the
// node has not read yet, so a slow node skips to the latest model instead
// of applying every one in turn. The zero value is ready to use; a source
// embeds it to get its Updates method.
type Mailbox struct {
	once sync.Once
	mu   sync.Mutex // serializes Put: its drain-and-send is one step
	ch   chan *Snapshot
}

func (m *Mailbox) init() { m.once.Do(func() { m.ch = make(chan *Snapshot, 1) }) }

// Put delivers s, replacing an unread snapshot. It never blocks.
func (m *Mailbox) Put(s *Snapshot) {
	m.init()
	m.mu.Lock()
	defer m.mu.Unlock()
	select {
	case <-m.ch:
	default:
	}
	m.ch <- s
}

// Updates delivers the snapshots Put, newest only.
func (m *Mailbox) Updates() <-chan *Snapshot {
	m.init()
	return m.ch
}
