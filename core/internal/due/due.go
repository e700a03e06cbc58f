// Package due runs the background loop of an object whose work falls due
// at deadlines: the consumer shard's lease expiries, the producer's push
// deadlines, the scheduler's load deadlines. Each owns one such loop.
//
// Invariant: step never runs concurrently with itself, and the loop never
// sleeps past the deadline step last returned (nor less than a
// millisecond, so that a deadline already past cannot spin it).
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
