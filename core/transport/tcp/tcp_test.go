package tcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/transporttest"
	"github.com/stretchr/testify/require"
)

// eventually bounds waits for something another goroutine does; it is a
// hang guard, never a speed assertion.
const eventually = 20 * time.Second

// newTCP is a quiet TCP transport, with testSecret unless cfg names
// another (transports() covers the mode without one).
func newTCP(cfg TCPConfig) *TCP {
	cfg.Logger = quiet
	if cfg.Secret == "" {
		cfg.Secret = testSecret
	}
	return NewTCP(cfg)
}

func listenTCP(t *testing.T, tr *TCP, sink transport.Sink) *tcpReceiver {
	t.Helper()
	return listen(t, tr, "127.0.0.1:0", sink).(*tcpReceiver)
}

func dialRaw(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(eventually)))
	return c
}

// dialProven is dialRaw past the handshake, proven with testSecret.
func dialProven(t *testing.T, addr string) net.Conn {
	t.Helper()
	c := dialRaw(t, addr)
	proveRaw(t, c, testSecret)
	return c
}

func sendFrame(t *testing.T, c net.Conn, h Header, payload []byte) {
	t.Helper()
	_, err := c.Write(append(AppendHeader(nil, h), payload...))
	require.NoError(t, err)
}

func readAck(t *testing.T, c net.Conn) Ack {
	t.Helper()
	head := make([]byte, AckHeaderLen)
	_, err := io.ReadFull(c, head)
	require.NoError(t, err)
	n := binary.LittleEndian.Uint16(head[14:])
	msg := make([]byte, n)
	_, err = io.ReadFull(c, msg)
	require.NoError(t, err)
	a, err := DecodeAck(append(head, msg...))
	require.NoError(t, err)
	return a
}

func TestTCPRefusalsKeepTheConnection(t *testing.T) {
	sink := newMemSink(1 << 20)
	r := listenTCP(t, newTCP(TCPConfig{}), sink)
	res, tok := sink.reserve(t, 1000)
	gone, goneTok := sink.reserve(t, 1000)
	sink.markGone(gone)
	c := dialProven(t, r.Addr())

	cases := []struct {
		name      string
		h         Header
		want      transport.Status
		sinkCalls int
	}{
		{"offset+length overflows", Header{Res: res, Token: tok, Offset: ^uint64(0) - 10, Length: 100}, transport.StatusOutOfBounds, 0},
		{"offset past the end", Header{Res: res, Token: tok, Offset: 1000, Length: 1}, transport.StatusOutOfBounds, 1},
		{"length past the end", Header{Res: res, Token: tok, Offset: 1, Length: 1000}, transport.StatusOutOfBounds, 1},
		{"bad token", Header{Res: res, Token: ids.Token{9}, Length: 10}, transport.StatusBadToken, 1},
		{"zero token", Header{Res: res, Length: 10}, transport.StatusBadToken, 1},
		{"unknown res", Header{Res: 777, Token: tok, Length: 10}, transport.StatusUnknownRes, 1},
		{"gone", Header{Res: gone, Token: goneTok, Length: 10}, transport.StatusGone, 1},
		{"valid", Header{Res: res, Token: tok, Offset: 100, Length: 900}, transport.StatusOK, 1},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := sink.beginCount()
			tc.h.Seq = uint64(100 + i)
			payload := randBytes(uint64(i), int(tc.h.Length))
			sendFrame(t, c, tc.h, payload)
			a := readAck(t, c)
			require.Equal(t, tc.h.Seq, a.Seq, "the ack names the frame")
			require.Equal(t, tc.want, a.Status, a.Msg)
			require.Equal(t, tc.sinkCalls, sink.beginCount()-before)
			if tc.want == transport.StatusOK {
				require.Empty(t, a.Msg)
				require.Equal(t, payload, sink.region(res)[100:])
			} else {
				require.NotEmpty(t, a.Msg, "a refusal says why")
				require.NotContains(t, a.Msg, tok.String(), "the token never goes back on the wire")
			}
		})
	}
	st := r.Stats()
	require.Equal(t, map[string]uint64{"out_of_bounds": 3, "bad_token": 2, "unknown_res": 1, "gone": 1}, st.Rejected)
	require.Equal(t, uint64(1), st.Frames)
	require.Zero(t, st.BadConns)
	require.Equal(t, uint64(1), r.accepted.Load(), "every frame used the one connection")
}

