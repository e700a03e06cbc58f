package control

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"reflect"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// unixLinks opens Unix links of secret (empty: none) and closes them when
// the test ends, after what was opened on them.
func unixLinks(t *testing.T, secret string, opt unixOptions) *Unix {
	t.Helper()
	sec, err := NewSecurity(secret, false)
	require.NoError(t, err)
	u, err := NewUnix(sec)
	require.NoError(t, err)
	u.opt = opt
	t.Cleanup(func() {
		termed := make(chan error, 1)
		go func() { termed <- u.Close() }()
		requireWithin(t, termed, "unix links did not close: a socket was left open")
	})
	return u
}

func serveOn(t *testing.T, l Links) Serving {
	t.Helper()
	s, err := l.Serve("tcp://127.0.0.1:0", HandlerFunc(statusEcho), nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func dialOn(t *testing.T, l Links, ep string) Caller {
	t.Helper()
	c, err := l.Dial(ep, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func statusCall(c Caller, id string) error {
	ctx, cancel := context.WithTimeout(context.Background(), settle)
	defer cancel()
	var out wire.StatusReply
	if err := c.Call(ctx, wire.OpStatus, wire.Status{TransferIDs: []string{id}}, &out); err != nil {
		return err
	}
	if len(out.Items) != 1 || out.Items[0].MMHash != "h-"+id {
		return fmt.Errorf("reply %+v is not the answer to %s", out, id)
	}
	return nil
}

func unixServed(s Serving) uint64 { return s.(*dualServer).unix.Stats().Served }

// TestUnixPathAdmission: who may use a same-host server's Unix path, and
// what a refused caller does (calls over ZeroMQ, counted by cause, while
// the server counts the refusal by name).
func TestUnixPathAdmission(t *testing.T) {
	refuseAll := unixOptions{allowed: func(uint32) bool { return false }, maxConns: UnixMaxConns}
	for _, tc := range []struct {
		name           string
		server, client string
		serverOpt      unixOptions
		refused        string // the server's count; "" when admitted
		fallback       string // the client's cause; "" when over Unix
		zmqWorks       bool   // whether the fallback call succeeds
	}{
		{name: "no secret", serverOpt: defaultUnixOptions()},
		{name: "same secret", server: secretA, client: secretA, serverOpt: defaultUnixOptions()},
		{name: "client without the secret", server: secretA, serverOpt: defaultUnixOptions(), refused: "auth_no_secret", fallback: "auth"},
		{name: "server without the secret", client: secretA, serverOpt: defaultUnixOptions(), refused: "auth_unexpected_secret", fallback: "auth"},
		{name: "another secret", server: secretA, client: secretB, serverOpt: defaultUnixOptions(), refused: "auth_wrong_secret", fallback: "auth"},
		{name: "another user", server: secretA, client: secretA, serverOpt: refuseAll, refused: "unix_uid", fallback: "auth", zmqWorks: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srvLinks := unixLinks(t, tc.server, tc.serverOpt)
			cliLinks := unixLinks(t, tc.client, defaultUnixOptions())
			srv := serveOn(t, srvLinks)
			require.NotEmpty(t, srv.(*dualServer).UnixEndpoint())
			cli := dialOn(t, cliLinks, srv.Endpoint())
			_, isUnix := cli.(*unixCaller)
			require.True(t, isUnix, "a loopback endpoint is dialled over Unix")

			err := statusCall(cli, "t-1")
			if tc.refused == "" {
				require.NoError(t, err)
				require.EqualValues(t, 1, unixServed(srv), "the call went over Unix")
				require.EqualValues(t, 1, srv.Stats().Served)
				require.Empty(t, cliLinks.Fallbacks())
				return
			}
			if tc.zmqWorks {
				require.NoError(t, err)
			} else {
				require.Error(t, err, "ZeroMQ refuses a mismatched secret too")
			}
			require.Zero(t, unixServed(srv))
			// The server counts a refusal when its side of the handshake
			// ends, which can be after the client, told why, hung up and
			// went on: on a loaded machine, after the call returned.
			want := map[string]uint64{tc.refused: 1}
			require.Eventually(t, func() bool { return reflect.DeepEqual(want, srv.(*dualServer).unix.Stats().Refused) },
				10*time.Second, time.Millisecond, "the server counts the refusal: %v", srv.(*dualServer).unix.Stats().Refused)
			require.Equal(t, want, srv.(*dualServer).unix.Stats().Refused)
			require.GreaterOrEqual(t, srv.Stats().Refused[tc.refused], uint64(1), "Stats adds the Unix refusals")
			require.Equal(t, map[string]uint64{tc.fallback: 1}, cliLinks.Fallbacks())
		})
	}
}

// TestUnixFallbackUnreachable: a same-host server that has no Unix path
// (plain ZeroMQ links) is called over ZeroMQ, counted, and the Unix path
// is not tried again on every call.
func TestUnixFallbackUnreachable(t *testing.T) {
	zctx := harness(t)
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho))
	cliLinks := unixLinks(t, "", defaultUnixOptions())
	cli := dialOn(t, cliLinks, srv.Endpoint())
	for i := range 3 {
		require.NoError(t, statusCall(cli, fmt.Sprint("t-", i)))
	}
	require.EqualValues(t, 3, srv.Stats().Served)
	fb := cliLinks.Fallbacks()
	require.EqualValues(t, 3, fb["unreachable"], "every call over ZeroMQ is counted: %v", fb)
}

// TestUnixRemoteEndpointUsesZMQ: an endpoint of no address of this host
// gets a plain ZeroMQ client.
func TestUnixRemoteEndpointUsesZMQ(t *testing.T) {
	l := unixLinks(t, "", defaultUnixOptions())
	c := dialOn(t, l, "tcp://192.0.2.1:5555") // TEST-NET-1: never an address here
	_, isUnix := c.(*unixCaller)
	require.False(t, isUnix)
}

// TestUnixPipelined: calls from many goroutines share one connection and
// each gets its own reply.
func TestUnixPipelined(t *testing.T) {
	l := unixLinks(t, secretA, defaultUnixOptions())
	srv := serveOn(t, l)
	cli := dialOn(t, l, srv.Endpoint())
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 8 {
				errs <- statusCall(cli, fmt.Sprintf("t-%d-%d", g, i))
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.EqualValues(t, 64, unixServed(srv))
	require.Equal(t, 1, srv.(*dualServer).unix.gate.open(), "one connection carries every call")
	require.Empty(t, l.Fallbacks())
}

// TestUnixConnCap: a connection beyond the cap is refused and counted;
// its caller goes over ZeroMQ.
func TestUnixConnCap(t *testing.T) {
	opt := defaultUnixOptions()
	opt.maxConns = 1
	sl := unixLinks(t, "", opt)
	srv := serveOn(t, sl)
	first := dialOn(t, unixLinks(t, "", defaultUnixOptions()), srv.Endpoint())
	require.NoError(t, statusCall(first, "a"))
	secondLinks := unixLinks(t, "", defaultUnixOptions())
	second := dialOn(t, secondLinks, srv.Endpoint())
	require.NoError(t, statusCall(second, "b"))
	require.EqualValues(t, 1, unixServed(srv))
	require.EqualValues(t, 1, srv.Stats().Refused["unix_conn_cap"])
	require.EqualValues(t, 1, secondLinks.Fallbacks()["busy"])
}

// TestUnixCapPerUID: an admitted uid that opens and idles connections
// holds at most its share of the cap; the ones beyond are refused at
// accept (SO_PEERCRED), counted as unix_uid_cap, and another uid still
// gets in over Unix. Which uid a connection has is the test's seam: the
// first four are another uid's, admitted as root's would be.
func TestUnixCapPerUID(t *testing.T) {
	const attacker = 4242
	var mu sync.Mutex
	accepted := 0
	opt := defaultUnixOptions()
	opt.maxConns, opt.maxPerUID = 4, 2
	opt.allowed = func(uint32) bool { return true }
	opt.uidOf = func(*net.UnixConn) (uint32, error) {
		mu.Lock()
		defer mu.Unlock()
		accepted++
		if accepted <= 4 {
			return attacker, nil
		}
		return uint32(os.Getuid()), nil
	}
	srv := serveOn(t, unixLinks(t, "", opt))
	name := srv.(*dualServer).unix.Endpoint()
	var admitted int
	for range 4 {
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: name, Net: "unix"})
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		require.NoError(t, c.SetDeadline(time.Now().Add(settle)))
		if clientHandshake(c, nil, sameUser) == nil {
			admitted++
		}
	}
	require.Equal(t, 2, admitted, "the attacking uid holds its share and no more")
	require.EqualValues(t, 2, srv.Stats().Refused["unix_uid_cap"])

	l := unixLinks(t, "", defaultUnixOptions())
	require.NoError(t, statusCall(dialOn(t, l, srv.Endpoint()), "a"))
	require.EqualValues(t, 1, unixServed(srv), "the other uid was served over Unix")
	require.Empty(t, l.Fallbacks())
}

