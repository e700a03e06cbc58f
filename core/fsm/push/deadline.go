package push

import (
	"time"

	"github.com/ecmooncake/ecmooncake/core/internal/deadlines"
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

// Before orders ties by transfer, destination and seq so that deadlines
// that fall due together fire in the same order on every run.
func (a deadline) Before(b deadline) bool {
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

type deadlineHeap = deadlines.Heap[deadline]