func TestTCPGarbageClosesOnlyThatConnection(t *testing.T) {
	tr := newTCP(TCPConfig{})
	sink := newMemSink(1 << 20)
	r := listenTCP(t, tr, sink)
	w := newWriter(t, tr)
	res, tok := sink.reserve(t, 4096)
	check := func(seed uint64) {
		it := transport.WriteItem{Res: res, Token: tok, Src: randBytes(seed, 4096)}
		requireLanded(t, sink, []transport.WriteItem{it}, write(t, w, r.Addr(), it))
	}
	check(1)

	good := AppendHeader(nil, Header{Res: res, Token: tok, Length: 1})
	mutate := func(f func(b []byte)) []byte { return mutated(good, f) }
	cases := []struct {
		name string
		b    []byte
	}{
		{"text", []byte(strings.Repeat("GET / HTTP/1.1\r\n", 4))[:HeaderLen]},
		{"random", randBytes(99, HeaderLen)},
		{"ack instead of frame", append(AppendAck(nil, Ack{Seq: 1}), make([]byte, HeaderLen-AckHeaderLen)...)},
		{"future version", mutate(func(b []byte) { b[4] = 9 })},
		{"unknown flag set", mutate(func(b []byte) { b[5] = 2 })},
		{"reserved set", mutate(func(b []byte) { b[6] = 1 })},
		{"length over MaxFrame", mutate(func(b []byte) { binary.LittleEndian.PutUint64(b[48:], MaxFrame+1) })},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := dialProven(t, r.Addr())
			_, err := c.Write(tc.b)
			require.NoError(t, err)
			_, err = c.Read(make([]byte, 1))
			require.ErrorIs(t, err, io.EOF, "the receiver hangs up")
			require.Equal(t, uint64(i+1), r.Stats().BadConns)
			check(uint64(10 + i))
		})
	}

	t.Run("half a header then hang up", func(t *testing.T) {
		c := dialProven(t, r.Addr())
		_, err := c.Write(good[:10])
		require.NoError(t, err)
		require.NoError(t, c.Close())
		check(50)
	})
	require.Equal(t, 2+len(cases), sink.beginCount(), "only the writer's frames reached the sink")
}

func TestTCPWriterDiesMidPayload(t *testing.T) {
	sink := newMemSink(1 << 20)
	r := listenTCP(t, newTCP(TCPConfig{}), sink)
	res, tok := sink.reserve(t, 1000)
	c := dialProven(t, r.Addr())
	sendFrame(t, c, Header{Seq: 1, Res: res, Token: tok, Length: 1000}, randBytes(1, 400))
	require.NoError(t, c.Close())
	require.Eventually(t, func() bool { return len(sink.endsOf(res)) == 1 }, eventually, time.Millisecond)
	require.Equal(t, []bool{false}, sink.endsOf(res))
	require.Zero(t, r.Stats().Frames)
	require.Zero(t, r.Stats().BadConns, "a torn frame is a dead peer, not a bad one")
}

func TestTCPReceiverClosedMidWrite(t *testing.T) {
	tr := newTCP(TCPConfig{})
	sink := newGateSink(64 << 20)
	r, err := tr.Listen("127.0.0.1:0", sink)
	require.NoError(t, err)
	t.Cleanup(func() { sink.open(); _ = r.Close() })
	w := newWriter(t, tr)
	res, tok := sink.reserve(t, 32<<20)

	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	done := make(chan []error)
	go func() {
		done <- w.Write(ctx, r.Addr(), []transport.WriteItem{{Res: res, Token: tok, Src: randBytes(1, 32<<20)}})
	}()
	<-sink.began
	closed := make(chan struct{})
	go func() { _ = r.Close(); close(closed) }()

	errs := <-done
	// The item goes out over several connections: one that was writing
	// loses its connection, and one dialed only after the close is refused
	// (not redialed). Either ends the write with the receiver's closing,
	// whichever the writer reports first on a loaded machine.
	if !errors.Is(errs[0], transport.ErrConnLost) {
		require.ErrorIs(t, errs[0], transport.ErrUnreachable, "the write failed for the receiver's closing")
	}
	require.NoError(t, ctx.Err(), "Write returned because the connection broke, not because time ran out")
	require.Contains(t, errs[0].Error(), r.Addr())

	sink.open()
	<-closed
	sink.requireBalanced(t)
	require.NotContains(t, sink.endsOf(res), true)
}

