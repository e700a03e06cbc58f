package control

import (
	"testing"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

func newPub(t *testing.T, zctx *zmq.Context, host string, opts ...ServerOption) *EventPub {
	t.Helper()
	return opened[*EventPub](t)(NewEventPub(zctx, host, nil, opts...))
}

func newSub(t *testing.T, zctx *zmq.Context, opts ...ClientOption) *EventSub {
	t.Helper()
	return opened[*EventSub](t)(NewEventSub(zctx, nil, opts...))
}

// next returns the next event, failing the test if none comes within the
// harness bound: a message of one event, since each Send of these tests
// sends one.
func next(t *testing.T, sub *EventSub) wire.Event { t.Helper(); return nextOf(t, sub.Events()) }

func readyEvent(shard int, id string) wire.Event {
	return wire.Event{Shard: shard, TransferID: id, MMHash: "h-" + id, Ready: true, NBytes: 64}
}

func TestEventsFromTwoPublishersReachOneSubscriber(t *testing.T) {
	zctx := harness(t)
	pubs := []*EventPub{newPub(t, zctx, "127.0.0.1"), newPub(t, zctx, "localhost")}
	sub := newSub(t, zctx)

	const perPub = 50
	// Sent before anyone listens: they wait in the publishers' queues.
	for i, id := range names("t", perPub) {
		for shard, p := range pubs {
			if i%2 == 0 {
				p.Send(readyEvent(shard, id))
			} else {
				p.Send(wire.Event{Shard: shard, TransferID: id, MMHash: "h", Reason: "writer abandoned"})
			}
		}
	}
	for _, p := range pubs {
		require.NoError(t, sub.Connect(p.Endpoint()))
		require.NoError(t, sub.Connect(p.Endpoint()), "connecting twice is a no-op")
	}

	lastSeq := map[int]uint64{}
	for range 2 * perPub {
		ev := next(t, sub)
		require.Equal(t, wire.Version, ev.V)
		require.Equal(t, lastSeq[ev.Shard]+1, ev.Seq, "shard %d: in order, no gaps", ev.Shard)
		lastSeq[ev.Shard] = ev.Seq
		require.Equal(t, ev.Seq%2 == 1, ev.Ready)
	}
	require.Equal(t, map[int]uint64{0: perPub, 1: perPub}, lastSeq)
	require.Equal(t, SubStats{Received: 2 * perPub, Messages: 2 * perPub}, sub.Stats())
	for _, p := range pubs {
		require.Equal(t, PubStats{Sent: perPub, Messages: perPub}, p.Stats())
	}
}

func TestEventPubDropsWhenFullAndSeqShowsTheGap(t *testing.T) {
	zctx := harness(t)
	pub := newPub(t, zctx, "127.0.0.1")

	pub.Send(wire.Event{Shard: 0, MMHash: "h"}) // no transfer id: refused, seq 1 consumed
	const extra = 10
	total := EventQueue + extra
	for _, id := range names("t", total) {
		pub.Send(readyEvent(0, id))
	}
	st := pub.Stats()
	require.Equal(t, uint64(1), st.Invalid)
	// With nobody connected, the owner holds at most one frame beside the
	// full queue.
	require.GreaterOrEqual(t, st.Dropped, uint64(extra-1))
	require.LessOrEqual(t, st.Dropped, uint64(extra))

	sub := newSub(t, zctx)
	require.NoError(t, sub.Connect(pub.Endpoint()))
	queued := total - int(st.Dropped)
	for i := range queued {
		ev := next(t, sub)
		require.Equal(t, uint64(i+2), ev.Seq, "seq 1 went to the refused event")
	}
	pub.Send(readyEvent(0, "after"))
	ev := next(t, sub)
	require.Equal(t, uint64(total+2), ev.Seq, "the gap reveals the drops")
}

func TestEventSubDropsUndecodableFrames(t *testing.T) {
	zctx := harness(t)
	sub := newSub(t, zctx)

	raw, err := newSocket(zctx, zmq.PUSH)
	require.NoError(t, err)
	t.Cleanup(func() { raw.Close() })
	require.NoError(t, raw.Bind("tcp://127.0.0.1:*"))
	ep, err := raw.GetLastEndpoint()
	require.NoError(t, err)
	require.NoError(t, sub.Connect(ep))

	good, err := wire.EncodeEvents([]wire.Event{{V: wire.Version, Shard: 2, Seq: 1, TransferID: "t", MMHash: "h", Ready: true, NBytes: 1}})
	require.NoError(t, err)
	for _, frame := range []any{
		[]byte("garbage"),
		good[:len(good)-1],
		// An older build's JSON events, valid or not: refused as such.
		[]byte(`{"v":1,"shard":0,"seq":1,"transfer_id":"t","mm_hash":"h","ready":true,"nbytes":1}`),
		[]byte(`{"v":1,"shard":0,"seq":1,"transfer_id":"t","mm_hash":"h","ready":true}`),
	} {
		_, err := raw.SendMessage(frame)
		require.NoError(t, err)
	}
	_, err = raw.SendMessage([]byte("a"), []byte("b"))
	require.NoError(t, err)
	_, err = raw.SendBytes(good, 0)
	require.NoError(t, err)

	ev := next(t, sub)
	require.Equal(t, 2, ev.Shard)
	require.Equal(t, SubStats{Received: 1, Messages: 1, Bad: 5, Legacy: 2}, sub.Stats())
}

func TestEventSubLifecycle(t *testing.T) {
	zctx := harness(t)
	sub, err := NewEventSub(zctx, nil)
	require.NoError(t, err)
	require.ErrorIs(t, sub.Connect("tcp://127.0.0.1"), ErrBadEndpoint)
	require.NoError(t, sub.Close())
	_, open := <-sub.Events()
	require.False(t, open, "Close closes the events channel")
	require.ErrorIs(t, sub.Connect("tcp://127.0.0.1:5"), ErrClosed)
	require.NoError(t, sub.Close())

	_, err = NewEventPub(zctx, "", nil)
	require.ErrorIs(t, err, ErrBadEndpoint)
	pub, err := NewEventPub(zctx, "127.0.0.1", nil)
	require.NoError(t, err)
	require.NoError(t, pub.Close())
	pub.Send(readyEvent(0, "t")) // after Close: dropped, never blocks
	require.NoError(t, pub.Close())
}
