package control

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// echoEvents answers event_port with its own name, and refuses status.
func echoEvents(name string) Handler {
	return HandlerFunc(func(req wire.Request) wire.Reply {
		if req.Op == wire.OpStatus {
			return wire.ErrReply(req.ID, wire.CodeBadRequest, "no status here")
		}
		return wire.OKReply(req.ID, wire.EventPortReply{Endpoint: "tcp://127.0.0.1:1", Epoch: name})
	})
}

// inmemCall is a network with a server linked "shard" and a caller of it
// linked "producer".
func inmemCall(t *testing.T) (*InmemNetwork, Caller, func(time.Duration) error) {
	t.Helper()
	before := runtime.NumGoroutine()
	n := NewInmemNetwork()
	shard, prod := n.Links("shard"), n.Links("producer")
	srv, err := shard.Serve("tcp://127.0.0.1:5000", echoEvents("e1"), slog.Default())
	require.NoError(t, err)
	require.Equal(t, "tcp://127.0.0.1:5000", srv.Endpoint())
	c, err := prod.Dial(srv.Endpoint(), slog.Default())
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, prod.Close())
		require.NoError(t, shard.Close())
		requireGoroutinesBack(t, before)
	})
	call := func(within time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), within)
		defer cancel()
		var rep wire.EventPortReply
		if err := c.Call(ctx, wire.OpEventPort, struct{}{}, &rep); err != nil {
			return err
		}
		if rep.Epoch != "e1" {
			return fmt.Errorf("reply %+v", rep)
		}
		return nil
	}
	return n, c, call
}

func TestInmemCallsFollowTheLink(t *testing.T) {
	n, c, call := inmemCall(t)
	require.NoError(t, call(time.Minute))

	var werr *wire.Error
	err := c.Call(context.Background(), wire.OpStatus, wire.Status{TransferIDs: []string{"t"}}, nil)
	require.ErrorAs(t, err, &werr, "a refusal crosses as a *wire.Error")
	require.Equal(t, wire.CodeBadRequest, werr.Code)

	n.Partition("shard", "producer")
	require.ErrorIs(t, call(50*time.Millisecond), context.DeadlineExceeded, "a cut link loses the request")
	n.Heal("producer", "shard")
	require.NoError(t, call(time.Minute), "either order of names heals")

	n.SetDelay("shard", "producer", time.Hour)
	require.ErrorIs(t, call(50*time.Millisecond), context.DeadlineExceeded, "a delay longer than the deadline")
	n.HealAll()
	require.NoError(t, call(time.Minute))

	require.NoError(t, c.Close())
	require.ErrorIs(t, call(time.Minute), ErrClosed)
}

func TestInmemCallToNobodyWaitsForItsDeadline(t *testing.T) {
	n := NewInmemNetwork()
	l := n.Links("producer")
	defer l.Close()
	c, err := l.Dial("tcp://127.0.0.1:1", slog.Default())
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, c.Call(ctx, wire.OpPeers, struct{}{}, nil), context.DeadlineExceeded)

	_, err = l.Dial("not an endpoint", slog.Default())
	require.Error(t, err)
}

func TestInmemServerBindsOnce(t *testing.T) {
	n := NewInmemNetwork()
	a, b := n.Links("a"), n.Links("b")
	defer a.Close()
	defer b.Close()
	s, err := a.Serve("tcp://127.0.0.1:5000", echoEvents("x"), slog.Default())
	require.NoError(t, err)
	_, err = b.Serve("tcp://127.0.0.1:5000", echoEvents("y"), slog.Default())
	require.ErrorContains(t, err, "address in use")
	any, err := b.Serve("tcp://127.0.0.1:0", echoEvents("y"), slog.Default())
	require.NoError(t, err)
	require.NotEqual(t, "tcp://127.0.0.1:0", any.Endpoint(), "port 0 gets a port of its own")
	require.NoError(t, s.Close())
	_, err = b.Serve("tcp://127.0.0.1:5000", echoEvents("y"), slog.Default())
	require.NoError(t, err, "a closed server frees its endpoint")
}

