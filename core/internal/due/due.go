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
	// sleeping is false while a step runs (and before Run starts); until
	// is when the current sleep ends, the deadline timer is armed for.
	sleeping bool
	until    time.Time
	timer    *time.Timer
	// soonest is the earliest deadline given to Due while not sleeping,
	// zero when none: the step may have read its deadlines before that
	// change, so the sleep after it ends by soonest.
	soonest time.Time
}

// NewLoop returns a loop that Run drives.
func NewLoop() *Loop { return &Loop{wake: make(chan struct{}, 1)} }

// Run calls step and sleeps as Loop says, until stop closes. A step that
// recovers a panic should return no deadline.
func (l *Loop) Run(stop <-chan struct{}, step func() (next time.Time, ok bool)) {
	l.mu.Lock()
	l.timer = time.NewTimer(idle)
	timer := l.timer
	l.mu.Unlock()
	defer timer.Stop()
	for {
		l.mu.Lock()
		l.sleeping = false
		l.mu.Unlock()
		next, ok := step()
		now := time.Now()
		until := now.Add(idle)
		if ok {
			until = next
		}
		l.mu.Lock()
		if !l.soonest.IsZero() && l.soonest.Before(until) {
			until = l.soonest
		}
		l.soonest = time.Time{}
		l.sleeping, l.until = true, l.arm(now, until)
		l.mu.Unlock()
		select {
		case <-stop:
			return
		case <-l.wake:
		case <-timer.C:
		}
	}
}

// arm sets the timer to fire at until, but no sooner than a millisecond
// from now, and returns when it fires. l.mu is held: Run and Due both arm.
func (l *Loop) arm(now, until time.Time) time.Time {
	if soon := now.Add(time.Millisecond); until.Before(soon) {
		until = soon
	}
	l.timer.Reset(until.Sub(now))
	return until
}

// Wake has the loop step again now.
func (l *Loop) Wake() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// Due has the loop step again by at. It never hands off to the loop's
// goroutine (a thread wake-up, and a step under its owner's lock, for a
// deadline usually seconds away): a sleeping loop's timer is moved to at
// when at falls before the end of its sleep, and a loop that is stepping
// (or not yet running) ends its next sleep by at.
func (l *Loop) Due(at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case !l.sleeping:
		if l.soonest.IsZero() || at.Before(l.soonest) {
			l.soonest = at
		}
	case at.Before(l.until):
		l.until = l.arm(time.Now(), at)
	}
}
