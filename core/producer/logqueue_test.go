package producer

import (
	"context"
	"log/slog"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// stuckHandler records what it is asked to write; the first record waits
// until release closes, as a write to a full stderr pipe waits.
type stuckHandler struct {
	entered, release chan struct{}
	once             sync.Once

	mu   sync.Mutex
	msgs []string
}

func newStuckHandler() *stuckHandler {
	return &stuckHandler{entered: make(chan struct{}), release: make(chan struct{})}
}

func (h *stuckHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *stuckHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *stuckHandler) WithGroup(string) slog.Handler            { return h }

func (h *stuckHandler) Handle(_ context.Context, r slog.Record) error {
	h.once.Do(func() {
		close(h.entered)
		<-h.release
	})
	h.mu.Lock()
	h.msgs = append(h.msgs, r.Message)
	h.mu.Unlock()
	return nil
}

func (h *stuckHandler) written() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.msgs...)
}

// A log call never waits on a writer that is stuck: the records queue up
// to the bound, the rest are counted and dropped, and the count is
// written once the writer moves again. Close writes what was queued.
func TestLoggingUnderTheLockNeverWaitsOnTheWriter(t *testing.T) {
	inner := newStuckHandler()
	q := newLogQueue()
	log := slog.New(queuedHandler{inner, q})
	log.Warn("first")
	<-inner.entered // the writer holds "first" and waits
	const extra = 5
	for range logQueueLen + extra {
		log.Warn("queued") // returns although nothing is written
	}
	require.Equal(t, []string(nil), inner.written(), "nothing written while the writer is stuck")
	close(inner.release)
	q.close()
	got := inner.written()
	require.Len(t, got, 1+1+logQueueLen, "first, the dropped note, then every queued record")
	require.Equal(t, "first", got[0])
	require.Contains(t, got[1], "5 log records dropped")
	for _, m := range got[2:] {
		require.Equal(t, "queued", m)
	}

	log.Warn("after close")
	require.Equal(t, "after close", inner.written()[len(got)], "written by its caller once the queue is closed")
}

// A producer's own log goes through its queue: a log call returns while
// the writer is stuck (the test would hang otherwise), and Close writes
// what was queued before it returns.
func TestAProducersLogNeverWaitsOnItsWriter(t *testing.T) {
	inner := newStuckHandler()
	p, err := Open(config.DefaultProducer(), Options{
		Transport: transport.NewInmem(transport.NewInmemNetwork()), Log: slog.New(inner),
		Links: control.NewInmemNetwork().Links("producer"),
	})
	require.NoError(t, err)
	p.mu.Lock()
	p.failLocked(Failure{TransferID: "t", MMHash: "h", Reason: "a test"})
	p.failLocked(Failure{TransferID: "t2", MMHash: "h2", Reason: "a test"})
	p.mu.Unlock()
	<-inner.entered
	close(inner.release)
	require.NoError(t, p.Close())
	require.Equal(t, []string{"push failed", "push failed"}, inner.written())
}
