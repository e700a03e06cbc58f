package due

import "time"

// idle bounds the sleep of a loop with no deadline: a net, since a wake
// or stop ends any sleep at once.
const idle = time.Hour

// Loop calls step, then sleeps until the deadline step returned (none when
// ok is false), a value on wake, or stop closing; it returns at stop. A
// step that recovers a panic should return no deadline.
func Loop(stop, wake <-chan struct{}, step func() (next time.Time, ok bool)) {
	timer := time.NewTimer(idle)
	defer timer.Stop()
	for {
		wait := idle
		if next, ok := step(); ok {
			wait = max(time.Until(next), time.Millisecond)
		}
		timer.Reset(wait)
		select {
		case <-stop:
			return
		case <-wake:
		case <-timer.C:
		}
	}
}
