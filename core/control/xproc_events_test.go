package control

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// The paths of BenchmarkEventFloors, in the order of its trigger bytes.
var eventPaths = []string{"bare-unix", "bare-zmq", "unix", "zmq"}

// TestCrossProcessEventPublisher is the shard's half of
// BenchmarkEventFloors: run by the benchmark in a child process, it
// publishes one event on the path that each byte of its trigger
// connection names: a bare Unix socket and a bare PUSH socket (a frame of
// an event's size, the send time in its first 8 bytes), our Unix event
// path (Unix links) and our ZeroMQ event path (ZMQ links), until stdin
// closes.
func TestCrossProcessEventPublisher(t *testing.T) {
	if os.Getenv("ECM_XPROC_EVENTS") == "" {
		t.Skip("the publisher half of BenchmarkEventFloors")
	}
	ul, err := NewUnix(Security{})
	require.NoError(t, err)
	up, err := ul.Publish("127.0.0.1", nil)
	require.NoError(t, err)
	zl, err := NewZMQ(Security{})
	require.NoError(t, err)
	zp, err := zl.Publish("127.0.0.1", nil)
	require.NoError(t, err)
	// The bare PUSH lives in a context of its own, never terminated.
	bctx, err := zmq.NewContext()
	require.NoError(t, err)
	push, err := bctx.NewSocket(zmq.PUSH)
	require.NoError(t, err)
	require.NoError(t, push.Bind("tcp://127.0.0.1:*"))
	pushEP, err := push.GetLastEndpoint()
	require.NoError(t, err)
	bareLn, err := net.ListenUnix("unix", &net.UnixAddr{Name: fmt.Sprintf("@ecmooncake/bench/%d/events-bare", os.Getpid()), Net: "unix"})
	require.NoError(t, err)
	trigLn, err := net.ListenUnix("unix", &net.UnixAddr{Name: fmt.Sprintf("@ecmooncake/bench/%d/events-trigger", os.Getpid()), Net: "unix"})
	require.NoError(t, err)

	fmt.Println("bare-unix", bareLn.Addr().String())
	fmt.Println("bare-zmq", pushEP)
	fmt.Println("unix", up.Endpoint())
	fmt.Println("zmq", zp.Endpoint())
	fmt.Println("trigger", trigLn.Addr().String())

	bare, err := bareLn.AcceptUnix()
	require.NoError(t, err)
	trig, err := trigLn.AcceptUnix()
	require.NoError(t, err)
	ev := readyEvent(0, "transfer-0")
	ev.V, ev.Seq, ev.SentNS = wire.Version, 1, time.Now().UnixNano()
	frame, err := wire.EncodeEvents([]wire.Event{ev})
	require.NoError(t, err)
	framed, err := appendUnixFrame(nil, frame)
	require.NoError(t, err)
	go func() {
		r := bufio.NewReader(trig)
		for {
			b, err := r.ReadByte()
			if err != nil {
				return
			}
			switch b {
			case 0:
				binary.BigEndian.PutUint64(framed[unixFrameHeader:], uint64(time.Now().UnixNano()))
				_, err = bare.Write(framed)
			case 1:
				binary.BigEndian.PutUint64(frame, uint64(time.Now().UnixNano()))
				_, err = push.SendBytes(frame, 0)
			case 2:
				up.Send(readyEvent(0, "transfer-0"))
			case 3:
				zp.Send(readyEvent(0, "transfer-0"))
			}
			if err != nil {
				return
			}
		}
	}()
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	_ = trig.Close()
	_ = bare.Close()
	_ = up.Close()
	_ = zp.Close()
	_ = ul.Close()
	_ = zl.Close()
}

// BenchmarkEventFloors times one readiness event from a shard's process
// to a scheduler's over our Unix event path (UnixEventPub to
// UnixEventSub) and our ZeroMQ event path (EventPub to EventSub), from
// the publisher's Send to the subscriber's Events, beside the floors of
// the same process pair: a bare Unix-socket write and a bare PUSH/PULL of
// a frame of the same size, read by the benchmark goroutine itself. The
// four are taken in turn, event by event, so that they share the
// machine's load, back to back (gap=0) and with both processes idle
// before each event (gap=1ms):
//
//	GOMAXPROCS=2 go test -run=NONE -bench=EventFloors ./core/control
//
// Each figure is a one-way p50 or p99 in microseconds (the two processes
// share the host's clock), and x-bare-unix the ratio of a path to the
// bare Unix write.
func BenchmarkEventFloors(b *testing.B) {
	eps := startHalf(b, "TestCrossProcessEventPublisher", "ECM_XPROC_EVENTS", 5)

	bare, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: eps["bare-unix"], Net: "unix"})
	require.NoError(b, err)
	defer bare.Close()
	trig, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: eps["trigger"], Net: "unix"})
	require.NoError(b, err)
	defer trig.Close()
	pctx, err := zmq.NewContext()
	require.NoError(b, err)
	defer pctx.Term()
	pull, err := newSocket(pctx, zmq.PULL)
	require.NoError(b, err)
	require.NoError(b, pull.SetRcvtimeo(-1))
	require.NoError(b, pull.Connect(eps["bare-zmq"]))
	defer pull.Close()

	ul, err := NewUnix(Security{})
	require.NoError(b, err)
	defer ul.Close()
	usub, err := ul.Subscribe(nil)
	require.NoError(b, err)
	defer usub.Close()
	require.NoError(b, usub.Connect(eps["unix"]))
	zl, err := NewZMQ(Security{})
	require.NoError(b, err)
	defer zl.Close()
	zsub, err := zl.Subscribe(nil)
	require.NoError(b, err)
	defer zsub.Close()
	require.NoError(b, zsub.Connect(eps["zmq"]))

	stamp := func(f []byte) int64 { return int64(binary.BigEndian.Uint64(f)) }
	event := func(ch <-chan []wire.Event) (int64, error) {
		evs, ok := <-ch
		if !ok {
			return 0, ErrClosed
		}
		return evs[0].SentNS, nil
	}
	recv := []func() (int64, error){
		func() (int64, error) {
			f, err := readUnixFrame(bare)
			if err != nil {
				return 0, err
			}
			return stamp(f), nil
		},
		func() (int64, error) {
			f, err := pull.RecvBytes(0)
			if err != nil {
				return 0, err
			}
			return stamp(f), nil
		},
		func() (int64, error) { return event(usub.Events()) },
		func() (int64, error) { return event(zsub.Events()) },
	}
	one := func(i int) (time.Duration, error) {
		if _, err := trig.Write([]byte{byte(i)}); err != nil {
			return 0, err
		}
		sent, err := recv[i]()
		if err != nil {
			return 0, err
		}
		return time.Duration(time.Now().UnixNano() - sent), nil
	}
	for i := range eventPaths {
		_, err := one(i) // connect and warm up
		require.NoError(b, err, eventPaths[i])
	}
	require.EqualValues(b, 1, usub.Stats().ReceivedUnix, "our Unix path is the Unix path")
	reportFloors(b, eventPaths, one)
}
