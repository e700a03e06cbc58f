// Package due runs the background loop of an object whose work falls due
// at deadlines: the consumer shard's lease expiries, the producer's push
// deadlines, the scheduler's load deadlines. Each owns one such loop; the
// producer and the scheduler end theirs, and their calls in flight, with
// one Life.
//
// A change that may move an object's next deadline earlier calls Due with
// it, which never wakes the loop's goroutine: it moves the end of the
// loop's sleep to that deadline when it falls earlier, and while a step
// runs (which may have read the deadlines before the change) it bounds the
// sleep that follows. Wake steps again now, regardless.
//
// Sleep is the one pause of the core's retry and backoff loops (the
// accept loop, the Unix event redial, the scheduler's retries): it ends
// early when its owner closes.
//
// Invariant: step never runs concurrently with itself, and the loop never
// sleeps past the deadline step last returned, nor past a deadline given
// to Due since that step began (nor less than a millisecond, so that a
// deadline already past cannot spin it).
package due
