package gotests

import (
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/fsm/reserve"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/tcp"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// frameConn is a raw data connection to a shard that sends frames by hand.
type frameConn struct {
	t   *testing.T
	c   net.Conn
	seq uint64
}

func dialFrames(t *testing.T, addr string) *frameConn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	proveByGrant(t, c)
	return &frameConn{t: t, c: c}
}

// send writes one frame of g's region, [off, off+n) filled with fill.
func (f *frameConn) send(g wire.Grant, tok ids.Token, off, n uint64, complete bool, fill byte) {
	f.t.Helper()
	f.seq++
	b := tcp.AppendHeader(nil, tcp.Header{Seq: f.seq, Res: ids.ResID(g.Res), Token: tok, Offset: off, Length: n, Complete: complete})
	payload := make([]byte, n)
	for i := range payload {
		payload[i] = fill
	}
	_, err := f.c.Write(append(b, payload...))
	require.NoError(f.t, err)
}

// ack reads the next ack.
func (f *frameConn) ack() tcp.Ack {
	f.t.Helper()
	require.NoError(f.t, f.c.SetReadDeadline(time.Now().Add(hang)))
	head := make([]byte, tcp.AckHeaderLen)
	_, err := io.ReadFull(f.c, head)
	require.NoError(f.t, err)
	msg := make([]byte, binary.LittleEndian.Uint16(head[14:]))
	_, err = io.ReadFull(f.c, msg)
	require.NoError(f.t, err)
	a, err := tcp.DecodeAck(append(head, msg...))
	require.NoError(f.t, err)
	return a
}

// Frames that carry their item's completion make it ready at the shard as
// the last byte lands, in whatever order the frames come; the ack of the
// frame that completed it comes after.
func TestTCPFramesCompleteTheItemInBand(t *testing.T) {
	s, cl := tcpShard(t, 30, func(c *config.Consumer) {})
	g := reserveOne(t, cl, "t-inband", 8192)
	f := dialFrames(t, s.Info().Data)
	f.send(g, g.Token, 4096, 4096, true, 2)
	require.Equal(t, transport.StatusOK, f.ack().Status)
	require.Zero(t, s.Stats().Table.Completed, "half the bytes landed")
	f.send(g, g.Token, 0, 4096, true, 1)
	require.Equal(t, transport.StatusOK, f.ack().Status)
	st := s.Stats()
	require.Equal(t, uint64(1), st.Table.Completed, "completed by its last frame, before its ack")
	require.Equal(t, 1, st.Table.Regions[reserve.Ready])
	loaded := s.Acquire([]string{"h-t-inband"})
	require.Empty(t, loaded[0].Error)
	require.Equal(t, uint64(8192), loaded[0].NBytes)
}

// Hostile frames: a replayed frame cannot stand in for bytes that never
// came (the region stays unready, the refusal is counted and reaches the
// writer), a frame replayed after completion is refused, and another
// region's token is refused before any byte lands.
func TestTCPInBandRefusesReplayAndForgery(t *testing.T) {
	s, cl := tcpShard(t, 30, func(c *config.Consumer) {})
	g := reserveOne(t, cl, "t-replay", 8192)
	other := reserveOne(t, cl, "t-other", 8192)
	f := dialFrames(t, s.Info().Data)

	f.send(g, g.Token, 0, 4096, true, 1)
	require.Equal(t, transport.StatusOK, f.ack().Status)
	f.send(g, other.Token, 4096, 4096, true, 9)
	require.Equal(t, transport.StatusBadToken, f.ack().Status)
	f.send(g, g.Token, 0, 4096, true, 1) // the first half, twice
	a := f.ack()
	require.NotEqual(t, transport.StatusOK, a.Status, "a replay is refused: %s", a.Msg)
	require.Contains(t, a.Msg, "torn")
	f.send(g, g.Token, 4096, 4096, true, 2)
	require.NotEqual(t, transport.StatusOK, f.ack().Status, "the rest cannot complete a torn region")
	st := s.Stats()
	require.Zero(t, st.Table.Completed)
	require.Equal(t, uint64(1), st.Table.InBandRefused)
	require.NotEmpty(t, s.Acquire([]string{"h-t-replay"})[0].Error, "nothing with a hole is ever loaded")

	f.send(g, g.Token, 0, 8192, true, 3) // one whole write mends it
	require.Equal(t, transport.StatusOK, f.ack().Status)
	require.Equal(t, uint64(1), s.Stats().Table.Completed)
	f.send(g, g.Token, 0, 8192, true, 4) // replayed after completion
	require.Equal(t, transport.StatusGone, f.ack().Status)
	require.Equal(t, uint64(1), s.Stats().Table.Completed)
}

// A producer killed between its frames: what landed completes nothing, and
// the lease gives the region back.
func TestTCPInBandWriterKilledBetweenFrames(t *testing.T) {
	s, cl := tcpShard(t, 0.5, func(c *config.Consumer) {})
	g := reserveOne(t, cl, "t-killed", 8192)
	f := dialFrames(t, s.Info().Data)
	f.send(g, g.Token, 0, 4096, true, 1)
	require.Equal(t, transport.StatusOK, f.ack().Status)
	require.NoError(t, f.c.Close())
	require.Eventually(t, func() bool {
		st := s.Stats()
		return st.InUse == 0 && st.Table.Expired == 1 && st.Table.Regions[reserve.Writing] == 0
	}, hang, time.Millisecond, "the lease reclaims the region")
	require.Zero(t, s.Stats().Table.Completed)
}
