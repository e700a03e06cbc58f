package control

import (
	"context"
	"runtime"
	"sync"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// The benchmarks here time the control plane against a floor taken in the
// same run: the same messages through bare libzmq sockets, each driven by
// one goroutine blocking in libzmq, with no owner goroutines, queues or
// wake-ups. Run them as the library runs, two Ps per process:
//
//	GOMAXPROCS=2 go test -run=NONE -bench='ControlRoundTrip|EventDelivery' ./core/control
//
// us/op is the latency of one operation in microseconds, floor-us the
// floor's and x-floor their ratio; plain and curve are without and with a
// deployment secret, the floor's too.

// chunk is how many operations run back to back before the benchmark
// switches between the floor and the code under test: interleaving them
// lets both see the same load on a shared machine.
const chunk = 10

// benchSecurity returns the plain (zero) or the CURVE security.
func benchSecurity(b *testing.B, curve bool) Security {
	b.Helper()
	if !curve {
		return Security{}
	}
	sec, err := NewSecurity(secretA, false)
	require.NoError(b, err)
	return sec
}

// interleaved runs b.N operations of op and as many of floor, chunk by
// chunk in turn, and reports op's mean latency (us/op), the floor's
// (floor-us) and their ratio (x-floor).
func interleaved(b *testing.B, floor, op func(n int)) {
	var tFloor, tOp time.Duration
	for done := 0; done < b.N; done += chunk {
		n := min(chunk, b.N-done)
		start := time.Now()
		floor(n)
		mid := time.Now()
		op(n)
		tFloor += mid.Sub(start)
		tOp += time.Since(mid)
	}
	n := float64(b.N)
	b.ReportMetric(float64(tOp)/n/1e3, "us/op")
	b.ReportMetric(float64(tFloor)/n/1e3, "floor-us")
	b.ReportMetric(float64(tOp)/float64(tFloor), "x-floor")
}

// BenchmarkControlRoundTrip times one Call (status of one id, about the
// size of a small reserve_batch) against a bare REQ/REP ping-pong of a
// frame of the same size. parallel runs GOMAXPROCS callers at once against
// as many bare pairs at once, and reports the time per call.
func BenchmarkControlRoundTrip(b *testing.B) {
	zctx, err := zmq.NewContext()
	require.NoError(b, err)
	defer zctx.Term()
	body := wire.Status{TransferIDs: []string{"transfer-0"}}
	frame := mustEncode(b, 1, wire.OpStatus, body)

	for _, curve := range []bool{false, true} {
		name := map[bool]string{false: "plain", true: "curve"}[curve]
		sec := benchSecurity(b, curve)
		floor := newBareFloor(b, frame, sec, zmq.REP, zmq.REQ)
		srv, err := NewServer(zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho), nil, WithServerSecurity(sec))
		require.NoError(b, err)
		cli, err := Dial(zctx, srv.Endpoint(), nil, WithClientSecurity(sec))
		require.NoError(b, err)
		ctx := context.Background()
		require.NoError(b, cli.Call(ctx, wire.OpStatus, body, nil)) // connect
		call := func() {
			if err := cli.Call(ctx, wire.OpStatus, body, nil); err != nil {
				b.Error(err)
			}
		}
		b.Run(name, func(b *testing.B) {
			interleaved(b, floor.run, func(n int) {
				for range n {
					call()
				}
			})
		})
		b.Run(name+"-parallel", func(b *testing.B) {
			callers := runtime.GOMAXPROCS(0)
			floors := make(bareFloors, callers)
			for w := range floors {
				floors[w] = newBareFloor(b, frame, sec, zmq.REP, zmq.REQ)
			}
			defer floors.close()
			interleaved(b, floors.run, func(n int) {
				var wg sync.WaitGroup
				for w := range callers {
					wg.Go(func() {
						for i := w; i < n; i += callers {
							call()
						}
					})
				}
				wg.Wait()
			})
		})
		require.NoError(b, cli.Close())
		require.NoError(b, srv.Close())
		floor.close()
	}
}