// TestUnixStrangersAndSharesAtAccept plays another local user against
// both same-host Unix sockets, the call server's and the event
// publisher's, with connections the kernel stamps with real uids: a uid
// the rule does not admit is refused at accept, counted as unix_uid, and
// holds no place; a uid it admits (root, when the shard runs as a user)
// that opens connections and stays silent in the handshake holds its
// share of the cap and no more, the rest counted as unix_uid_cap; and a
// peer of this uid is still admitted and served, not pushed to ZeroMQ.
// The handshake deadline outlasts the test, so the attacker never has to
// renew its places.
func TestUnixStrangersAndSharesAtAccept(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("connecting as other uids needs root")
	}
	const other, stranger = 65534, 65533
	opt := defaultUnixOptions()
	opt.maxConns, opt.maxPerUID = 4, 2
	opt.handshakeTimeout = 2 * settle
	// The rule of a shard run by a user admits two uids, its own and
	// root's; the test runs as root, and other stands for the second.
	opt.allowed = func(uid uint32) bool { return uid == 0 || uid == other }
	for _, tc := range []struct {
		name string
		// listen serves on name; refused reads its refusals; legit is a
		// peer of this uid using it.
		listen func(t *testing.T, name string) (refused func() map[string]uint64, legit func(t *testing.T))
	}{
		{"call server", func(t *testing.T, name string) (func() map[string]uint64, func(*testing.T)) {
			srv, err := listenUnix(name, HandlerFunc(statusEcho), Security{}, nil, opt)
			require.NoError(t, err)
			t.Cleanup(func() { _ = srv.Close() })
			return func() map[string]uint64 { return srv.Stats().Refused }, func(t *testing.T) {
				c, err := dialUnix(name, Security{}, nil, defaultUnixOptions())
				require.NoError(t, err)
				t.Cleanup(func() { _ = c.Close() })
				require.NoError(t, statusCall(c, "a"))
				require.EqualValues(t, 1, srv.Stats().Served)
			}
		}},
		{"event publisher", func(t *testing.T, name string) (func() map[string]uint64, func(*testing.T)) {
			pub, err := listenUnixEvents(name, nil, Security{}, nil, opt)
			require.NoError(t, err)
			t.Cleanup(func() { _ = pub.Close() })
			return func() map[string]uint64 { return pub.Stats().Refused }, func(t *testing.T) {
				sub := newUnixEventSub(nil, Security{}, nil, defaultUnixOptions(), nil)
				t.Cleanup(func() { _ = sub.Close() })
				require.NoError(t, sub.Connect(name))
				pub.Send(readyEvent(1, "t-1"))
				require.Equal(t, "t-1", nextOf(t, sub.Events()).TransferID)
				// Counted once the write returned, maybe after the read.
				require.Eventually(t, func() bool { return pub.Stats().SentUnix == 1 }, settle, time.Millisecond)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := eventName(t)
			refused, legit := tc.listen(t, name)
			for range 2 * opt.maxConns {
				require.Equal(t, "refused unix_uid", openingOf(t, dialAs(t, name, stranger)))
			}
			require.EqualValues(t, 2*opt.maxConns, refused()["unix_uid"], "each stranger counted before it is told")
			var held int
			for range opt.maxConns {
				switch got := openingOf(t, dialAs(t, name, other)); got {
				case "hello":
					held++ // and never answered
				default:
					require.Equal(t, "refused busy", got)
				}
			}
			legit(t)
			require.Equal(t, opt.maxPerUID, held, "the other uid holds its share and no more")
			require.EqualValues(t, opt.maxConns-opt.maxPerUID, refused()["unix_uid_cap"])
		})
	}
}

