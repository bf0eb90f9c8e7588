package relay

import (
	"sync"
	"testing"
	"time"
)

func TestIdleNotifyBeforeWait(t *testing.T) {
	var p Idle
	p.Init(func() { t.Error("resume started although the goroutine was still there") })
	p.Notify()
	if !p.Wait(time.Hour) {
		t.Fatal("Wait after Notify: false")
	}
}

func TestIdleNotifyDuringWait(t *testing.T) {
	var p Idle
	p.Init(func() { t.Error("resume started although the goroutine was waiting") })
	got := make(chan bool)
	go func() { got <- p.Wait(time.Hour) }()
	for p.state.Load() != parked {
		time.Sleep(time.Millisecond) // polls p's own state: no other signal exists
	}
	p.Notify()
	if !<-got {
		t.Fatal("Wait woken by Notify: false")
	}
}

func TestIdleGraceThenResume(t *testing.T) {
	var p Idle
	resumed := make(chan struct{})
	p.Init(func() { close(resumed) })
	if p.Wait(time.Millisecond) {
		t.Fatal("Wait without Notify: true")
	}
	select {
	case <-resumed:
		t.Fatal("resume started before Notify")
	default:
	}
	p.Notify()
	select {
	case <-resumed:
	case <-time.After(10 * time.Second):
		t.Fatal("Notify after the grace period did not start resume")
	}
}

// TestIdleEveryNotifyCountsOnce races Notify against the end of the grace
// period many times: each arming must end in exactly one of Wait
// returning true or resume running, never both and never neither.
func TestIdleEveryNotifyCountsOnce(t *testing.T) {
	const rounds = 2000
	var p Idle
	resumed := make(chan struct{}, 1)
	p.Init(func() { resumed <- struct{}{} })
	for i := range rounds {
		var wg sync.WaitGroup
		wg.Go(func() {
			if i%3 != 0 {
				time.Sleep(time.Duration(i%50) * time.Microsecond)
			}
			p.Notify()
		})
		woke := p.Wait(time.Duration(i%40) * time.Microsecond)
		wg.Wait()
		if !woke {
			select {
			case <-resumed:
			case <-time.After(10 * time.Second):
				t.Fatalf("round %d: Wait gave up and resume never ran", i)
			}
		}
		select {
		case <-resumed:
			t.Fatalf("round %d: resume ran although Wait returned %v", i, woke)
		default:
		}
		if s := p.state.Load(); s != running {
			t.Fatalf("round %d: state %d after the round, want running", i, s)
		}
	}
}
