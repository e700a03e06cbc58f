package control

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// eventName is an abstract name of this test and process.
func eventName(t *testing.T) string {
	return fmt.Sprintf("@ecmooncake/test/%d/%s", os.Getpid(), t.Name())
}

// nextOf returns the event of the next message of ch within the harness
// bound; the message must hold one event, as each Send of these tests
// sends one.
func nextOf(t *testing.T, ch <-chan []wire.Event) wire.Event {
	t.Helper()
	select {
	case evs, ok := <-ch:
		require.True(t, ok, "events channel closed")
		require.Len(t, evs, 1, "one Send of one event is one message")
		return evs[0]
	case <-time.After(settle):
		t.Fatal("no event")
		return wire.Event{}
	}
}

func publishOn(t *testing.T, l Links) Publisher {
	t.Helper()
	p, err := l.Publish("127.0.0.1", nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func subscribeOn(t *testing.T, l Links) Subscriber {
	t.Helper()
	s, err := l.Subscribe(nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// TestUnixEventsSameHost: a same-host subscriber reads its shard's events
// over the Unix path, in order and with seq rising by one, the events sent
// before it came first; nothing goes over ZeroMQ.
func TestUnixEventsSameHost(t *testing.T) {
	for _, secret := range []string{"", secretA} {
		t.Run(fmt.Sprintf("secret=%v", secret != ""), func(t *testing.T) {
			shard, sched := unixLinks(t, secret, defaultUnixOptions()), unixLinks(t, secret, defaultUnixOptions())
			pub := publishOn(t, shard)
			require.IsType(t, &UnixEventPub{}, pub)
			sub := subscribeOn(t, sched)

			const before, after = 5, 200
			for i := range before {
				pub.Send(readyEvent(1, fmt.Sprintf("early-%d", i)))
			}
			require.NoError(t, sub.Connect(pub.Endpoint()))
			require.NoError(t, sub.Connect(pub.Endpoint()), "connecting twice is a no-op")
			for i := range after {
				pub.Send(readyEvent(1, fmt.Sprintf("late-%d", i)))
			}
			for i := range before + after {
				ev := nextOf(t, sub.Events())
				require.EqualValues(t, i+1, ev.Seq)
				want := fmt.Sprintf("early-%d", i)
				if i >= before {
					want = fmt.Sprintf("late-%d", i-before)
				}
				require.Equal(t, want, ev.TransferID)
			}
			// The publisher counts a write once it returned, which may be
			// after the subscriber has read its events.
			require.Eventually(t, func() bool { return pub.Stats().SentUnix >= before+after }, settle, time.Millisecond)
			ps, ss := pub.Stats(), sub.Stats()
			require.EqualValues(t, before+after, ps.SentUnix)
			require.EqualValues(t, before+after, ps.Sent, "nothing but the Unix path's")
			require.Zero(t, ps.Dropped)
			require.EqualValues(t, before+after, ss.ReceivedUnix)
			require.EqualValues(t, before+after, ss.Received)
			require.Zero(t, ss.Gaps)
			require.Empty(t, sched.Fallbacks())
		})
	}
}

// TestUnixEventsRefusedFallBackToZMQ: a subscriber the Unix path refuses
// follows over ZeroMQ, counted by cause on its side and by reason on the
// publisher's, and still gets every event.
func TestUnixEventsRefusedFallBackToZMQ(t *testing.T) {
	refuseAll := defaultUnixOptions()
	refuseAll.allowed = func(uint32) bool { return false }
	shard, sched := unixLinks(t, secretA, refuseAll), unixLinks(t, secretA, defaultUnixOptions())
	pub := publishOn(t, shard)
	sub := subscribeOn(t, sched)
	require.NoError(t, sub.Connect(pub.Endpoint()))
	for i := range 20 {
		pub.Send(readyEvent(0, fmt.Sprintf("t-%d", i)))
	}
	for i := range 20 {
		require.EqualValues(t, i+1, nextOf(t, sub.Events()).Seq)
	}
	require.EqualValues(t, 1, sched.Fallbacks()["events_auth"])
	require.EqualValues(t, 1, pub.Stats().Refused["unix_uid"])
	require.Zero(t, sub.Stats().ReceivedUnix)
	require.NoError(t, sub.Connect(pub.Endpoint()), "stays on ZeroMQ")
	require.EqualValues(t, 1, sched.Fallbacks()["events_auth"])
}

// TestUnixEventsWrongSecret: another deployment's secret is refused on the
// Unix path as CURVE refuses it, and nothing is delivered.
func TestUnixEventsWrongSecret(t *testing.T) {
	shard, sched := unixLinks(t, secretA, defaultUnixOptions()), unixLinks(t, secretB, defaultUnixOptions())
	pub := publishOn(t, shard)
	sub := subscribeOn(t, sched)
	require.NoError(t, sub.Connect(pub.Endpoint()))
	require.EqualValues(t, 1, sched.Fallbacks()["events_auth"])
	// The publisher counts its refusal after it answered it, so possibly
	// after Connect returned; the subscriber's ZeroMQ fallback is refused
	// too (CURVE), and counted under the same reason, so at least one.
	require.Eventually(t, func() bool { return pub.Stats().Refused["auth_wrong_secret"] >= 1 }, settle, time.Millisecond)
	pub.Send(readyEvent(0, "secret"))
	select {
	case ev := <-sub.Events():
		t.Fatalf("an event reached a subscriber of another secret: %+v", ev)
	case <-time.After(50 * time.Millisecond):
	}
}

// TestUnixEventsReconnectAfterRestart: a publisher that goes and comes
// back on the same name is redialled; its new incarnation's seq starts
// again without counting a gap, and what it sent before the redial is
// read first.
func TestUnixEventsReconnectAfterRestart(t *testing.T) {
	name := eventName(t)
	pub1, err := listenUnixEvents(name, nil, Security{}, nil, defaultUnixOptions())
	require.NoError(t, err)
	sub := newUnixEventSub(nil, Security{}, nil, defaultUnixOptions(), nil)
	defer sub.Close()
	require.NoError(t, sub.Connect(name))
	for i := range 3 {
		pub1.Send(readyEvent(0, fmt.Sprintf("old-%d", i)))
	}
	for i := range 3 {
		require.EqualValues(t, i+1, nextOf(t, sub.Events()).Seq)
	}
	require.NoError(t, pub1.Close())

	pub2, err := listenUnixEvents(name, nil, Security{}, nil, defaultUnixOptions())
	require.NoError(t, err)
	defer pub2.Close()
	pub2.Send(readyEvent(0, "new-0"))
	pub2.Send(readyEvent(0, "new-1"))
	for i := range 2 {
		ev := nextOf(t, sub.Events())
		require.EqualValues(t, i+1, ev.Seq)
		require.Equal(t, fmt.Sprintf("new-%d", i), ev.TransferID)
	}
	require.EqualValues(t, 1, sub.Stats().Redials)
	require.Zero(t, sub.Stats().Gaps)
}

// TestUnixEventsSlowSubscriber: a subscriber that falls behind costs the
// publisher a bounded queue: the events beyond it are dropped and counted,
// the subscriber counts the same events as the gap in seq (which the
// scheduler's status resync covers), and the connection survives.
func TestUnixEventsSlowSubscriber(t *testing.T) {
	name := eventName(t)
	opt := defaultUnixOptions()
	opt.eventQueue = 8
	opt.writeTimeout = time.Minute // this test is about the queue, not the deadline
	pub, err := listenUnixEvents(name, nil, Security{}, nil, opt)
	require.NoError(t, err)
	defer pub.Close()
	sub := newUnixEventSub(nil, Security{}, nil, opt, nil)
	defer sub.Close()
	require.NoError(t, sub.Connect(name))
	require.Eventually(t, func() bool { return subscribers(pub) == 1 }, settle, time.Millisecond)

	// Nobody reads Events: the subscriber's channel, the socket's buffers
	// and then the publisher's queue fill.
	sent := 0
	for pub.Stats().Dropped == 0 {
		pub.Send(readyEvent(0, fmt.Sprintf("t-%d", sent)))
		sent++
		require.Less(t, sent, 1<<20, "a queue of 8 never filled")
		if sent%1024 == 0 {
			runtime.Gosched()
		}
	}
	for range 100 {
		pub.Send(readyEvent(0, fmt.Sprintf("t-%d", sent)))
		sent++
	}
	require.LessOrEqual(t, queued(pub), opt.eventQueue, "the queue is bounded")

	// Read every event that was not dropped (drops are counted as they are
	// sent, so the count is final); then one more event, sent with the
	// queue empty, must come next: nothing beyond the count was queued.
	want := uint64(sent) - pub.Stats().Dropped
	var last uint64
	got := 0
	for uint64(got) < want {
		ev := nextOf(t, sub.Events())
		require.Greater(t, ev.Seq, last, "seq rises")
		last = ev.Seq
		got++
	}
	pub.Send(readyEvent(0, "final"))
	ev := nextOf(t, sub.Events())
	require.Equal(t, "final", ev.TransferID)
	require.EqualValues(t, sent+1, ev.Seq)
	got++
	require.Equal(t, pub.Stats().Dropped, sub.Stats().Gaps, "the subscriber sees the drops as its gap")
	require.EqualValues(t, sent+1, uint64(got)+sub.Stats().Gaps)
	require.Zero(t, pub.Stats().WriteFailures)
	require.Equal(t, 1, subscribers(pub))
}

// TestUnixEventsWriteDeadline: a subscriber that stops reading loses its
// connection at the write's deadline; the publisher then holds a bounded
// backlog, which the subscriber reads once it redials.
func TestUnixEventsWriteDeadline(t *testing.T) {
	name := eventName(t)
	opt := defaultUnixOptions()
	opt.eventQueue = 8
	opt.writeTimeout = 20 * time.Millisecond
	pub, err := listenUnixEvents(name, nil, Security{}, nil, opt)
	require.NoError(t, err)
	defer pub.Close()
	c := rawUnix(t, name) // admitted, and never reads
	require.NoError(t, c.SetDeadline(time.Time{}))
	require.Eventually(t, func() bool { return subscribers(pub) == 1 }, settle, time.Millisecond)

	sent := 0
	require.Eventually(t, func() bool {
		for range 256 {
			pub.Send(readyEvent(0, fmt.Sprintf("t-%d", sent)))
			sent++
		}
		return pub.Stats().WriteFailures == 1
	}, settle, time.Millisecond)
	require.Eventually(t, func() bool { return subscribers(pub) == 0 }, settle, time.Millisecond)
	for range 100 {
		pub.Send(readyEvent(0, fmt.Sprintf("t-%d", sent)))
		sent++
	}
	require.LessOrEqual(t, backlogLen(pub), opt.eventQueue, "the backlog is bounded")

	// A subscriber that reads gets the backlog, the newest events, in order.
	sub := newUnixEventSub(nil, Security{}, nil, opt, nil)
	defer sub.Close()
	require.NoError(t, sub.Connect(name))
	for i := range opt.eventQueue {
		ev := nextOf(t, sub.Events())
		require.EqualValues(t, sent-opt.eventQueue+i+1, ev.Seq)
	}
}

// TestUnixEventsClose: closing both ends, with subscriptions live and
// lost, leaves no goroutine behind and closes Events.
func TestUnixEventsClose(t *testing.T) {
	before := runtime.NumGoroutine()
	name := eventName(t)
	pub, err := listenUnixEvents(name, nil, Security{}, nil, defaultUnixOptions())
	require.NoError(t, err)
	sub := newUnixEventSub(nil, Security{}, nil, defaultUnixOptions(), nil)
	require.NoError(t, sub.Connect(name))
	require.Error(t, sub.Connect(name+"/nobody"), "no ZeroMQ to fall back to")
	pub.Send(readyEvent(0, "one"))
	nextOf(t, sub.Events())
	require.NoError(t, pub.Close()) // the subscription now redials
	require.NoError(t, sub.Close())
	require.NoError(t, sub.Close(), "idempotent")
	_, ok := <-sub.Events()
	require.False(t, ok)
	requireGoroutinesBack(t, before)
}

func subscribers(p *UnixEventPub) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.subs)
}

func queued(p *UnixEventPub) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for sc := range p.subs {
		n = max(n, len(sc.q))
	}
	return n
}

func backlogLen(p *UnixEventPub) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.backlog)
}

