package control

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

func TestEndpoint(t *testing.T) {
	for _, tc := range []struct {
		host string
		port int
		want string
	}{
		{"1.2.3.4", 5, "tcp://1.2.3.4:5"},
		{"::1", 5, "tcp://[::1]:5"},
		{"[::1]", 5, "tcp://[::1]:5"},
		{"fe80::1%eth0", 7, "tcp://[fe80::1%eth0]:7"},
		{"node-a.example", 5555, "tcp://node-a.example:5555"},
		{"*", 0, "tcp://*:0"},
	} {
		got := Endpoint(tc.host, tc.port)
		require.Equal(t, tc.want, got)
		host, port, err := SplitEndpoint(got)
		require.NoError(t, err)
		require.Equal(t, strings.Trim(tc.host, "[]"), host)
		require.Equal(t, tc.port, port)
	}
}

func TestSplitEndpointRejects(t *testing.T) {
	for _, tc := range []struct{ name, ep string }{
		{"no scheme", "1.2.3.4:5"},
		{"other scheme", "ipc:///tmp/x"},
		{"no port", "tcp://1.2.3.4"},
		{"unbracketed ipv6", "tcp://::1:5"},
		{"port not a number", "tcp://host:http"},
		{"port too big", "tcp://host:65536"},
		{"negative port", "tcp://host:-1"},
		{"empty host", "tcp://:5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := SplitEndpoint(tc.ep)
			require.ErrorIs(t, err, ErrBadEndpoint)
		})
	}
}

func TestConstructorsRejectBadEndpoints(t *testing.T) {
	zctx := harness(t)
	_, err := NewServer(zctx, "1.2.3.4:5", HandlerFunc(statusEcho), nil)
	require.ErrorIs(t, err, ErrBadEndpoint)
	_, err = Dial(zctx, "tcp://127.0.0.1:0", nil)
	require.ErrorIs(t, err, ErrBadEndpoint, "a client needs a concrete port")
	_, err = Dial(zctx, "tcp://*:5", nil)
	require.ErrorIs(t, err, ErrBadEndpoint, "a client needs a concrete host")
	_, err = NewServer(zctx, "tcp://127.0.0.1:0", nil, nil)
	require.Error(t, err)
}

func TestCallOverLoopback(t *testing.T) {
	for _, tc := range []struct {
		name string
		host string
		v6   bool
	}{
		{"ipv4", "127.0.0.1", false},
		{"ipv6", "::1", true},
		{"hostname", "localhost", false},
		{"wildcard", "*", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.v6 && !hasIPv6(t) {
				t.Skip("host has no IPv6 loopback")
			}
			zctx := harness(t)
			srv := startServer(t, zctx, Endpoint(tc.host, 0), HandlerFunc(statusEcho))
			host, port, err := SplitEndpoint(srv.Endpoint())
			require.NoError(t, err)
			require.NotZero(t, port, "Endpoint reports the port actually bound")
			if tc.host != "*" {
				require.Equal(t, tc.host, host)
			} else {
				host = "127.0.0.1"
			}

			cli := dial(t, zctx, Endpoint(host, port))
			var got wire.StatusReply
			require.NoError(t, cli.Call(context.Background(), wire.OpStatus, wire.Status{TransferIDs: []string{"t1"}}, &got))
			require.Equal(t, "t1", got.Items[0].TransferID)
			require.Equal(t, uint64(1), cli.RoundTrips())
		})
	}
}

func TestPipelinedCallsMatchTheirReplies(t *testing.T) {
	zctx := harness(t)
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho))
	cli := dial(t, zctx, srv.Endpoint())

	const calls = 200
	start := make(chan struct{})
	errs := make(chan error, calls)
	var wg sync.WaitGroup
	for i := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			id := fmt.Sprintf("transfer-%d", i)
			var got wire.StatusReply
			if err := cli.Call(context.Background(), wire.OpStatus, wire.Status{TransferIDs: []string{id}}, &got); err != nil {
				errs <- err
				return
			}
			if len(got.Items) != 1 || got.Items[0].TransferID != id || got.Items[0].MMHash != "h-"+id {
				errs <- fmt.Errorf("call for %s got %+v", id, got.Items)
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, uint64(calls), cli.RoundTrips())
	require.Equal(t, ClientStats{RoundTrips: calls}, cli.Stats())
	require.Equal(t, uint64(calls), srv.Stats().Served)
}

