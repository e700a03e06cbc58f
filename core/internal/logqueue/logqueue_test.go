package logqueue

import (
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/internal/logqueue/logqueuetest"
)

// A log call never waits on a writer that is stuck: the records queue up
// to the bound, the rest are counted and dropped, and the count is
// written once the writer moves again. Close writes what was queued.
func TestLoggingUnderTheLockNeverWaitsOnTheWriter(t *testing.T) {
	inner := logqueuetest.NewStuckHandler()
	q := New("owner")
	log := slog.New(q.Handler(inner))
	log.Warn("first")
	<-inner.Entered // the writer holds "first" and waits
	const extra = 5
	for range Len + extra {
		log.Warn("queued") // returns although nothing is written
	}
	require.Equal(t, []string(nil), inner.Written(), "nothing written while the writer is stuck")
	close(inner.Release)
	q.Close()
	got := inner.Written()
	require.Len(t, got, 1+1+Len, "first, the dropped note, then every queued record")
	require.Equal(t, "first", got[0])
	require.Contains(t, got[1], "5 log records dropped")
	for _, m := range got[2:] {
		require.Equal(t, "queued", m)
	}

	log.Warn("after close")
	require.Equal(t, "after close", inner.Written()[len(got)], "written by its caller once the queue is closed")
}
