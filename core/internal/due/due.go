package due

import (
	"sync"
	"time"
)

// idle bounds the sleep of a loop with no deadline: a net, since a wake
// or stop ends any sleep at once.
const idle = time.Hour

// Loop calls a step, then sleeps until the deadline the step returned, a
// Wake, a Due earlier than that deadline, or stop. The zero Loop is not
// ready: make one with NewLoop.
type Loop struct {
	wake chan struct{}

	mu sync.Mutex
	// sleeping is false while a step runs (any Due then wakes the loop
	// again, since the step may have read its deadlines before the change);
	// until is when the current sleep ends by itself.
	sleeping bool
	until    time.Time
}

// NewLoop returns a loop that Run drives.
func NewLoop() *Loop { return &Loop{wake: make(chan struct{}, 1)} }

// Run calls step and sleeps as Loop says, until stop closes. A step that
// recovers a panic should return no deadline.
func (l *Loop) Run(stop <-chan struct{}, step func() (next time.Time, ok bool)) {
	timer := time.NewTimer(idle)
	defer timer.Stop()
	for {
		l.mu.Lock()
		l.sleeping = false
		l.mu.Unlock()
		wait := idle
		if next, ok := step(); ok {
			wait = max(time.Until(next), time.Millisecond)
		}
		l.mu.Lock()
		l.sleeping, l.until = true, time.Now().Add(wait)
		l.mu.Unlock()
		timer.Reset(wait)
		select {
		case <-stop:
			return
		case <-l.wake:
		case <-timer.C:
		}
	}
}

// Wake has the loop step again now.
func (l *Loop) Wake() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// Due has the loop step again by at: it wakes the loop only when at falls
// before the end of its sleep, so that a change that leaves the next
// deadline where it was costs no goroutine hand-off.
func (l *Loop) Due(at time.Time) {
	l.mu.Lock()
	wake := !l.sleeping || at.Before(l.until)
	l.mu.Unlock()
	if wake {
		l.Wake()
	}
}
