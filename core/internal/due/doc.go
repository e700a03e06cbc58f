// Package due runs the background loop of an object whose work falls due
// at deadlines: the consumer shard's lease expiries, the producer's push
// deadlines, the scheduler's load deadlines. Each owns one such loop; the
// producer and the scheduler end theirs, and their calls in flight, with
// one Life.
//
// A change that may move an object's next deadline earlier calls Due with
// it: the loop is woken only when that deadline falls before the end of
// its sleep, or when a step is running (which may have read the deadlines
// before the change). Wake steps again regardless.
//
// Invariant: step never runs concurrently with itself, and the loop never
// sleeps past the deadline step last returned, nor past a deadline given
// to Due since that step began (nor less than a millisecond, so that a
// deadline already past cannot spin it).
package due