// BenchmarkEventDelivery times one event from EventPub.Send to its reader
// on EventSub.Events, lock-step, against a bare PUSH/PULL that the
// benchmark goroutine sends on and reads itself.
func BenchmarkEventDelivery(b *testing.B) {
	zctx, err := zmq.NewContext()
	require.NoError(b, err)
	defer zctx.Term()
	ev := readyEvent(3, "transfer-0")
	ev.V, ev.Seq, ev.SentNS = wire.Version, 1, time.Now().UnixNano()
	frame, err := wire.EncodeEvents([]wire.Event{ev})
	require.NoError(b, err)

	for _, curve := range []bool{false, true} {
		name := map[bool]string{false: "plain", true: "curve"}[curve]
		sec := benchSecurity(b, curve)
		floor := newBareFloor(b, frame, sec, zmq.PULL, zmq.PUSH)
		pub, err := NewEventPub(zctx, "127.0.0.1", nil, WithServerSecurity(sec))
		require.NoError(b, err)
		sub, err := NewEventSub(zctx, nil, WithClientSecurity(sec))
		require.NoError(b, err)
		require.NoError(b, sub.Connect(pub.Endpoint()))
		// The first event waits for the connection.
		pub.Send(ev)
		<-sub.Events()
		b.Run(name, func(b *testing.B) {
			interleaved(b, floor.run, func(n int) {
				for range n {
					pub.Send(ev)
					if _, ok := <-sub.Events(); !ok {
						b.Fatal("events closed")
					}
				}
			})
		})
		require.NoError(b, sub.Close())
		require.NoError(b, pub.Close())
		floor.close()
	}
}

// barePair opens a bound and a connected socket over loopback TCP on a
// context of their own (no ZAP handler: CURVE is the only check), CURVE
// when sec has a secret.
func barePair(b *testing.B, sec Security, bound, connected zmq.Type) (*zmq.Context, *zmq.Socket, *zmq.Socket) {
	b.Helper()
	zctx, err := zmq.NewContext()
	require.NoError(b, err)
	srv, err := newSocket(zctx, bound)
	require.NoError(b, err)
	require.NoError(b, srv.SetRcvtimeo(-1))
	cli, err := newSocket(zctx, connected)
	require.NoError(b, err)
	require.NoError(b, cli.SetRcvtimeo(-1))
	if sec.Curve() {
		require.NoError(b, srv.ServerAuthCurve("floor", sec.keys.ServerSecret))
		require.NoError(b, applyClient(cli, sec))
	}
	require.NoError(b, srv.Bind("tcp://127.0.0.1:*"))
	ep, err := srv.GetLastEndpoint()
	require.NoError(b, err)
	require.NoError(b, cli.Connect(ep))
	return zctx, srv, cli
}

// bareFloor is a floor: a socket of the benchmark goroutine's and its
// peer, each blocking in libzmq. For a round trip the peer is a REP echo on
// a goroutine of its own (the server's part); for an event the benchmark
// goroutine holds the PULL too and reads it itself, so that the floor has
// no Go hand-off at all where the code under test has one.
type bareFloor struct {
	b     *testing.B
	zctx  *zmq.Context
	near  *zmq.Socket
	pull  *zmq.Socket // the far PULL; nil for a REP echo
	frame []byte
	done  chan struct{}
}

func newBareFloor(b *testing.B, frame []byte, sec Security, far, near zmq.Type) *bareFloor {
	b.Helper()
	zctx, farSock, nearSock := barePair(b, sec, far, near)
	f := &bareFloor{b: b, zctx: zctx, near: nearSock, frame: frame, done: make(chan struct{})}
	if far == zmq.PULL {
		f.pull = farSock
		close(f.done)
	} else {
		go func() {
			defer close(f.done)
			defer farSock.Close()
			for {
				m, err := farSock.RecvBytes(0)
				if err != nil || len(m) == 0 {
					return
				}
				if _, err := farSock.SendBytes(m, 0); err != nil {
					return
				}
			}
		}()
	}
	f.run(1) // connect
	return f
}

// run sends frame n times, each once the last came back.
func (f *bareFloor) run(n int) {
	reply := f.near
	if f.pull != nil {
		reply = f.pull
	}
	for range n {
		_, err := f.near.SendBytes(f.frame, 0)
		require.NoError(f.b, err)
		_, err = reply.RecvBytes(0)
		require.NoError(f.b, err)
	}
}

// close stops the peer with an empty frame.
func (f *bareFloor) close() {
	if f.pull != nil {
		f.pull.Close()
	} else {
		_, _ = f.near.SendBytes(nil, 0)
	}
	<-f.done
	f.near.Close()
	require.NoError(f.b, f.zctx.Term())
}

// bareFloors are k REQ/REP floors driven at once, the floor of k callers:
// run shares n round trips among them as the callers share their calls.
type bareFloors []*bareFloor

func (fs bareFloors) run(n int) {
	var wg sync.WaitGroup
	for w, f := range fs {
		wg.Go(func() { f.run((n - w + len(fs) - 1) / len(fs)) })
	}
	wg.Wait()
}

func (fs bareFloors) close() {
	for _, f := range fs {
		f.close()
	}
}