// TestUnixEventsPolledByTheCaller: with Direct, a same-host publisher's
// events go to the caller's function, not to Events, and Poll delivers on
// the caller's own goroutine whatever has arrived, without waiting for
// the reader goroutine's wake. The reader and Poll take turns on one
// stream: every event is delivered once, in order, whoever read it.
func TestUnixEventsPolledByTheCaller(t *testing.T) {
	shard, sched := unixLinks(t, secretA, defaultUnixOptions()), unixLinks(t, secretA, defaultUnixOptions())
	pub := publishOn(t, shard)
	sub := subscribeOn(t, sched)
	polled, ok := sub.(Poller)
	require.True(t, ok, "the Unix subscriber can be polled")

	var mu sync.Mutex
	var got []uint64
	byPoll := 0
	inPoll := false
	polled.Direct(func(evs []wire.Event) {
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range evs {
			got = append(got, ev.Seq)
			if inPoll {
				byPoll++
			}
		}
	})
	require.NoError(t, sub.Connect(pub.Endpoint()))

	const n = 2000
	for i := range n {
		pub.Send(readyEvent(1, fmt.Sprintf("t-%d", i)))
		if i%3 == 0 {
			mu.Lock()
			inPoll = true
			mu.Unlock()
			polled.Poll()
			mu.Lock()
			inPoll = false
			mu.Unlock()
		}
	}
	require.Eventually(t, func() bool {
		polled.Poll()
		mu.Lock()
		defer mu.Unlock()
		return len(got) >= n
	}, settle, time.Millisecond, "every event delivered")
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, got, n, "nothing delivered twice")
	for i, seq := range got {
		require.EqualValues(t, i+1, seq, "in order")
	}
	select {
	case evs := <-sub.Events():
		t.Fatalf("a directly delivered event also went to Events: %v", evs)
	default:
	}
	t.Logf("%d of %d events delivered by Poll", byPoll, n)
}

