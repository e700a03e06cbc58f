package control

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// withoutTick takes away the owners' periodic wake-up for the rest of the
// test, so that work that is not woken when it arrives hangs (and fails at
// the harness bound) instead of being picked up by the tick. Call it
// before harness: its cleanup then runs once every owner is gone.
func withoutTick(t *testing.T) {
	t.Helper()
	saved := tickInterval
	tickInterval = time.Hour
	t.Cleanup(func() { tickInterval = saved })
}

// TestCallsPipelineAndMatchOutOfOrderReplies: a raw ROUTER reads every
// request before it answers any, then answers them in reverse order. Calls
// that waited for one another's replies would never complete; each call
// must get the reply to its own request.
func TestCallsPipelineAndMatchOutOfOrderReplies(t *testing.T) {
	withoutTick(t)
	zctx := harness(t)
	router, err := newSocket(zctx, zmq.ROUTER)
	require.NoError(t, err)
	require.NoError(t, router.SetRcvtimeo(settle))
	require.NoError(t, router.Bind("tcp://127.0.0.1:*"))
	ep, err := router.GetLastEndpoint()
	require.NoError(t, err)
	cli := dial(t, zctx, unmapped(ep))

	const calls = 32
	// Closed by the test once the replies are in: with linger 0, closing
	// right after sending would drop replies still queued.
	t.Cleanup(func() { router.Close() })
	served := make(chan error, 1)
	go func() {
		var reqs [][][]byte
		for range calls {
			m, err := router.RecvMessageBytes(0)
			if err != nil {
				served <- fmt.Errorf("request %d of %d not received: %w", len(reqs)+1, calls, err)
				return
			}
			reqs = append(reqs, m)
		}
		slices.Reverse(reqs)
		for _, m := range reqs {
			req, err := wire.DecodeRequest(m[1])
			if err != nil {
				served <- err
				return
			}
			body, err := wire.DecodeBody[wire.Status](req.Body)
			if err != nil {
				served <- err
				return
			}
			items := []wire.ItemStatus{{TransferID: body.TransferIDs[0], MMHash: "h", State: "READY", Known: true}}
			frame, err := wire.EncodeReply(wire.OKReply(req.ID, wire.StatusReply{Items: items}))
			if err != nil {
				served <- err
				return
			}
			if _, err := router.SendMessage(m[0], frame); err != nil {
				served <- err
				return
			}
		}
		served <- nil
	}()

	ctx, cancel := context.WithTimeout(context.Background(), settle)
	defer cancel()
	errs := make(chan error, calls)
	var wg sync.WaitGroup
	for i := range calls {
		wg.Go(func() {
			id := fmt.Sprintf("transfer-%d", i)
			var got wire.StatusReply
			if err := cli.Call(ctx, wire.OpStatus, wire.Status{TransferIDs: []string{id}}, &got); err != nil {
				errs <- err
				return
			}
			if len(got.Items) != 1 || got.Items[0].TransferID != id {
				errs <- fmt.Errorf("call for %s got %+v", id, got.Items)
			}
		})
	}
	wg.Wait()
	close(errs)
	require.NoError(t, <-served)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, ClientStats{RoundTrips: calls}, cli.Stats())
}

// TestEventsKeepTheirOrder: events of one publisher reach the reader in
// the order sent, seq counting up by one, also while another publisher's
// events are interleaved with them.
func TestEventsKeepTheirOrder(t *testing.T) {
	withoutTick(t)
	zctx := harness(t)
	pubs := []*EventPub{newPub(t, zctx, "127.0.0.1"), newPub(t, zctx, "127.0.0.1")}
	sub := newSub(t, zctx)
	for _, p := range pubs {
		require.NoError(t, sub.Connect(p.Endpoint()))
	}
	// One event each first, so that none is sent before its subscriber
	// is connected (a PUSH with no peer holds it, in order, but the test
	// wants the whole run in flight).
	for shard, p := range pubs {
		p.Send(readyEvent(shard, "hello"))
	}
	for range pubs {
		next(t, sub)
	}

	const n = 1000 // below EventQueue: nothing is dropped
	for i := range n {
		for shard, p := range pubs {
			p.Send(readyEvent(shard, fmt.Sprintf("t-%d", i)))
		}
	}
	seen := make([]int, len(pubs))
	for range n * len(pubs) {
		ev := next(t, sub)
		i := seen[ev.Shard]
		require.Equal(t, uint64(i+2), ev.Seq, "shard %d: seq", ev.Shard)
		require.Equal(t, fmt.Sprintf("t-%d", i), ev.TransferID, "shard %d: order", ev.Shard)
		seen[ev.Shard]++
	}
	for _, p := range pubs {
		require.Equal(t, PubStats{Sent: n + 1, Messages: n + 1}, p.Stats())
	}
}

// TestNoWorkWaitsForTheTick runs, with the periodic wake-up taken away,
// every path on which an owner must be woken by what happens rather than
// find it on its next tick: a call queued, a reply arriving, a connection
// completing under a frame that waited for it, a subscriber connecting to
// a publisher that holds an event, and events arriving. A wake-up lost
// anywhere hangs the test until the harness bound.
func TestNoWorkWaitsForTheTick(t *testing.T) {
	withoutTick(t)
	zctx := harness(t)
	ctx, cancel := context.WithTimeout(context.Background(), settle)
	defer cancel()

	// The client and its first call come before the server.
	port := freePort(t)
	cli := dial(t, zctx, Endpoint("127.0.0.1", port))
	early := make(chan error, 1)
	go func() { early <- cli.Call(ctx, wire.OpStatus, wire.Status{TransferIDs: []string{"early"}}, nil) }()
	require.Eventually(t, cli.waitingAny, settle, time.Millisecond, "the early call is waiting")
	startServer(t, zctx, Endpoint("127.0.0.1", port), HandlerFunc(statusEcho))
	require.NoError(t, <-early)
	for i := range 200 {
		require.NoError(t, cli.Call(ctx, wire.OpStatus, wire.Status{TransferIDs: []string{fmt.Sprint(i)}}, nil))
	}

	// The publisher holds an event until its subscriber comes.
	pub := newPub(t, zctx, "127.0.0.1")
	pub.Send(readyEvent(0, "held"))
	sub := newSub(t, zctx)
	require.NoError(t, sub.Connect(pub.Endpoint()))
	require.Equal(t, "held", next(t, sub).TransferID)
	for i := range 200 {
		pub.Send(readyEvent(0, fmt.Sprint(i)))
		require.Equal(t, fmt.Sprint(i), next(t, sub).TransferID)
	}
}
