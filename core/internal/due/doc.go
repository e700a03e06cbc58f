// Package due runs the background loop of an object whose work falls due
// at deadlines: the consumer shard's lease expiries, the producer's push
// deadlines, the scheduler's load deadlines. Each owns one such loop; the
// producer and the scheduler end theirs, and their calls in flight, with
// one Life.
//
// Invariant: step never runs concurrently with itself, and the loop never
// sleeps past the deadline step last returned (nor less than a
// millisecond, so that a deadline already past cannot spin it).
package due