// TestUnixEventsPollDeliversWithoutTheReader: Poll reads the socket
// itself. Each round sends one event and polls until it is delivered;
// the reader goroutine, which must first be woken, may win a round, but
// not all of them.
func TestUnixEventsPollDeliversWithoutTheReader(t *testing.T) {
	shard, sched := unixLinks(t, "", defaultUnixOptions()), unixLinks(t, "", defaultUnixOptions())
	pub := publishOn(t, shard)
	sub := subscribeOn(t, sched)
	polled, ok := sub.(Poller)
	require.True(t, ok, "the Unix subscriber can be polled")
	var got atomic.Int64
	polled.Direct(func(evs []wire.Event) { got.Add(int64(len(evs))) })
	require.NoError(t, sub.Connect(pub.Endpoint()))

	const rounds = 200
	byPoll := 0
	for i := range rounds {
		pub.Send(readyEvent(1, fmt.Sprintf("t-%d", i)))
		deadline := time.Now().Add(settle)
		for got.Load() <= int64(i) && time.Now().Before(deadline) {
			byPoll += polled.Poll()
		}
		require.EqualValues(t, i+1, got.Load(), "round %d delivered once", i)
	}
	require.Positive(t, byPoll, "Poll delivered none of %d events: it does not read the socket", rounds)
	t.Logf("%d of %d events delivered by Poll", byPoll, rounds)
}

