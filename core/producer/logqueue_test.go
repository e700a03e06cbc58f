package producer

import (
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/internal/logqueue/logqueuetest"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// A producer's own log goes through its queue: a log call returns while
// the writer is stuck (the test would hang otherwise), and Close writes
// what was queued before it returns.
func TestAProducersLogNeverWaitsOnItsWriter(t *testing.T) {
	inner := logqueuetest.NewStuckHandler()
	p, err := Open(config.DefaultProducer(), Options{
		Transport: transport.NewInmem(transport.NewInmemNetwork()), Log: slog.New(inner),
		Links: control.NewInmemNetwork().Links("producer"),
	})
	require.NoError(t, err)
	p.mu.Lock()
	p.failLocked(Failure{TransferID: "t", MMHash: "h", Reason: "a test"})
	p.failLocked(Failure{TransferID: "t2", MMHash: "h2", Reason: "a test"})
	p.mu.Unlock()
	<-inner.Entered
	close(inner.Release)
	require.NoError(t, p.Close())
	require.Equal(t, []string{"push failed", "push failed"}, inner.Written())
}