// dialAs connects to the abstract name from a thread that runs as uid, so
// that the kernel stamps the connection (SO_PEERCRED) with that uid. The
// thread is never unlocked: it ends with its goroutine, and serves no
// other.
func dialAs(t *testing.T, name string, uid uint32) *net.UnixConn {
	t.Helper()
	type dialed struct {
		c   *net.UnixConn
		err error
	}
	ch := make(chan dialed, 1)
	go func() {
		runtime.LockOSThread()
		// The raw call changes this thread alone; syscall.Setresuid would
		// change every thread of the process.
		if _, _, e := syscall.RawSyscall(syscall.SYS_SETRESUID, uintptr(uid), uintptr(uid), uintptr(uid)); e != 0 {
			ch <- dialed{err: fmt.Errorf("setresuid %d: %w", uid, e)}
			return
		}
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: name, Net: "unix"})
		ch <- dialed{c, err}
	}()
	d := <-ch
	require.NoError(t, d.err)
	t.Cleanup(func() { _ = d.c.Close() })
	require.NoError(t, d.c.SetDeadline(time.Now().Add(settle)))
	return d.c
}

// openingOf reads what a Unix server first sends on c: "hello" when it
// admits c to the handshake, else the refusal it sends in its place.
func openingOf(t *testing.T, c *net.UnixConn) string {
	t.Helper()
	b := make([]byte, unixHelloLen)
	_, err := io.ReadFull(c, b)
	require.NoError(t, err)
	if string(b[:4]) == "ECUH" {
		return "hello"
	}
	status, err := checkOpening("refusal", "ECUV", b)
	require.NoError(t, err)
	switch status {
	case unixRefusedUID:
		return "refused unix_uid"
	case unixRefusedBusy:
		return "refused busy"
	}
	return fmt.Sprintf("refused with status %d", status)
}

