package push

import (
	"container/heap"
	"strconv"
	"time"
)

// deadline is one entry of the deadline heap. A record remembers the seq of
// its current entry; entries left behind by a state change are skipped when
// they surface, so a state change never searches the heap.
type deadline struct {
	at  time.Time
	rec *rec
	seq uint64
}

func (d deadline) current() bool { return d.rec.seq == d.seq }

type deadlineHeap []deadline

func (h deadlineHeap) Len() int { return len(h) }

// Less orders ties by transfer, destination and seq so that deadlines that
// fall due together fire in the same order on every run.
func (h deadlineHeap) Less(i, j int) bool {
	a, b := h[i], h[j]
	if !a.at.Equal(b.at) {
		return a.at.Before(b.at)
	}
	if a.rec.tr.push.TransferID != b.rec.tr.push.TransferID {
		return a.rec.tr.push.TransferID < b.rec.tr.push.TransferID
	}
	if a.rec.dest != b.rec.dest {
		return a.rec.dest < b.rec.dest
	}
	return a.seq < b.seq
}

func (h deadlineHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }

func (h *deadlineHeap) Push(x any) { *h = append(*h, x.(deadline)) }

func (h *deadlineHeap) Pop() any {
	old := *h
	d := old[len(old)-1]
	old[len(old)-1] = deadline{}
	*h = old[:len(old)-1]
	return d
}

var _ heap.Interface = (*deadlineHeap)(nil)

// secs renders a wait the way operators configure it ("60s", "0.5s").
func secs(d time.Duration) string {
	return strconv.FormatFloat(d.Seconds(), 'f', -1, 64) + "s"
}
