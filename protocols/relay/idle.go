// Package relay is meshtun's one byte pump (Pump), used by the proxy for
// every connection it carries and by the HBONE server for every stream:
// half-close and reset mapped one way, pooled read buffers, one byte
// count (Meter), and directions that wait for an idle source without
// holding a goroutine (Idle).
package relay

import (
	"sync/atomic"
	"time"
)

// Grace is how long a relay direction whose source ran dry waits for more
// on its own goroutine before it lets the goroutine go. A connection that
// exchanges messages more often keeps warm goroutines, whose wake-up is a
// hand-off; one that idles longer holds no goroutine and no buffer, and
// pays for a new goroutine (its stack grown again) when data comes.
const Grace = 10 * time.Millisecond

// Idle parks a relay direction whose source has nothing to read. The
// direction arms Notify as its source's readiness callback
// (WhenReadable(idle.Notify)) and, if that did not find the source
// readable, calls Wait: Wait returns true when Notify came within the
// grace period, and the direction goes on on the same goroutine; it
// returns false when the grace period passed first, and the goroutine must
// end: Notify then starts resume on a goroutine of its own when the source
// becomes readable.
//
// The zero Idle is not usable; call Init.
type Idle struct {
	state  atomic.Int32
	wake   chan struct{}
	timer  *time.Timer
	resume func()
}

const (
	running  int32 = iota // the direction's goroutine runs
	notified              // it runs, and Notify came before it reached Wait
	parked                // it waits in Wait
	gone                  // it ended; Notify starts resume
)

// Init readies p; resume is what Notify starts on a new goroutine after
// the direction's goroutine has ended.
func (p *Idle) Init(resume func()) {
	p.wake = make(chan struct{}, 1)
	p.resume = resume
}

// Notify is the readiness callback. It never blocks and may be called
// with the source's locks held. It must be armed at most once at a time.
func (p *Idle) Notify() {
	for {
		switch p.state.Load() {
		case running:
			if p.state.CompareAndSwap(running, notified) {
				return
			}
		case parked:
			if p.state.CompareAndSwap(parked, running) {
				p.wake <- struct{}{} // Wait takes it in every case
				return
			}
		case gone:
			if p.state.CompareAndSwap(gone, running) {
				go p.resume()
				return
			}
		default: // notified: a second Notify for one arming
			return
		}
	}
}

// Wait waits, after Notify was armed, for Notify or the grace period. It
// returns true if Notify came (the caller goes on), false if the caller's
// goroutine must end (Notify will start resume).
func (p *Idle) Wait(grace time.Duration) bool {
	if p.state.CompareAndSwap(notified, running) {
		return true
	}
	if !p.state.CompareAndSwap(running, parked) {
		p.state.Store(running) // notified in between
		return true
	}
	if p.timer == nil {
		p.timer = time.NewTimer(grace)
	} else {
		p.timer.Reset(grace)
	}
	select {
	case <-p.wake:
		p.timer.Stop()
		return true
	case <-p.timer.C:
	}
	// An idle direction keeps no timer. Only a goroutine in Wait uses
	// it, and the next one cannot start before the state says gone.
	t := p.timer
	p.timer = nil
	if p.state.CompareAndSwap(parked, gone) {
		return false
	}
	p.timer = t
	<-p.wake // Notify won the race and sends
	return true
}
