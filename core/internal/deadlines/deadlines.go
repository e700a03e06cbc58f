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

// Add pushes e. Unlike heap.Push it boxes nothing in an interface: the
// push manager sets a deadline at every state change of every record, and
// an allocation each was a share of the encoder's per-batch call.
func (h *Heap[E]) Add(e E) {
	*h = append(*h, e)
	s := *h
	for j := len(s) - 1; j > 0; {
		i := (j - 1) / 2
		if !s[j].Before(s[i]) {
			break
		}
		s[i], s[j] = s[j], s[i]
		j = i
	}
}

// Take removes and returns the earliest entry, clearing the slot it
// vacates, without boxing it (heap.Pop's answer is an interface). The heap
// must not be empty. Add, Take and container/heap's functions mix freely:
// each keeps the same heap order.
func (h *Heap[E]) Take() E {
	s := *h
	n := len(s) - 1
	s[0], s[n] = s[n], s[0]
	for i := 0; ; {
		j := 2*i + 1
		if j >= n {
			break
		}
		if k := j + 1; k < n && s[k].Before(s[j]) {
			j = k
		}
		if !s[j].Before(s[i]) {
			break
		}
		s[i], s[j] = s[j], s[i]
		i = j
	}
	e := s[n]
	var zero E
	s[n] = zero
	*h = s[:n]
	return e
}

// Secs renders a wait the way operators configure it ("60s", "0.5s").
func Secs(d time.Duration) string {
	return strconv.FormatFloat(d.Seconds(), 'f', -1, 64) + "s"
}
