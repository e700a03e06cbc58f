package tcp

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/stretchr/testify/require"
)

// A connection with no frame for IdleTimeout gets a goodbye, then EOF.
func TestTCPIdleConnectionGetsAGoodbye(t *testing.T) {
	r := listenTCP(t, newTCP(TCPConfig{IdleTimeout: 20 * time.Millisecond}), newMemSink(1<<10))
	c := dialProven(t, r.Addr())
	a := readAck(t, c)
	require.Equal(t, Ack{Seq: 0, Status: transport.StatusClosing, Msg: transport.ClosedIdle}, a)
	_, err := c.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)
	require.Equal(t, map[string]uint64{transport.ClosedIdle: 1}, r.Stats().Closed)
}

// A writer whose pooled connections the receiver closed as idle writes on
// new ones, without failing an item.
func TestTCPWriterOutlivesIdleCloses(t *testing.T) {
	sink := newMemSink(1 << 20)
	r := listenTCP(t, newTCP(TCPConfig{IdleTimeout: 20 * time.Millisecond}), sink)
	w := newTCP(TCPConfig{Conns: 2, ChunkSize: 64 << 10}).NewWriter()
	defer w.Close()
	for round := range 3 {
		res, tok := sink.reserve(t, 256<<10)
		src := randBytes(uint64(round), 256<<10)
		ctx, cancel := context.WithTimeout(context.Background(), eventually)
		require.NoError(t, w.Write(ctx, r.Addr(), []transport.WriteItem{{Res: res, Token: tok, Src: src}})[0], "round %d", round)
		cancel()
		require.Equal(t, src, sink.region(res))
		require.Eventually(t, func() bool { return r.Stats().Closed[transport.ClosedIdle] >= uint64(2*(round+1)) }, eventually, time.Millisecond,
			"both pooled connections idled out")
	}
	sink.requireBalanced(t)
}

// A half frame, then silence: the frame ends torn after FrameTimeout, and
// the connection with it.
func TestTCPStalledFrameEndsTorn(t *testing.T) {
	sink := newMemSink(1 << 20)
	r := listenTCP(t, newTCP(TCPConfig{FrameTimeout: 20 * time.Millisecond}), sink)
	res, tok := sink.reserve(t, 64<<10)
	c := dialProven(t, r.Addr())
	sendFrame(t, c, Header{Seq: 1, Res: res, Token: tok, Length: 64 << 10}, make([]byte, 1000))
	_, err := c.Read(make([]byte, 1))
	require.Error(t, err, "closed without an ack")
	require.Eventually(t, func() bool { return len(sink.endsOf(res)) == 1 }, eventually, time.Millisecond)
	require.Equal(t, []bool{false}, sink.endsOf(res))
	require.Equal(t, uint64(1), r.Stats().Closed[transport.ClosedFrameTimeout])

	// Half a header stalls the same way, and never reaches the sink.
	c = dialProven(t, r.Addr())
	_, err = c.Write(AppendHeader(nil, Header{Seq: 1, Res: res, Token: tok, Length: 1})[:10])
	require.NoError(t, err)
	_, err = c.Read(make([]byte, 1))
	require.Error(t, err)
	require.Equal(t, uint64(2), r.Stats().Closed[transport.ClosedFrameTimeout])
	require.Len(t, sink.beginsOf(res), 1)
	sink.requireBalanced(t)
}