func TestTCPWriteReturnsByDeadline(t *testing.T) {
	tr := newTCP(TCPConfig{})
	sink := newGateSink(64 << 20)
	r := listenTCP(t, tr, sink)
	t.Cleanup(sink.open)
	w := newWriter(t, tr)
	res, tok := sink.reserve(t, 32<<20)
	src := randBytes(1, 32<<20)

	// The deadline passes once the receiver holds the frame, so that the
	// writer is connected and inside it, whatever the machine's speed.
	ctx := transporttest.NewExpiring()
	done := make(chan []error)
	go func() { done <- w.Write(ctx, r.Addr(), []transport.WriteItem{{Res: res, Token: tok, Src: src}}) }()
	select {
	case <-sink.began:
	case <-time.After(testTimeout):
		t.Fatal("the receiver never began the frame")
	}
	ctx.Expire()
	errs := <-done
	require.ErrorIs(t, errs[0], context.DeadlineExceeded)
	require.Contains(t, errs[0].Error(), r.Addr())

	// The writer stays usable. A fresh reservation, because the torn frames
	// may still be draining into the old one.
	sink.open()
	res2, tok2 := sink.reserve(t, 32<<20)
	it := transport.WriteItem{Res: res2, Token: tok2, Src: src}
	requireLanded(t, sink.memSink, []transport.WriteItem{it}, write(t, w, r.Addr(), it))
}

func TestTCPCloseWithWritesInFlight(t *testing.T) {
	tr := newTCP(TCPConfig{})
	sink := newGateSink(64 << 20)
	r := listenTCP(t, tr, sink)
	t.Cleanup(sink.open)
	w := tr.NewWriter()
	res, tok := sink.reserve(t, 32<<20)

	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	done := make(chan []error)
	go func() {
		done <- w.Write(ctx, r.Addr(), []transport.WriteItem{{Res: res, Token: tok, Src: randBytes(1, 32<<20)}, {Res: res, Token: tok, Src: []byte{1}}})
	}()
	<-sink.began
	require.NoError(t, w.Close())
	for _, err := range <-done {
		require.ErrorIs(t, err, transport.ErrClosed)
	}
	require.NoError(t, ctx.Err())
	require.NoError(t, w.Close())

	sink.open()
	require.NoError(t, r.Close())
	sink.requireBalanced(t)
}

func TestTCPChunksSpreadOverThePool(t *testing.T) {
	const chunk = 1 << 20
	tr := newTCP(TCPConfig{Conns: 4, ChunkSize: chunk})
	sink := newMemSink(32 << 20)
	r := listenTCP(t, tr, sink)
	w := newWriter(t, tr)

	big, bigTok := sink.reserve(t, 4*chunk)
	it := transport.WriteItem{Res: big, Token: bigTok, Src: randBytes(1, 4*chunk)}
	requireLanded(t, sink, []transport.WriteItem{it}, write(t, w, r.Addr(), it))
	var offs []uint64
	for _, b := range sink.beginsOf(big) {
		require.Equal(t, uint64(chunk), b.n)
		offs = append(offs, b.off)
	}
	require.ElementsMatch(t, []uint64{0, chunk, 2 * chunk, 3 * chunk}, offs)
	require.Equal(t, uint64(4), r.accepted.Load(), "the four chunks took the four connections")

	var items []transport.WriteItem
	for i := range 20 {
		res, tok := sink.reserve(t, chunk/2)
		items = append(items, transport.WriteItem{Res: res, Token: tok, Src: randBytes(uint64(i), chunk/2)})
	}
	requireLanded(t, sink, items, write(t, w, r.Addr(), items...))
	require.Equal(t, uint64(4), r.accepted.Load(), "connections persist between writes")
}

