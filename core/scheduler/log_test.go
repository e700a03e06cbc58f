package scheduler

import (
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/internal/logqueue/logqueuetest"
)

// The engine loop's step holds the caller's GIL (ecm_scheduler_step), so
// what it logs under the scheduler's lock (a refused request, a failure)
// must never wait on the log's writer: with the writer stuck, as on a
// stderr pipe that no one drains, steps still return, and Close writes
// what was logged.
func TestAStepNeverWaitsOnItsLogWriter(t *testing.T) {
	inner := logqueuetest.NewStuckHandler()
	cfg := config.DefaultScheduler()
	cfg.Shards = []string{"tcp://127.0.0.1:9"}
	s, err := Open(cfg, Options{Log: slog.New(inner)})
	require.NoError(t, err)

	items := []sched.Expected{{TransferID: "t1", MMHash: "h1"}}
	clash := []sched.Expected{{TransferID: "t1", MMHash: "h2"}}
	done := make(chan StepOut)
	go func() {
		s.Step(StepIn{Expect: []ExpectIn{{RequestID: "r1", Items: items}}})
		s.Step(StepIn{Expect: []ExpectIn{{RequestID: "r2", Items: clash}}})
		done <- s.Step(StepIn{Expect: []ExpectIn{{RequestID: "r3", Items: clash}}})
	}()
	select {
	case out := <-done:
		require.Contains(t, out.ExpectErrors, "r3")
	case <-time.After(30 * time.Second):
		t.Fatal("a step waited on the stuck log writer")
	}
	<-inner.Entered
	close(inner.Release)
	require.NoError(t, s.Close())
	require.Contains(t, inner.Written(), "request refused")
}