// TestServerRefusals is a script: each step sends what a broken or foreign
// peer might, expects the named error code for the recoverable id, and the
// next step proves the server still serves.
func TestServerRefusals(t *testing.T) {
	zctx := harness(t)
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho))
	peer := newRawPeer(t, zctx, srv.Endpoint())

	oversized := append([]byte(`{"v":1,"id":41,"op":"status","body":{"transfer_ids":["`), make([]byte, wire.MaxMessage)...)
	for i := len(oversized) - wire.MaxMessage; i < len(oversized); i++ {
		oversized[i] = 'x'
	}
	oversized = append(oversized, `"]}}`...)

	wantErrors := map[string]uint64{}
	steps := 0
	for _, tc := range []struct {
		name   string
		parts  [][]byte
		wantID uint64
		code   string
	}{
		{"garbage", [][]byte{[]byte("\x00\x01garbage")}, 0, wire.CodeBadRequest},
		{"empty frame", [][]byte{{}}, 0, wire.CodeBadRequest},
		{"truncated json keeps id", [][]byte{[]byte(`{"v":1,"id":31,"op":"sta`)}, 31, wire.CodeBadRequest},
		{"two frames", [][]byte{[]byte("x"), mustEncode(t, 32, wire.OpPeers, nil)}, 32, wire.CodeBadRequest},
		{"unknown op", [][]byte{[]byte(`{"v":1,"id":33,"op":"format_disk"}`)}, 33, wire.CodeUnknownOp},
		{"wrong version", [][]byte{[]byte(`{"v":9,"id":34,"op":"status"}`)}, 34, wire.CodeVersion},
		{"zero id", [][]byte{[]byte(`{"v":1,"id":0,"op":"status"}`)}, 0, wire.CodeBadRequest},
		{"invalid body", [][]byte{[]byte(`{"v":1,"id":35,"op":"cancel","body":{"transfer_ids":[]}}`)}, 35, wire.CodeBadRequest},
		{"oversized", [][]byte{oversized}, 41, wire.CodeTooLarge},
		{"handler code", [][]byte{mustEncode(t, 36, wire.OpPeers, nil)}, 36, "not_served"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := peer.roundTrip(tc.parts...)
			require.NotNil(t, rep.Err)
			require.Equal(t, tc.code, rep.Err.Code, rep.Err.Msg)
			require.Equal(t, tc.wantID, rep.ID)
			wantErrors[tc.code]++
			steps++

			ok := peer.roundTrip(mustEncode(t, 99, wire.OpStatus, wire.Status{TransferIDs: []string{"still"}}))
			require.Nil(t, ok.Err, "the server keeps serving")
			require.Equal(t, uint64(99), ok.ID)
		})
	}
	st := srv.Stats()
	require.Equal(t, wantErrors, st.Errors)
	require.Equal(t, uint64(2*steps), st.Served, "one refusal and one answer per step")
}

func TestReplyErrorsReachTheCaller(t *testing.T) {
	zctx := harness(t)
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho))
	cli := dial(t, zctx, srv.Endpoint())
	ctx := context.Background()

	err := cli.Call(ctx, wire.OpCancel, wire.Cancel{TransferIDs: []string{"closing"}}, nil)
	var werr *wire.Error
	require.ErrorAs(t, err, &werr)
	require.Equal(t, wire.CodeShuttingDown, werr.Code)
	require.ErrorIs(t, err, wire.ErrShuttingDown)
	require.Contains(t, err.Error(), srv.Endpoint(), "the error names where the call went")

	err = cli.Call(ctx, wire.OpPeers, nil, nil)
	require.ErrorAs(t, err, &werr)
	require.Equal(t, "not_served", werr.Code)

	err = cli.Call(ctx, wire.Op("format_disk"), nil, nil)
	require.ErrorIs(t, err, wire.ErrUnknownOp, "refused locally, never sent")

	// A reply body that does not satisfy the caller's type is an error,
	// not a half-filled value.
	var peers wire.PeersReply
	err = cli.Call(ctx, wire.OpEventPort, nil, &peers)
	require.ErrorIs(t, err, wire.ErrInvalid)

	var port wire.EventPortReply
	require.NoError(t, cli.Call(ctx, wire.OpEventPort, nil, &port))
	require.Equal(t, "tcp://127.0.0.1:1", port.Endpoint)
}

func TestHandlerPanicIsAnInternalError(t *testing.T) {
	zctx := harness(t)
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho))
	cli := dial(t, zctx, srv.Endpoint())
	ctx := context.Background()

	for range 3 {
		err := cli.Call(ctx, wire.OpCancel, wire.Cancel{TransferIDs: []string{"panic-now"}}, nil)
		require.ErrorIs(t, err, wire.ErrInternal)
		var got wire.CancelReply
		require.NoError(t, cli.Call(ctx, wire.OpCancel, wire.Cancel{TransferIDs: []string{"a", "b"}}, &got))
		require.Equal(t, 2, got.Cancelled)
	}
	require.Equal(t, uint64(3), srv.Stats().Errors[wire.CodeInternal])
}