// FuzzUnixEventStream: whatever an admitted publisher's stream holds, cut
// wherever the socket cuts it, the subscriber delivers the same events as
// from the whole stream at once, stops at the first bad length, keeps at
// most one frame's bytes, and never panics.
func FuzzUnixEventStream(f *testing.F) {
	ev := readyEvent(1, "t-0")
	ev.V, ev.Seq = wire.Version, 1
	msg, err := wire.EncodeEvents([]wire.Event{ev})
	require.NoError(f, err)
	one, _ := appendUnixFrame(nil, msg)
	f.Add(one, uint8(3))
	f.Add(append(append([]byte{}, one...), one[:7]...), uint8(1))
	f.Add([]byte{0, 0, 0, 2, '{', '}'}, uint8(0))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff}, uint8(2))
	f.Fuzz(func(t *testing.T, stream []byte, cut uint8) {
		feed := func(step int) (delivered int, failed bool) {
			s := &UnixEventSub{log: slog.New(slog.NewTextHandler(io.Discard, nil)), quit: make(chan struct{})}
			s.direct = func(evs []wire.Event) { delivered += len(evs) }
			fl := &unixFollow{}
			for rest := stream; len(rest) > 0; {
				n := min(step, len(rest))
				fl.buf = append(fl.buf, rest[:n]...)
				rest = rest[n:]
				if _, err := s.deliverFrames(fl); err != nil {
					return delivered, true
				}
				if len(fl.buf) > unixFrameHeader+wire.MaxMessage {
					t.Fatalf("%d bytes kept", len(fl.buf))
				}
			}
			return delivered, false
		}
		whole, wholeFailed := feed(len(stream) + 1)
		cutN, cutFailed := feed(int(cut%16) + 1)
		if whole != cutN || wholeFailed != cutFailed {
			t.Fatalf("cut every %d bytes: %d events (failed %v); whole: %d (failed %v)", cut%16+1, cutN, cutFailed, whole, wholeFailed)
		}
	})
}

