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

import (
	"container/heap"
	"strconv"
	"time"
)

// Entry is one deadline; Before is a strict order, earliest first.
type Entry[E any] interface {
	Before(E) bool
}

// Heap is a container/heap of entries, earliest first.
type Heap[E Entry[E]] []E

var _ heap.Interface = (*Heap[entryForCheck])(nil)

type entryForCheck struct{}

func (entryForCheck) Before(entryForCheck) bool { return false }

func (h Heap[E]) Len() int           { return len(h) }
func (h Heap[E]) Less(i, j int) bool { return h[i].Before(h[j]) }
func (h Heap[E]) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *Heap[E]) Push(x any)        { *h = append(*h, x.(E)) }

// Pop clears the slot it vacates, so the heap keeps no reference to what
// it handed out.
func (h *Heap[E]) Pop() any {
	old := *h
	e := old[len(old)-1]
	var zero E
	old[len(old)-1] = zero
	*h = old[:len(old)-1]
	return e
}

// Secs renders a wait the way operators configure it ("60s", "0.5s").
func Secs(d time.Duration) string {
	return strconv.FormatFloat(d.Seconds(), 'f', -1, 64) + "s"
}