// collect reads n events or fails after within (a bound on waiting).
func collect(t *testing.T, sub Subscriber, n int, within time.Duration) []wire.Event {
	t.Helper()
	var got []wire.Event
	deadline := time.After(within)
	for len(got) < n {
		select {
		case evs := <-sub.Events():
			got = append(got, evs...)
		case <-deadline:
			t.Fatalf("got %d of %d events", len(got), n)
		}
	}
	return got
}

func event(i int) wire.Event {
	return wire.Event{Shard: 0, TransferID: fmt.Sprintf("t%d", i), MMHash: fmt.Sprintf("h%d", i), Ready: true, NBytes: 1}
}

// inmemEvents is a publisher on the links of "shard" and a subscriber on
// those of "scheduler", not yet connected; the test closes the links.
func inmemEvents(t *testing.T) (*InmemNetwork, *InmemLinks, *InmemLinks, Publisher, Subscriber) {
	t.Helper()
	n := NewInmemNetwork()
	shard, sched := n.Links("shard"), n.Links("scheduler")
	pub, err := shard.Publish("127.0.0.1", slog.Default())
	require.NoError(t, err)
	sub, err := sched.Subscribe(slog.Default())
	require.NoError(t, err)
	return n, shard, sched, pub, sub
}

func TestInmemEventsKeepOrderAndDropOverACutLink(t *testing.T) {
	before := runtime.NumGoroutine()
	n, shard, sched, pub, sub := inmemEvents(t)

	// Sent before anybody subscribed: held for the first subscriber.
	pub.Send(event(1))
	n.SetDelay("shard", "scheduler", time.Millisecond)
	require.NoError(t, sub.Connect(pub.Endpoint()))
	require.NoError(t, sub.Connect(pub.Endpoint()), "connecting twice is a no-op")
	for i := 2; i <= 5; i++ {
		pub.Send(event(i))
	}
	got := collect(t, sub, 5, time.Minute)
	for i, ev := range got {
		require.Equal(t, fmt.Sprintf("t%d", i+1), ev.TransferID, "in order")
		require.Equal(t, uint64(i+1), ev.Seq)
	}

	n.Partition("scheduler", "shard")
	pub.Send(event(6))
	require.Eventually(t, func() bool { return pub.Stats().Dropped == 1 }, time.Minute, time.Millisecond)
	n.HealAll()
	pub.Send(event(7))
	got = collect(t, sub, 1, time.Minute)
	require.Equal(t, "t7", got[0].TransferID)
	require.Equal(t, uint64(7), got[0].Seq, "the gap in seq tells of the drop")
	require.Equal(t, SubStats{Received: 6, Messages: 6}, sub.Stats())

	pub.Send(wire.Event{}) // invalid: no transfer id
	require.Equal(t, uint64(1), pub.Stats().Invalid)

	require.NoError(t, sched.Close())
	_, open := <-sub.Events()
	require.False(t, open, "Close closes Events")
	require.Error(t, sub.Connect(pub.Endpoint()))
	require.NoError(t, shard.Close())
	requireGoroutinesBack(t, before)
}

// A subscriber that does not read holds its publisher back, and closing
// either end releases it.
func TestInmemSlowReaderDoesNotWedgeClose(t *testing.T) {
	before := runtime.NumGoroutine()
	_, shard, sched, pub, sub := inmemEvents(t)
	require.NoError(t, sub.Connect(pub.Endpoint()))
	for i := range EventQueue + 10 {
		pub.Send(event(i + 1))
	}
	// The queue is full and one more event waits to be handed over.
	require.Eventually(t, func() bool { return sub.Stats().Received == EventQueue+1 }, time.Minute, time.Millisecond)
	done := make(chan error, 2)
	go func() { done <- sched.Close() }()
	go func() { done <- shard.Close() }()
	for range 2 {
		requireWithin(t, done, "close hung behind a reader that does not read")
	}
	requireGoroutinesBack(t, before)
}

func TestInmemClosedLinksRefuseNewOnes(t *testing.T) {
	l := NewInmemNetwork().Links("x")
	require.NoError(t, l.Close())
	_, err := l.Dial("tcp://127.0.0.1:1", slog.Default())
	require.True(t, errors.Is(err, ErrClosed), err)
	_, err = l.Serve("tcp://127.0.0.1:1", echoEvents("x"), slog.Default())
	require.ErrorIs(t, err, ErrClosed)
}