func TestTCPRedialsAfterThePeerDrops(t *testing.T) {
	tr := newTCP(TCPConfig{Conns: 1})
	sink := newMemSink(1 << 20)
	r := listenTCP(t, tr, sink)
	w := newWriter(t, tr).(*tcpWriter)
	res, tok := sink.reserve(t, 1000)
	it := transport.WriteItem{Res: res, Token: tok, Src: randBytes(1, 1000)}
	requireLanded(t, sink, []transport.WriteItem{it}, write(t, w, r.Addr(), it))

	r.mu.Lock()
	for c := range r.conns {
		_ = c.Close()
	}
	r.mu.Unlock()
	require.Eventually(t, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return len(w.conns) == 0
	}, eventually, time.Millisecond, "the writer notices the dropped connection")

	it.Src = randBytes(2, 1000)
	requireLanded(t, sink, []transport.WriteItem{it}, write(t, w, r.Addr(), it))
	require.Equal(t, uint64(2), r.accepted.Load(), "the one slot dialed again")
}

func TestTCPListenAddresses(t *testing.T) {
	cases := []struct {
		name, listen string
		dest         func(addr string) string
	}{
		{"ipv4", "127.0.0.1:0", func(a string) string { return a }},
		{"ipv6", "[::1]:0", func(a string) string { return a }},
		{"hostname", "localhost:0", func(a string) string {
			_, port, _ := net.SplitHostPort(a)
			return net.JoinHostPort("localhost", port)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tr := newTCP(TCPConfig{})
			sink := newMemSink(1 << 20)
			r, err := tr.Listen(tc.listen, sink)
			if err != nil && tc.name == "ipv6" {
				t.Skipf("no IPv6 loopback here: %v", err)
			}
			require.NoError(t, err)
			t.Cleanup(func() { _ = r.Close() })
			w := newWriter(t, tr)
			res, tok := sink.reserve(t, 5000)
			it := transport.WriteItem{Res: res, Token: tok, Src: randBytes(1, 5000)}
			requireLanded(t, sink, []transport.WriteItem{it}, write(t, w, tc.dest(r.Addr()), it))
		})
	}
}

func TestTCPListenErrors(t *testing.T) {
	tr := newTCP(TCPConfig{})
	_, err := tr.Listen("127.0.0.1:0", nil)
	require.Error(t, err)
	_, err = tr.Listen("256.0.0.1:0", newMemSink(1))
	require.ErrorContains(t, err, "256.0.0.1:0")
}

func TestNewTCPDefaults(t *testing.T) {
	cases := []struct {
		in   TCPConfig
		want TCPConfig
	}{
		{TCPConfig{}, TCPConfig{Conns: DefaultConns, ChunkSize: DefaultChunkSize, DialTimeout: DefaultDialTimeout,
			MaxConns: DefaultMaxConns, IdleTimeout: DefaultIdleTimeout, FrameTimeout: DefaultFrameTimeout,
			HandshakeTimeout: DefaultHandshakeTimeout, MaxUnproven: DefaultMaxUnproven}},
		{TCPConfig{Conns: 2, ChunkSize: 2 * MaxFrame, DialTimeout: time.Second, SocketBuffer: 1 << 20, MaxConns: 3, IdleTimeout: time.Minute, FrameTimeout: time.Second},
			TCPConfig{Conns: 2, ChunkSize: MaxFrame, DialTimeout: time.Second, SocketBuffer: 1 << 20, MaxConns: 3, IdleTimeout: time.Minute, FrameTimeout: time.Second,
				HandshakeTimeout: DefaultHandshakeTimeout, MaxUnproven: DefaultMaxUnproven}},
	}
	for _, tc := range cases {
		got := NewTCP(tc.in).cfg
		require.NotNil(t, got.Logger)
		got.Logger = nil
		require.Equal(t, tc.want, got)
	}
}

// transportGoroutines lists live goroutines running this package's
// methods or the shared accept loop's (test goroutines run plain
// functions and do not match).
func transportGoroutines() []string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "core/transport/tcp.(*") || strings.Contains(g, "core/transport/internal/serve.(*") {
			out = append(out, g)
		}
	}
	return out
}

