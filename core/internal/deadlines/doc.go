// Package deadlines holds what the core's state machines share about
// their deadlines: a min-heap whose entries order themselves, and the way a
// wait is written in a failure reason.
//
// An entry's Before breaks ties between equal times (by id, then sequence)
// so that deadlines that fall due together fire in the same order on every
// run. Entries are never removed when a record changes state: each owner
// recognises and skips its stale entries when they surface, so that a
// state change costs O(log n) without a position index.
package deadlines
