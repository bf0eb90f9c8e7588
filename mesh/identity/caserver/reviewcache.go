package caserver

import (
	"context"
	"crypto/sha256"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of KubeMode's TokenReview cache.
const (
	// DefaultReviewTTL is how long a successful TokenReview is reused. A
	// token the API server stops accepting (its pod deleted) is accepted
	// for at most this long more; the pod it is bound to is still read on
	// every request, so a deleted or replaced pod is refused at once.
	DefaultReviewTTL = 10 * time.Second
	// DefaultReviewCacheSize bounds the cached reviews (one per node
	// token; about 200 bytes each).
	DefaultReviewCacheSize = 4096
)

// reviewCache reuses successful TokenReviews for a short time, keyed by a
// SHA-256 of the audiences and the token (the token itself is not kept).
// Failures are never cached: a refused token is reviewed again on its next
// request. Concurrent requests with the same token share one review.
type reviewCache struct {
	ttl time.Duration
	max int
	now func() time.Time

	mu sync.Mutex
	m  map[[32]byte]*reviewEntry

	waiting atomic.Int32 // requests waiting for another's review (tests)
}

type reviewEntry struct {
	done chan struct{} // closed when r, err are set
	r    *TokenReview
	err  error
	exp  time.Time // zero: not cacheable (a failure)
}

func newReviewCache(ttl time.Duration, max int) *reviewCache {
	if ttl <= 0 {
		ttl = DefaultReviewTTL
	}
	if max <= 0 {
		max = DefaultReviewCacheSize
	}
	return &reviewCache{ttl: ttl, max: max, now: time.Now, m: map[[32]byte]*reviewEntry{}}
}

func (c *reviewCache) review(ctx context.Context, rv TokenReviewer, token string, audiences []string) (*TokenReview, error) {
	key := sha256.Sum256([]byte(strings.Join(audiences, "\x00") + "\x00\x00" + token))
	c.mu.Lock()
	if e, ok := c.m[key]; ok {
		select {
		case <-e.done:
			if c.now().Before(e.exp) {
				c.mu.Unlock()
				return e.r, nil
			}
			delete(c.m, key)
		default:
			// A review of this token is under way: share its result.
			c.mu.Unlock()
			c.waiting.Add(1)
			defer c.waiting.Add(-1)
			select {
			case <-e.done:
				return e.r, e.err
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
	}
	if len(c.m) >= c.max {
		c.evictLocked()
	}
	e := &reviewEntry{done: make(chan struct{})}
	c.m[key] = e
	c.mu.Unlock()

	r, err := rv.Review(ctx, token, audiences)

	c.mu.Lock()
	e.r, e.err = r, err
	if err == nil && r != nil && r.Authenticated {
		e.exp = c.now().Add(c.ttl)
	} else if c.m[key] == e {
		delete(c.m, key)
	}
	close(e.done)
	c.mu.Unlock()
	return r, err
}

// evictLocked makes room: expired entries go first, then (all live)
// arbitrary finished ones until the cache is at three quarters.
func (c *reviewCache) evictLocked() {
	now := c.now()
	for k, e := range c.m {
		select {
		case <-e.done:
			if !now.Before(e.exp) {
				delete(c.m, k)
			}
		default:
		}
	}
	for k := range c.m {
		if len(c.m) < c.max*3/4 {
			return
		}
		delete(c.m, k) // an in-flight entry still completes for its waiters
	}
}

func (c *reviewCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.m)
}
