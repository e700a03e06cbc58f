package producer

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// logQueueLen bounds the log records waiting for their writer; records
// past it are counted and dropped, never waited for.
const logQueueLen = 1024

// logQueue hands the producer's log records to a goroutine of its own,
// which writes them. The producer logs under its lock (a failed push, a
// refused source), and its lock is taken by the encoder's per-batch calls,
// which hold the caller's GIL: a log write that waits on a full stderr
// pipe must not hold up either. So a record is queued, never written,
// under the lock; when the writer falls behind by logQueueLen records,
// the rest are dropped and counted, and the count is logged once it
// catches up. Close writes what is queued before it returns.
type logQueue struct {
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

func newLogQueue() *logQueue {
	q := &logQueue{ch: make(chan queuedRecord, logQueueLen), done: make(chan struct{})}
	go q.run()
	return q
}

func (q *logQueue) run() {
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
func (q *logQueue) noteDropped(h slog.Handler) {
	if n := q.dropped.Swap(0); n > 0 {
		note := slog.NewRecord(time.Now(), slog.LevelWarn, fmt.Sprintf("producer: %d log records dropped: the log's writer fell %d behind", n, logQueueLen), 0)
		_ = h.Handle(context.Background(), note)
	}
}

// put queues r for h, or drops it when the queue is full. After close it
// writes r itself: nothing holds the producer's lock by then.
func (q *logQueue) put(h slog.Handler, r slog.Record) error {
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

// close writes every queued record, then returns; later records are
// written by their caller.
func (q *logQueue) close() {
	q.mu.Lock()
	if !q.closed {
		q.closed = true
		close(q.ch)
	}
	q.mu.Unlock()
	<-q.done
}

// queuedHandler is a slog.Handler that queues its records on a logQueue
// for inner.
type queuedHandler struct {
	inner slog.Handler
	q     *logQueue
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
