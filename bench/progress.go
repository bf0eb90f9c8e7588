package bench

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"time"
)

// Progress reports how far a run is. On a terminal (live) it redraws one
// status line; otherwise it writes one plain line per step. A nil
// *Progress reports nothing.
type Progress struct {
	mu    sync.Mutex
	w     io.Writer
	live  bool
	start time.Time
	total int
	done  int
	width int // of the last live line, to blank it
	now   func() time.Time
}

// NewProgress reports to w, redrawing a single line if live.
func NewProgress(w io.Writer, live bool) *Progress {
	return &Progress{w: w, live: live, start: time.Now(), now: time.Now}
}

// setTotal sets the number of steps the run will take.
func (p *Progress) setTotal(n int) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.total = n
	p.mu.Unlock()
}

// step announces the step about to run; the previous one is done.
func (p *Progress) step(what string) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done++
	line := p.line(what)
	if !p.live {
		fmt.Fprintln(p.w, line)
		return
	}
	pad := max(p.width-len([]rune(line)), 0)
	fmt.Fprintf(p.w, "\r%s%s", line, strings.Repeat(" ", pad))
	p.width = len([]rune(line))
}

// note prints a line that stays, above the live line.
func (p *Progress) note(msg string) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.live && p.width > 0 {
		fmt.Fprintf(p.w, "\r%s\r", strings.Repeat(" ", p.width))
		p.width = 0
	}
	fmt.Fprintln(p.w, msg)
}

// finish ends the live line.
func (p *Progress) finish() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.live && p.width > 0 {
		fmt.Fprintf(p.w, "\r%s\r", strings.Repeat(" ", p.width))
		p.width = 0
	}
}

// line formats "[ 12/96] 0:42 elapsed, ~2:10 left · what".
func (p *Progress) line(what string) string {
	elapsed := p.now().Sub(p.start)
	s := fmt.Sprintf("[%*d/%d] %s", len(fmt.Sprint(p.total)), p.done, p.total, clock(elapsed))
	if p.done > 1 && p.total > 0 {
		left := time.Duration(float64(elapsed) / float64(p.done-1) * float64(p.total-p.done+1))
		s += fmt.Sprintf(", ~%s left", clock(left))
	}
	return s + " · " + what
}

// clock formats a duration as m:ss.
func clock(d time.Duration) string {
	s := int(d.Round(time.Second).Seconds())
	return fmt.Sprintf("%d:%02d", s/60, s%60)
}
