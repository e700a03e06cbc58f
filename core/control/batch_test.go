package control

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// eventLinks are the publisher–subscriber pairs of every Links: the
// in-memory fake, ZeroMQ, and the Unix path (a same-host subscriber).
func eventLinks(t *testing.T) map[string]func() (Publisher, Subscriber) {
	return map[string]func() (Publisher, Subscriber){
		"inmem": func() (Publisher, Subscriber) {
			n := NewInmemNetwork()
			return publishOn(t, n.Links("shard")), subscribeOn(t, n.Links("scheduler"))
		},
		"zmq": func() (Publisher, Subscriber) {
			z, err := NewZMQ(Security{})
			require.NoError(t, err)
			t.Cleanup(func() { _ = z.Close() })
			return publishOn(t, z), subscribeOn(t, z)
		},
		"unix": func() (Publisher, Subscriber) {
			shard, sched := unixLinks(t, secretA, defaultUnixOptions()), unixLinks(t, secretA, defaultUnixOptions())
			return publishOn(t, shard), subscribeOn(t, sched)
		},
	}
}

// One Send is one message on every path: a flush of 8 is 8 events in
// one message; a flush past wire.MaxEventRecords is cut into messages of
// at most that many; an invalid event spends its seq and splits the run,
// so that seqs within a message still rise by one.
func TestSendIsOneEventMessage(t *testing.T) {
	for name, open := range eventLinks(t) {
		t.Run(name, func(t *testing.T) {
			pub, sub := open()
			require.NoError(t, sub.Connect(pub.Endpoint()))

			batch := make([]wire.Event, 8)
			for i := range batch {
				batch[i] = readyEvent(0, fmt.Sprintf("b%d", i))
			}
			pub.Send(batch...)
			msg := nextMessage(t, sub)
			require.Len(t, msg, 8)
			for i, ev := range msg {
				require.Equal(t, batch[i].TransferID, ev.TransferID, "in order")
				require.EqualValues(t, 1+i, ev.Seq)
				require.Equal(t, msg[0].SentNS, ev.SentNS, "one send time per message")
			}

			const big, bad = 2500, 700
			flush := make([]wire.Event, big)
			for i := range flush {
				flush[i] = readyEvent(0, fmt.Sprintf("f%d", i))
			}
			flush[bad].TransferID = "" // refused: its seq is spent
			pub.Send(flush...)
			var sizes []int
			seq := uint64(len(batch))
			for got := 0; got < big-1; {
				m := nextMessage(t, sub)
				sizes = append(sizes, len(m))
				for _, ev := range m {
					seq++
					if seq == uint64(len(batch)+1+bad) {
						seq++ // the refused event's
					}
					require.Equal(t, seq, ev.Seq)
				}
				got += len(m)
			}
			require.Equal(t, []int{bad, wire.MaxEventRecords, big - 1 - bad - wire.MaxEventRecords}, sizes)
			require.Eventually(t, func() bool { return pub.Stats().Sent == uint64(len(batch)+big-1) }, settle, time.Millisecond)
			st := pub.Stats()
			require.EqualValues(t, 4, st.Messages)
			require.EqualValues(t, 1, st.Invalid)
			require.Zero(t, st.Dropped)
			sst := sub.Stats()
			require.EqualValues(t, len(batch)+big-1, sst.Received)
			require.EqualValues(t, 4, sst.Messages)
			if name == "unix" { // the one subscriber that counts gaps
				require.EqualValues(t, 1, sst.Gaps, "the refused event's seq is a gap, which the resync covers")
			}
		})
	}
}

// nextMessage returns the next message of sub within the harness bound.
func nextMessage(t *testing.T, sub Subscriber) []wire.Event {
	t.Helper()
	select {
	case evs, ok := <-sub.Events():
		require.True(t, ok, "events channel closed")
		return evs
	case <-time.After(settle):
		t.Fatal("no event message")
		return nil
	}
}

// A publisher's queue is bounded in events, not messages: batches of 8
// sent while nobody reads fill it to EventQueue events, and the rest is
// dropped and counted (one message may wait outside the queue, taken by
// the socket's owner). What was kept arrives, in order, and nothing else.
func TestEventQueueIsBoundedInEvents(t *testing.T) {
	const batch, over = 8, 10
	for name, open := range eventLinks(t) {
		t.Run(name, func(t *testing.T) {
			pub, sub := open()
			total := 0
			for i := range EventQueue/batch + over {
				evs := make([]wire.Event, batch)
				for j := range evs {
					evs[j] = readyEvent(0, fmt.Sprintf("t%d-%d", i, j))
				}
				pub.Send(evs...)
				total += batch
			}
			dropped := int(pub.Stats().Dropped)
			if name != "unix" { // the Unix backlog keeps the latest and counts no drop while ZeroMQ has them
				require.GreaterOrEqual(t, dropped, over*batch-batch, "the queue holds at most EventQueue events")
				require.LessOrEqual(t, dropped, over*batch)
			}
			require.NoError(t, sub.Connect(pub.Endpoint()))
			// Drops are counted as they happen, so what is kept is known:
			// all but the dropped, or on Unix the backlog's latest
			// EventQueue events.
			want := total - dropped
			if name == "unix" {
				want = EventQueue
			}
			got := 0
			var last uint64
			for got < want {
				for _, ev := range nextMessage(t, sub) {
					require.Greater(t, ev.Seq, last, "in order")
					last = ev.Seq
					got++
				}
			}
			require.Equal(t, want, got)
			require.LessOrEqual(t, got, EventQueue+batch, "never more than the bound (and one message)")
			pub.Send(readyEvent(0, "after"))
			next := nextMessage(t, sub)
			require.Equal(t, "after", next[0].TransferID, "nothing beyond what was kept")
		})
	}
}
