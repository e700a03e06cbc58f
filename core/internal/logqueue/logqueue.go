package logqueue

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// Len bounds the log records waiting for their writer; records past it
// are counted and dropped, never waited for.
const Len = 1024

// Queue hands an object's log records to a goroutine of its own, which
// writes them. The producer and the PD's scheduler log under locks that
// calls holding the caller's GIL take (the encoder's per-batch calls, the
// engine loop's scheduler step): a log write that waits on a full stderr
// pipe must hold up neither. So a record is queued, never written, by
// the logging call; when the writer falls behind by Len records, the rest
// are dropped and counted, and the count is logged once it catches up.
// Close writes what is queued before it returns.
type Queue struct {
	name    string // of the owner, in the note of dropped records
	ch      chan queuedRecord
	dropped atomic.Uint64
	done    chan struct{}

	mu     sync.RWMutex // closed, against a send racing close(ch)
	closed bool
}

type queuedRecord struct {
	h slog.Handler
	r slog.Record
}

// New starts the writer of a queue for the records of owner (named in
// the note of dropped records).
func New(owner string) *Queue {
	q := &Queue{name: owner, ch: make(chan queuedRecord, Len), done: make(chan struct{})}
	go q.run()
	return q
}

// Handler returns a handler that queues its records here for inner.
func (q *Queue) Handler(inner slog.Handler) slog.Handler { return queuedHandler{inner, q} }

func (q *Queue) run() {
	defer close(q.done)
	var last slog.Handler
	for it := range q.ch {
		q.noteDropped(it.h)
		_ = it.h.Handle(context.Background(), it.r)
		last = it.h
	}
	if last != nil {
		q.noteDropped(last)
	}
}

// noteDropped logs how many records were dropped since it last did.
func (q *Queue) noteDropped(h slog.Handler) {
	if n := q.dropped.Swap(0); n > 0 {
		note := slog.NewRecord(time.Now(), slog.LevelWarn, fmt.Sprintf("%s: %d log records dropped: the log's writer fell %d behind", q.name, n, Len), 0)
		_ = h.Handle(context.Background(), note)
	}
}

// put queues r for h, or drops it when the queue is full. After Close it
// writes r itself: nothing holds the owner's lock by then.
func (q *Queue) put(h slog.Handler, r slog.Record) error {
	q.mu.RLock()
	if q.closed {
		q.mu.RUnlock()
		return h.Handle(context.Background(), r)
	}
	select {
	case q.ch <- queuedRecord{h, r.Clone()}:
	default:
		q.dropped.Add(1)
	}
	q.mu.RUnlock()
	return nil
}

// Close writes every queued record, then returns; later records are
// written by their caller.
func (q *Queue) Close() {
	q.mu.Lock()
	if !q.closed {
		q.closed = true
		close(q.ch)
	}
	q.mu.Unlock()
	<-q.done
}

// queuedHandler is a slog.Handler that queues its records on a Queue
// for inner.
type queuedHandler struct {
	inner slog.Handler
	q     *Queue
}

var _ slog.Handler = queuedHandler{}

func (h queuedHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.inner.Enabled(ctx, l)
}

func (h queuedHandler) Handle(_ context.Context, r slog.Record) error { return h.q.put(h.inner, r) }

func (h queuedHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return queuedHandler{h.inner.WithAttrs(as), h.q}
}

func (h queuedHandler) WithGroup(name string) slog.Handler {
	return queuedHandler{h.inner.WithGroup(name), h.q}
}
