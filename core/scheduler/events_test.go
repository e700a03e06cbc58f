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
	pub, endpoint := eventsOnlyShard(t, ctl.Links("shard-0"), log)

	cfg := config.DefaultScheduler()
	cfg.Shards = []string{endpoint}
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

// A same-host shard's readiness reaches the table when the engine polls:
// Poll reads the event socket on the caller's goroutine and applies what
// is there, and Step polls first, so an event that has arrived is in the
// answer of the next Step without any other thread's wake. The events go
// to the table once each, whoever read them.
func TestPollAppliesArrivedEvents(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	secret := func() (string, error) { return "poll-test-secret-0123456789abcdef", nil }
	shardLinks, _, err := control.OpenLinks("shard", secret, false, nil, control.WithUnixPath(true))
	require.NoError(t, err)
	pub, endpoint := eventsOnlyShard(t, shardLinks, log)

	cfg := config.DefaultScheduler()
	cfg.Shards = []string{endpoint}
	cfg.Secret = config.Secret(must(secret()))
	s, err := Open(cfg, Options{Log: log})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })

	const rounds = 100
	polled := 0
	for i := range rounds {
		id, h := fmt.Sprintf("t%d", i), fmt.Sprintf("h%d", i)
		require.Empty(t, s.Step(StepIn{Expect: []ExpectIn{{RequestID: fmt.Sprintf("r%d", i), Items: []sched.Expected{{TransferID: id, MMHash: h}}}}}).ExpectErrors)
		pub.Send(wire.Event{Shard: 0, TransferID: id, MMHash: h, Ready: true, NBytes: 1 << 20})
		deadline := time.Now().Add(time.Minute)
		for !s.Has(h) && time.Now().Before(deadline) {
			polled += s.Poll()
		}
		require.True(t, s.Has(h), "round %d: the event arrived", i)
	}
	require.Positive(t, polled, "Poll applied none of %d events", rounds)
	st := s.Stats()
	require.EqualValues(t, rounds, st.Events.ReceivedUnix, "each event received once, over Unix")
	require.EqualValues(t, rounds, st.Table.EventSteps, "and applied once")
	t.Logf("%d of %d events applied by Poll", polled, rounds)
}

// eventsOnlyShard is a shard on links that publishes events and answers
// only event_port: a status resync fails, so every step of the table that
// applies events is a message's. It returns the publisher and the control
// endpoint; the links close with the test.
func eventsOnlyShard(t *testing.T, links control.Links, log *slog.Logger) (control.Publisher, string) {
	t.Helper()
	t.Cleanup(func() { _ = links.Close() })
	pub, err := links.Publish("127.0.0.1", log)
	require.NoError(t, err)
	srv, err := links.Serve("tcp://127.0.0.1:0", control.HandlerFunc(func(req wire.Request) wire.Reply {
		if req.Op != wire.OpEventPort {
			return wire.ErrReply(req.ID, wire.CodeUnknownOp, "not served here")
		}
		return wire.OKReply(req.ID, wire.EventPortReply{Endpoint: pub.Endpoint(), Epoch: "e1"})
	}), log)
	require.NoError(t, err)
	return pub, srv.Endpoint()
}

func must(v string, err error) string {
	if err != nil {
		panic(err)
	}
	return v
}
