package control

import (
	"fmt"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// settle bounds how long the harness waits for goroutines and the zmq
// context to wind down after Close, and every other wait of these tests
// for something that normally takes milliseconds. It is a bound on
// waiting, not an assertion on speed: large enough that only a hang
// reaches it on a host loaded far beyond its cores.
const settle = 60 * time.Second

// harness gives a test a zmq context and checks, after every Close the
// test registered, that no goroutine was left behind and that the context
// terminates (it cannot while any socket is open).
func harness(t *testing.T) *zmq.Context {
	t.Helper()
	before := runtime.NumGoroutine()
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	// Registered first, so it runs after the test's own Close cleanups.
	t.Cleanup(func() {
		termed := make(chan error, 1)
		go func() { termed <- zctx.Term() }()
		requireWithin(t, termed, "zmq context did not terminate: a socket was left open")
		requireGoroutinesBack(t, before)
	})
	return zctx
}

// requireWithin waits, at most settle, for one error from done and
// requires it nil; hung says what a wait that ran out means.
func requireWithin(t *testing.T, done <-chan error, hung string) {
	t.Helper()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(settle):
		t.Fatal(hung)
	}
}

func requireGoroutinesBack(t *testing.T, before int) {
	t.Helper()
	deadline := time.Now().Add(settle)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		t.Fatalf("%d goroutines left behind (%d before):\n%s", n-before, before, buf)
	}
}

func hasIPv6(t *testing.T) bool {
	t.Helper()
	l, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// statusEcho answers status with one known item per asked id, so that a
// caller can check the reply is its own; other ops get a fixed body.
func statusEcho(req wire.Request) wire.Reply {
	switch req.Op {
	case wire.OpStatus:
		body, err := wire.DecodeBody[wire.Status](req.Body)
		if err != nil {
			return wire.ErrReply(req.ID, wire.CodeOf(err), err.Error())
		}
		items := make([]wire.ItemStatus, len(body.TransferIDs))
		for i, id := range body.TransferIDs {
			items[i] = wire.ItemStatus{TransferID: id, MMHash: "h-" + id, State: "READY", Known: true}
		}
		return wire.OKReply(req.ID, wire.StatusReply{Items: items})
	case wire.OpEventPort:
		return wire.OKReply(req.ID, wire.EventPortReply{Endpoint: "tcp://127.0.0.1:1"})
	case wire.OpCancel:
		body, err := wire.DecodeBody[wire.Cancel](req.Body)
		if err != nil {
			return wire.ErrReply(req.ID, wire.CodeOf(err), err.Error())
		}
		if strings.HasPrefix(body.TransferIDs[0], "panic") {
			panic("handler bug: " + body.TransferIDs[0])
		}
		if body.TransferIDs[0] == "closing" {
			return wire.ErrReply(req.ID, wire.CodeShuttingDown, "consumer is closing")
		}
		return wire.OKReply(req.ID, wire.CancelReply{Cancelled: len(body.TransferIDs)})
	}
	return wire.ErrReply(req.ID, "not_served", string(req.Op))
}

// opened fails t on a constructor's error and closes what it made when
// the test ends: opened[*Server](t)(NewServer(...)).
func opened[T interface{ Close() error }](t *testing.T) func(T, error) T {
	return func(v T, err error) T {
		t.Helper()
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, v.Close()) })
		return v
	}
}

func startServer(t *testing.T, zctx *zmq.Context, bind string, h Handler, opts ...ServerOption) *Server {
	t.Helper()
	return opened[*Server](t)(NewServer(zctx, bind, h, nil, opts...))
}

func dial(t *testing.T, zctx *zmq.Context, ep string, opts ...ClientOption) *Client {
	t.Helper()
	return opened[*Client](t)(Dial(zctx, ep, nil, opts...))
}

// rawPeer is a bare DEALER for sending what a Client never would. It is
// used only by the test goroutine.
type rawPeer struct {
	t    *testing.T
	sock *zmq.Socket
}

func newRawPeer(t *testing.T, zctx *zmq.Context, ep string) *rawPeer {
	t.Helper()
	s, err := newSocket(zctx, zmq.DEALER)
	require.NoError(t, err)
	require.NoError(t, s.SetRcvtimeo(settle))
	require.NoError(t, s.Connect(ep))
	t.Cleanup(func() { s.Close() })
	return &rawPeer{t: t, sock: s}
}

// roundTrip sends parts as one message and returns the decoded reply.
func (p *rawPeer) roundTrip(parts ...[]byte) wire.Reply {
	p.t.Helper()
	args := make([]any, len(parts))
	for i, b := range parts {
		args[i] = b
	}
	_, err := p.sock.SendMessage(args...)
	require.NoError(p.t, err)
	got, err := p.sock.RecvMessageBytes(0)
	require.NoError(p.t, err, "no reply")
	require.Len(p.t, got, 1)
	rep, err := wire.DecodeReply(got[0])
	require.NoError(p.t, err)
	return rep
}

func mustEncode(t testing.TB, id uint64, op wire.Op, body any) []byte {
	t.Helper()
	req, err := wire.NewRequest(id, op, body)
	require.NoError(t, err)
	b, err := wire.EncodeRequest(req)
	require.NoError(t, err)
	return b
}

// freePort returns a TCP port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func names(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%d", prefix, i)
	}
	return out
}

// waitingAny reports whether some call waits for its reply.
func (c *Client) waitingAny() bool {
	return c.calls.size() > 0
}