func TestCallToGoneServerReturnsAtDeadline(t *testing.T) {
	zctx := harness(t)
	port := freePort(t)
	ep := Endpoint("127.0.0.1", port)
	cli := dial(t, zctx, ep, WithCallTimeout(50*time.Millisecond))

	t.Run("context deadline", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		err := cli.Call(ctx, wire.OpStatus, wire.Status{}, nil)
		require.ErrorIs(t, err, context.DeadlineExceeded)
	})
	t.Run("default timeout", func(t *testing.T) {
		err := cli.Call(context.Background(), wire.OpStatus, wire.Status{}, nil)
		require.ErrorIs(t, err, context.DeadlineExceeded)
	})
	t.Run("cancelled", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		err := cli.Call(ctx, wire.OpStatus, wire.Status{}, nil)
		require.ErrorIs(t, err, context.Canceled)
	})
	t.Run("server comes back without stale requests", func(t *testing.T) {
		srv := startServer(t, zctx, ep, HandlerFunc(statusEcho))
		ctx, cancel := context.WithTimeout(context.Background(), settle)
		defer cancel()
		require.NoError(t, cli.Call(ctx, wire.OpStatus, wire.Status{TransferIDs: []string{"fresh"}}, nil))
		require.Equal(t, uint64(1), srv.Stats().Served, "requests of calls that gave up were never delivered")
	})
}

func TestCloseFailsCallsInFlight(t *testing.T) {
	zctx := harness(t)
	cli, err := Dial(zctx, Endpoint("127.0.0.1", freePort(t)), nil)
	require.NoError(t, err)

	const calls = 10
	errs := make(chan error, calls)
	for range calls {
		go func() {
			errs <- cli.Call(context.Background(), wire.OpStatus, wire.Status{}, nil)
		}()
	}
	require.Eventually(t, func() bool {
		return cli.calls.size() == calls
	}, settle, time.Millisecond, "every call is pending")
	require.NoError(t, cli.Close())
	for range calls {
		require.ErrorIs(t, <-errs, ErrClosed)
	}
	require.ErrorIs(t, cli.Call(context.Background(), wire.OpStatus, wire.Status{}, nil), ErrClosed)
	require.NoError(t, cli.Close(), "Close is idempotent")
}

func TestLateRepliesAreDroppedAndCounted(t *testing.T) {
	zctx := harness(t)
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho))
	cli := dial(t, zctx, srv.Endpoint())
	require.NoError(t, cli.Call(context.Background(), wire.OpStatus, wire.Status{}, nil))

	// A caller that gave up leaves no pending entry; its reply must be
	// counted and dropped, not delivered to the next caller.
	cli.nextID.Add(1)
	late := cli.nextID.Load()
	frame, err := wire.EncodeReply(wire.OKReply(late, wire.StatusReply{}))
	require.NoError(t, err)
	cli.handleReply(capped{parts: [][]byte{frame}})
	cli.handleReply(capped{parts: [][]byte{[]byte("junk")}})
	require.Equal(t, ClientStats{RoundTrips: 1, LateReplies: 1, BadReplies: 1}, cli.Stats())

	require.NoError(t, cli.Call(context.Background(), wire.OpStatus, wire.Status{}, nil))
	require.Equal(t, uint64(2), cli.RoundTrips())
}

func TestServerCloseIsIdempotent(t *testing.T) {
	zctx := harness(t)
	srv, err := NewServer(zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho), nil)
	require.NoError(t, err)
	require.NoError(t, srv.Close())
	require.NoError(t, srv.Close())
	require.ErrorIs(t, srv.stopped(), ErrClosed)
}

// TestOwnerPanicStopsOnlyItsObject drives the shared owner life cycle with
// a step that panics: the panic is recovered, the sockets are closed, and
// waiters see ErrStopped.
func TestOwnerPanicStopsOnlyItsObject(t *testing.T) {
	zctx := harness(t)
	start := func(serve func() error) *owner {
		sock, err := newSocket(zctx, zmq.PAIR)
		require.NoError(t, err)
		o, err := newOwner(nil, "test", pollItem{sock: sock, serve: serve})
		require.NoError(t, err)
		o.start()
		return o
	}
	o := start(func() error { panic("owner bug") })
	err := o.stopped()
	require.ErrorIs(t, err, ErrStopped)
	require.Contains(t, err.Error(), "owner bug")
	o.stop()

	o2 := start(func() error { return errors.New("context terminated") })
	require.ErrorIs(t, o2.stopped(), ErrStopped)
	o2.stop()
}