func TestTCPNoGoroutineLeftAfterClose(t *testing.T) {
	tr := newTCP(TCPConfig{SocketBuffer: 1 << 20})
	sink := newMemSink(32 << 20)
	r, err := tr.Listen("127.0.0.1:0", sink)
	require.NoError(t, err)
	w := tr.NewWriter()
	res, tok := sink.reserve(t, 16<<20)
	it := transport.WriteItem{Res: res, Token: tok, Src: randBytes(1, 16<<20)}
	requireLanded(t, sink, []transport.WriteItem{it}, write(t, w, r.Addr(), it))
	errs := write(t, w, r.Addr(), transport.WriteItem{Res: res, Token: ids.Token{1}, Src: []byte{1}})
	require.ErrorIs(t, errs[0], transport.ErrBadToken)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	w.Write(ctx, r.Addr(), []transport.WriteItem{it})
	raw := dialProven(t, r.Addr())
	_, err = raw.Write([]byte("garbage"))
	require.NoError(t, err)

	require.NotEmpty(t, transportGoroutines())
	require.NoError(t, w.Close())
	require.NoError(t, r.Close())
	require.Eventually(t, func() bool { return len(transportGoroutines()) == 0 }, eventually, time.Millisecond,
		"left behind: %v", transportGoroutines())
	sink.requireBalanced(t)
}

// fakeReceiver accepts one connection, reads one frame and answers with
// reply, standing in for a receiver that speaks the protocol wrongly.
func fakeReceiver(t *testing.T, reply func(h Header) []byte) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	t.Cleanup(func() { _ = ln.Close(); <-done })
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		if _, err := c.Write(AppendChallenge(nil, Challenge{Mode: ModeSecret})); err != nil {
			return
		}
		if _, err := io.ReadFull(c, make([]byte, PreambleLen)); err != nil {
			return
		}
		hb := make([]byte, HeaderLen)
		if _, err := io.ReadFull(c, hb); err != nil {
			return
		}
		h, err := DecodeHeader(hb)
		if err != nil {
			return
		}
		if _, err := io.CopyN(io.Discard, c, int64(h.Length)); err != nil {
			return
		}
		b := reply(h)
		if len(b) == 0 {
			return
		}
		_, _ = c.Write(b)
		_, _ = io.Copy(io.Discard, c)
	}()
	return ln.Addr().String()
}

func TestTCPWriterRefusesBadAcks(t *testing.T) {
	cases := []struct {
		name  string
		reply func(h Header) []byte
		want  error
	}{
		{"not an ack", func(Header) []byte { return []byte("HTTP/1.1 400 Bad Request\r\n\r\n") }, transport.ErrBadFrame},
		{"ack for another frame", func(h Header) []byte { return AppendAck(nil, Ack{Seq: h.Seq + 1}) }, transport.ErrBadFrame},
		{"hang up without an ack", func(Header) []byte { return nil }, transport.ErrConnLost},
		{"unknown status", func(h Header) []byte { return AppendAck(nil, Ack{Seq: h.Seq, Status: 4242, Msg: "new"}) }, transport.ErrRejected},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			addr := fakeReceiver(t, tc.reply)
			w := newWriter(t, newTCP(TCPConfig{Conns: 1}))
			errs := write(t, w, addr, transport.WriteItem{Res: 1, Token: ids.Token{1}, Src: []byte("payload")})
			require.ErrorIs(t, errs[0], tc.want)
			require.Contains(t, errs[0].Error(), addr)
		})
	}
}

// panicSink panics on one reservation and behaves on the others.
type panicSink struct {
	*memSink
	bad ids.ResID
}

func (p panicSink) BeginWrite(res ids.ResID, tok ids.Token, off, n uint64) ([]byte, error) {
	if res == p.bad {
		panic("sink bug")
	}
	return p.memSink.BeginWrite(res, tok, off, n)
}

func TestTCPSinkPanicCostsOnlyTheConnection(t *testing.T) {
	tr := newTCP(TCPConfig{Conns: 1})
	sink := panicSink{memSink: newMemSink(1 << 20), bad: 999}
	r := listenTCP(t, tr, sink)
	w := newWriter(t, tr)
	errs := write(t, w, r.Addr(), transport.WriteItem{Res: 999, Token: ids.Token{1}, Src: []byte("boom")})
	require.ErrorIs(t, errs[0], transport.ErrConnLost)

	res, tok := sink.reserve(t, 100)
	it := transport.WriteItem{Res: res, Token: tok, Src: randBytes(1, 100)}
	require.Eventually(t, func() bool {
		return write(t, w, r.Addr(), it)[0] == nil
	}, eventually, time.Millisecond, "the receiver keeps serving")
	require.True(t, bytes.Equal(it.Src, sink.region(res)))
}