// At MaxConns a newcomer takes the idlest connection's slot; when every
// connection has a frame in flight it is closed at once.
func TestTCPConnectionCap(t *testing.T) {
	sink := newMemSink(1 << 20)
	r := listenTCP(t, newTCP(TCPConfig{MaxConns: 2}), sink)
	res, tok := sink.reserve(t, 64<<10)
	res2, tok2 := sink.reserve(t, 64<<10)

	// The receiver checks each preamble on a goroutine of its own, so two
	// connections proven back to back may count in either order: each is
	// waited for, so that first is the idlest.
	first := dialProven(t, r.Addr())
	waitProven(t, r, 1)
	second := dialProven(t, r.Addr())
	waitProven(t, r, 2)
	third := dialProven(t, r.Addr())
	a := readAck(t, first)
	require.Equal(t, Ack{Seq: 0, Status: transport.StatusClosing, Msg: transport.ClosedEvicted}, a, "the idlest one makes room")
	require.Equal(t, map[string]uint64{transport.ClosedEvicted: 1}, r.Stats().Closed)

	// Both slots busy: half frames in flight.
	sendFrame(t, second, Header{Seq: 1, Res: res, Token: tok, Length: 64 << 10}, make([]byte, 10))
	sendFrame(t, third, Header{Seq: 1, Res: res2, Token: tok2, Length: 64 << 10}, make([]byte, 10))
	require.Eventually(t, func() bool { return len(sink.beginsOf(res)) == 1 && len(sink.beginsOf(res2)) == 1 }, eventually, time.Millisecond)
	fourth := dialProven(t, r.Addr())
	requireRefused(t, fourth, true, "max_data_conns")
	require.Equal(t, uint64(1), r.Stats().Closed[transport.ClosedLimit])

	// A slot that frees up serves the next one.
	_, err := second.Write(make([]byte, 64<<10-10))
	require.NoError(t, err)
	require.Equal(t, transport.StatusOK, readAck(t, second).Status)
	fifth := dialProven(t, r.Addr())
	sendFrame(t, fifth, Header{Seq: 7, Res: res, Token: tok, Offset: 8, Length: 8}, make([]byte, 8))
	require.Equal(t, Ack{Seq: 7, Status: transport.StatusOK}, readAck(t, fifth))
}

// goodbyeFirst passes every connection but the first to the receiver; the
// first it answers, once a frame's bytes arrive, with a goodbye, as a
// receiver that evicts it just then would.
type goodbyeFirst struct {
	net.Listener
	first chan net.Conn
}

func (l *goodbyeFirst) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	select {
	case l.first <- c:
		go func() {
			defer c.Close()
			_, _ = c.Write(AppendChallenge(nil, Challenge{Mode: ModeSecret}))
			if _, err := io.ReadFull(c, make([]byte, PreambleLen+HeaderLen)); err != nil {
				return
			}
			_, _ = c.Write(AppendAck(nil, Ack{Seq: 0, Status: transport.StatusClosing, Msg: transport.ClosedEvicted}))
			_ = c.(*net.TCPConn).CloseWrite()
			_, _ = io.Copy(io.Discard, c)
		}()
		return l.Accept()
	default:
		return c, nil
	}
}

// Frames a receiver said goodbye to, unbegun, go out again on a new
// connection: the item lands whole and the writer reports no error.
func TestTCPWriterResendsAfterAGoodbye(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	sink := newMemSink(1 << 20)
	r := newTCPReceiver(&goodbyeFirst{Listener: ln, first: make(chan net.Conn, 1)}, sink, newTCP(TCPConfig{}).cfg)
	defer r.Close()
	w := newTCP(TCPConfig{Conns: 1, ChunkSize: 64 << 10}).NewWriter()
	defer w.Close()
	res, tok := sink.reserve(t, 256<<10)
	src := randBytes(9, 256<<10)
	ctx, cancel := context.WithTimeout(context.Background(), eventually)
	defer cancel()
	require.NoError(t, w.Write(ctx, r.Addr(), []transport.WriteItem{{Res: res, Token: tok, Src: src}})[0])
	require.Equal(t, src, sink.region(res))
	require.Len(t, sink.beginsOf(res), 4, "each chunk began once, on the second connection")
	sink.requireBalanced(t)
}

// waitProven waits until the receiver holds n proven connections.
func waitProven(t *testing.T, r *tcpReceiver, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.proven == n
	}, eventually, time.Millisecond, "%d proven connections", n)
}