// TestUnixEventsPollEndsABadStream: a stream that Poll finds is not ours
// (a frame length no frame may have) is ended there: the frames before it
// are delivered, the error is kept for the reader, which owns the redial,
// and the connection is closed so that the reader wakes to it.
func TestUnixEventsPollEndsABadStream(t *testing.T) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	peer := os.NewFile(uintptr(fds[1]), "peer")
	defer peer.Close()
	ours := os.NewFile(uintptr(fds[0]), "ours")
	fc, err := net.FileConn(ours)
	require.NoError(t, err)
	_ = ours.Close() // FileConn holds its own duplicate
	c := fc.(*net.UnixConn)
	defer c.Close()

	s := newUnixEventSub(nil, Security{}, slog.New(slog.NewTextHandler(io.Discard, nil)), defaultUnixOptions(), nil)
	var got []wire.Event
	s.Direct(func(evs []wire.Event) { got = append(got, evs...) })
	f := &unixFollow{name: "test"}
	require.NoError(t, f.attach(c))
	s.polled = append(s.polled, f) // followed, with no reader started

	ev := readyEvent(1, "t-0")
	ev.V, ev.Seq = wire.Version, 1
	msg, err := wire.EncodeEvents([]wire.Event{ev})
	require.NoError(t, err)
	stream, err := appendUnixFrame(nil, msg)
	require.NoError(t, err)
	stream = append(stream, 0, 0, 0, 0) // a length of 0: not a frame of ours
	_, err = peer.Write(stream)
	require.NoError(t, err)

	require.Equal(t, 1, s.Poll(), "the frame before the bad one is delivered")
	require.Len(t, got, 1)
	require.ErrorIs(t, f.err, errUnixFrame, "the reader is told why the stream ended")
	_, err = c.Read(make([]byte, 1))
	require.ErrorIs(t, err, net.ErrClosed, "the connection is closed, waking the reader")
	require.Zero(t, s.Poll(), "a stream that ended is not read again")
}
