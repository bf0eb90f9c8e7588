package config

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/registry"
)

// FileSource is the config file as a model source (registry.Source): its
// first snapshot is the config it was made with, and from then on the
// file is watched: a valid change replaces the mesh model (workloads,
// services, policies); node settings in it take effect at the next start,
// and a change of trust domain is refused until then. An invalid file
// keeps the last good model.
type FileSource struct {
	registry.Mailbox
	c    *Config
	node string
	log  zerolog.Logger

	mu     sync.Mutex
	status FileStatus
}

// FileStatus is what the file source last did, for /config_dump.
type FileStatus struct {
	// Source is "file"; Path the config file.
	Source string `json:"source"`
	Path   string `json:"path"`
	// Loaded is when the model in force was read; Reloads counts the
	// changes applied since the start.
	Loaded  time.Time `json:"loaded"`
	Reloads int       `json:"reloads"`
	// LastError is the last change refused (the previous model stays).
	LastError string `json:"lastError,omitempty"`
}

// NewFileSource returns the source of c, loaded at start-up, for node (its
// entry in the file): Start delivers c's model, then the changes of
// c.Path whose content differs from c's. A change that removes node from
// the file is refused (the node's capture would go with it).
func NewFileSource(c *Config, node string, log zerolog.Logger) *FileSource {
	return &FileSource{c: c, node: node, log: log, status: FileStatus{Source: "file", Path: c.Path}}
}

// Start returns the model of the start-up config and watches the file
// until ctx ends.
func (s *FileSource) Start(ctx context.Context) (*registry.Snapshot, error) {
	snap, err := s.c.Snapshot()
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.status.Loaded = time.Now()
	s.mu.Unlock()
	r := &reloader{
		path: s.c.Path, node: s.node, inForce: s.c.Sum(), td: snap.TrustDomain, log: s.log,
		apply: func(_ *Config, snap *registry.Snapshot) {
			s.mu.Lock()
			s.status.Loaded, s.status.Reloads, s.status.LastError = time.Now(), s.status.Reloads+1, ""
			s.mu.Unlock()
			s.Put(snap)
		},
		refused: func(err error) {
			s.mu.Lock()
			s.status.LastError = err.Error()
			s.mu.Unlock()
		},
	}
	go func() {
		err := Watch(ctx, s.c.Path, r.onChange, r.onError)
		if err != nil && !errors.Is(err, context.Canceled) {
			s.log.Error().Err(err).Str("config", s.c.Path).Msg("config watch stopped")
		}
	}()
	return snap, nil
}

// SourceStatus returns a FileStatus.
func (s *FileSource) SourceStatus() any {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.status
}

// reloader decides which configs the watcher delivers are applied: one
// whose content differs from the config in force, that builds, and that
// keeps the trust domain. It compares content, not the order of
// deliveries, so that a change made between the start-up load and the
// watch is applied, and a valid change after an invalid one too.
type reloader struct {
	path string
	// node, if set, must stay in the file.
	node string
	// inForce is the Sum of the config whose model is in force; the zero
	// value (none known) matches no config.
	inForce [sha256.Size]byte
	// td is the trust domain of the running node: the CA, the SVIDs and
	// the TLS verification are built for it.
	td      spiffeid.TrustDomain
	apply   func(*Config, *registry.Snapshot)
	refused func(error) // if set, told of each change not applied
	log     zerolog.Logger
}

func (r *reloader) onChange(c *Config) {
	if c.Sum() == r.inForce {
		r.log.Debug().Str("config", r.path).Msg("config unchanged from the one in force")
		return
	}
	snap, err := c.Snapshot()
	if err != nil {
		r.onError(err)
		return
	}
	if r.node != "" {
		if _, err := c.Node(r.node); err != nil {
			r.onError(fmt.Errorf("this node is gone from the file: %w", err))
			return
		}
	}
	if snap.TrustDomain != r.td {
		err := errors.New("the trust domain changed from " + r.td.String() + " to " + snap.TrustDomain.String() + ", which needs a restart of the node")
		r.log.Error().Str("config", r.path).Str("trust_domain", snap.TrustDomain.String()).Str("in_force", r.td.String()).
			Msgf("config reload refused: %s; keeping the last good model", err)
		if r.refused != nil {
			r.refused(err)
		}
		return
	}
	for _, w := range c.Warnings {
		r.log.Warn().Str("config", r.path).Msg(w)
	}
	r.log.Info().Str("config", r.path).Int("workloads", len(snap.Workloads)).Int("services", len(snap.Services)).
		Int("policies", len(snap.Policies)).Msg("config read")
	r.apply(c, snap)
	r.inForce = c.Sum()
}

func (r *reloader) onError(err error) {
	r.log.Error().Err(err).Str("config", r.path).Msg("config reload failed; keeping the last good model")
	if r.refused != nil {
		r.refused(err)
	}
}