// rawUnix connects to name and passes the handshake without a secret.
func rawUnix(t *testing.T, name string) *net.UnixConn {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: name, Net: "unix"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(settle)))
	require.NoError(t, clientHandshake(c, nil, sameUser))
	return c
}

// TestUnixServerBounds: a frame over the cap closes its connection,
// counted; a frame that is no request gets an error reply.
func TestUnixServerBounds(t *testing.T) {
	srv, err := ListenUnix("@ecmooncake/test/"+t.Name(), HandlerFunc(statusEcho), Security{}, nil)
	require.NoError(t, err)
	defer srv.Close()

	c := rawUnix(t, srv.Endpoint())
	frame, err := appendUnixFrame(nil, []byte("not json"))
	require.NoError(t, err)
	_, err = c.Write(frame)
	require.NoError(t, err)
	got, err := readUnixFrame(c)
	require.NoError(t, err)
	rep, err := wire.DecodeReply(got)
	require.NoError(t, err)
	require.NotNil(t, rep.Err)
	require.Equal(t, wire.CodeBadRequest, rep.Err.Code)

	c2 := rawUnix(t, srv.Endpoint())
	_, err = c2.Write(binary.BigEndian.AppendUint32(nil, uint32(wire.MaxMessage+1)))
	require.NoError(t, err)
	_, err = readUnixFrame(c2)
	require.Error(t, err, "the server hangs up")
	require.Eventually(t, func() bool { return srv.Stats().Oversized == 1 }, settle, time.Millisecond)
}

// TestUnixHandshakeGarbage: a peer that does not speak the handshake is
// refused and counted, and the server keeps serving.
func TestUnixHandshakeGarbage(t *testing.T) {
	srv, err := ListenUnix("@ecmooncake/test/"+t.Name(), HandlerFunc(statusEcho), Security{}, nil)
	require.NoError(t, err)
	defer srv.Close()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: srv.Endpoint(), Net: "unix"})
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Write(make([]byte, unixAnswerLen))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return srv.Stats().Refused["unix_handshake"] == 1 }, settle, time.Millisecond)

	cli, err := DialUnix(srv.Endpoint(), Security{}, nil)
	require.NoError(t, err)
	defer cli.Close()
	require.NoError(t, statusCall(cli, "after"))
}

// TestUnixLostConnection: a call in flight when the server goes fails at
// once (never resent over ZeroMQ), and a later call dials again.
func TestUnixLostConnection(t *testing.T) {
	name := "@ecmooncake/test/" + t.Name()
	entered := make(chan struct{})
	release := make(chan struct{})
	h := HandlerFunc(func(req wire.Request) wire.Reply {
		if req.Op == wire.OpCancel {
			close(entered)
			<-release
		}
		return statusEcho(req)
	})
	srv, err := ListenUnix(name, h, Security{}, nil)
	require.NoError(t, err)
	cli, err := DialUnix(name, Security{}, nil)
	require.NoError(t, err)
	defer cli.Close()
	done := make(chan error, 1)
	go func() {
		done <- cli.Call(context.Background(), wire.OpCancel, wire.Cancel{TransferIDs: []string{"x"}}, nil)
	}()
	<-entered
	closed := make(chan error, 1)
	go func() { closed <- srv.Close() }()
	select {
	case err := <-done:
		require.ErrorContains(t, err, "unix connection lost")
		require.NotErrorIs(t, err, errNotSent)
	case <-time.After(settle):
		t.Fatal("a call on a lost connection did not fail")
	}
	close(release)
	requireWithin(t, closed, "unix server did not close")

	srv, err = ListenUnix(name, HandlerFunc(statusEcho), Security{}, nil)
	require.NoError(t, err)
	defer srv.Close()
	require.NoError(t, statusCall(cli, "again"))
}

