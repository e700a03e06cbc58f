package scheduler

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// A shard's message of 8 readiness events reaches the table as one
// batch: one lock, one step of the table, every item available.
func TestEventMessageIsAppliedInOneStep(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctl := control.NewInmemNetwork()
	shard := ctl.Links("shard-0")
	t.Cleanup(func() { _ = shard.Close() })
	pub, err := shard.Publish("127.0.0.1", log)
	require.NoError(t, err)
	// The shard answers only event_port: a status resync fails, so every
	// step of the table that applies events is the message's.
	srv, err := shard.Serve("tcp://127.0.0.1:0", control.HandlerFunc(func(req wire.Request) wire.Reply {
		if req.Op != wire.OpEventPort {
			return wire.ErrReply(req.ID, wire.CodeUnknownOp, "not served here")
		}
		return wire.OKReply(req.ID, wire.EventPortReply{Endpoint: pub.Endpoint(), Epoch: "e1"})
	}), log)
	require.NoError(t, err)

	cfg := config.DefaultScheduler()
	cfg.Shards = []string{srv.Endpoint()}
	s, err := Open(cfg, Options{Log: log, Links: ctl.Links("scheduler")})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })

	var items []sched.Expected
	var evs []wire.Event
	var ids []string
	for i := range 8 {
		id, h := fmt.Sprintf("t%d", i), fmt.Sprintf("h%d", i)
		items = append(items, sched.Expected{TransferID: id, MMHash: h})
		evs = append(evs, wire.Event{Shard: 0, TransferID: id, MMHash: h, Ready: true, NBytes: 4 << 20})
		ids = append(ids, id)
	}
	require.Empty(t, s.Step(StepIn{Expect: []ExpectIn{{RequestID: "r1", Items: items}}}).ExpectErrors)
	pub.Send(evs...)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out := s.Wait(ctx, ids)
	require.ElementsMatch(t, ids, out.Available)
	st := s.Stats()
	require.EqualValues(t, 8, st.Events.Received)
	require.EqualValues(t, 1, st.Events.Messages)
	require.EqualValues(t, 1, st.Table.EventSteps, "8 events, one step")
	require.True(t, s.Step(StepIn{Ensure: []string{"r1"}}).Ensure["r1"].Ready)
}