func TestUnixName(t *testing.T) {
	for _, tc := range []struct {
		ep, want string
		bad      bool
	}{
		{ep: "tcp://127.0.0.1:5000", want: "@ecmooncake/control/127.0.0.1:5000"},
		{ep: "tcp://[::1]:5000", want: "@ecmooncake/control/[::1]:5000"},
		{ep: "tcp://*:5000", bad: true},
		{ep: "tcp://127.0.0.1:0", bad: true},
		{ep: "ipc:///tmp/x", bad: true},
	} {
		got, err := UnixName(tc.ep)
		if tc.bad {
			require.ErrorIs(t, err, ErrBadEndpoint, tc.ep)
			continue
		}
		require.NoError(t, err)
		require.Equal(t, tc.want, got)
	}
}

func TestUnixFrameCodec(t *testing.T) {
	one, err := appendUnixFrame(nil, []byte("abc"))
	require.NoError(t, err)
	for _, tc := range []struct {
		name  string
		in    []byte
		frame string
		ok    bool
		bad   bool
	}{
		{name: "whole", in: one, frame: "abc", ok: true},
		{name: "header cut", in: one[:3]},
		{name: "frame cut", in: one[:5]},
		{name: "zero length", in: []byte{0, 0, 0, 0}, bad: true},
		{name: "over the cap", in: binary.BigEndian.AppendUint32(nil, uint32(wire.MaxMessage+1)), bad: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			frame, _, ok, err := decodeUnixFrame(tc.in)
			if tc.bad {
				require.ErrorIs(t, err, errUnixFrame)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.ok, ok)
			if ok {
				require.Equal(t, tc.frame, string(frame))
			}
		})
	}
	_, err = appendUnixFrame(nil, make([]byte, wire.MaxMessage+1))
	require.ErrorIs(t, err, errUnixFrame)
}

// FuzzUnixFrames: any bytes split into frames within the cap, which
// encode back to the bytes they came from.
func FuzzUnixFrames(f *testing.F) {
	one, _ := appendUnixFrame(nil, []byte(`{"v":1}`))
	f.Add(one)
	f.Add(append(one, one[:5]...))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		var back []byte
		rest := b
		for {
			frame, r, ok, err := decodeUnixFrame(rest)
			if err != nil || !ok {
				break
			}
			if len(frame) == 0 || len(frame) > wire.MaxMessage {
				t.Fatalf("frame of %d bytes", len(frame))
			}
			back, err = appendUnixFrame(back, frame)
			if err != nil {
				t.Fatal(err)
			}
			rest = r
		}
		if string(back)+string(rest) != string(b) {
			t.Fatal("frames do not encode back to their bytes")
		}
	})
}

// watcher records the peers of the requests it answered and those whose
// connection it was told ended.
type watcher struct {
	mu     sync.Mutex
	served []string
	gone   chan string
}

func (w *watcher) Handle(req wire.Request) wire.Reply {
	w.mu.Lock()
	w.served = append(w.served, req.Peer)
	w.mu.Unlock()
	return statusEcho(req)
}

func (w *watcher) PeerGone(peer string) { w.gone <- peer }

// TestUnixPeerGoneNamesTheEndedConnection: a handler that watches peers
// hears, once, that the connection a request came on ended when its
// client went away, under the same name the request carried.
func TestUnixPeerGoneNamesTheEndedConnection(t *testing.T) {
	l := unixLinks(t, "peer-gone-secret-0123456789abcdef", defaultUnixOptions())
	w := &watcher{gone: make(chan string, 4)}
	s, err := l.Serve("tcp://127.0.0.1:0", w, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })

	client := unixLinks(t, "peer-gone-secret-0123456789abcdef", defaultUnixOptions())
	c, err := client.Dial(s.Endpoint(), nil)
	require.NoError(t, err)
	require.NoError(t, statusCall(c, "x"))
	require.Equal(t, uint64(1), unixServed(s))
	select {
	case p := <-w.gone:
		t.Fatalf("told %q ended while its client was still connected", p)
	default:
	}
	require.NoError(t, c.Close())

	var gone string
	select {
	case gone = <-w.gone:
	case <-time.After(settle):
		t.Fatal("the handler never heard that the connection ended")
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	require.Equal(t, w.served, []string{gone})
}
