package gotests

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/fsm/reserve"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/node"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/tcp"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// tcpShard opens a consumer shard on the TCP data plane with the bounds
// that bound sets, and a control client to it.
func tcpShard(t *testing.T, lease float64, bound func(*config.Consumer)) (*node.Consumer, *control.Client) {
	t.Helper()
	cfg := config.DefaultConsumer()
	cfg.Port, cfg.LeaseS = freeBase(t, 1), lease
	bound(&cfg)
	s, err := node.OpenConsumer(cfg, make([]byte, 1<<20), node.Options{Log: quietLog()})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	t.Cleanup(func() { zctx.Term() })
	cl, err := control.Dial(zctx, s.Info().Control, quietLog())
	require.NoError(t, err)
	t.Cleanup(func() { cl.Close() })
	return s, cl
}

func reserveOne(t *testing.T, cl *control.Client, tid string, n uint64) wire.Grant {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	var rep wire.ReserveBatchReply
	require.NoError(t, cl.Call(ctx, wire.OpReserveBatch, wire.ReserveBatch{Requester: victimID, Items: []wire.ReserveItem{{TransferID: tid, MMHash: "h-" + tid, NBytes: n}}}, &rep))
	require.Equal(t, wire.KindWrite, rep.Grants[0].Kind, rep.Grants[0].Err)
	return rep.Grants[0]
}

// A producer that sends half a frame and stalls (or is stopped) must not
// hold its region for ever: the frame deadline tears the frame, and the
// lease then reclaims the region.
func TestTCPStalledFrameIsReclaimed(t *testing.T) {
	s, cl := tcpShard(t, 0.5, func(c *config.Consumer) { c.DataFrameTimeoutS = 0.1 })
	g := reserveOne(t, cl, "t-stall", 64<<10)

	c, err := net.Dial("tcp", s.Info().Data)
	require.NoError(t, err)
	defer c.Close()
	proveByGrant(t, c)
	hdr := tcp.AppendHeader(nil, tcp.Header{Seq: 1, Res: ids.ResID(g.Res), Token: g.Token, Length: 64 << 10})
	_, err = c.Write(append(hdr, make([]byte, 1000)...))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return s.Stats().Table.WritesInFlight == 1 }, hang, time.Millisecond,
		"the half frame is in flight")

	require.Eventually(t, func() bool {
		st := s.Stats()
		return st.Data.Closed["frame_timeout"] == 1 && st.Table.WritesInFlight == 0
	}, hang, time.Millisecond, "the stalled frame is abandoned")
	require.Eventually(t, func() bool {
		st := s.Stats()
		return st.InUse == 0 && st.Table.Expired == 1 && st.Table.Regions[reserve.Writing] == 0
	}, hang, time.Millisecond, "the lease reclaims the region")
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err = c.Read(make([]byte, 1))
	require.Error(t, err, "the stalled connection is closed")
	text, err := metrics.Text(nil)
	require.NoError(t, err)
	require.Regexp(t, `(?m)^ecm_data_conns_closed_total\{object="consumer:[0-9]+",reason="frame_timeout"\} 1$`, string(text))
}

// proveByGrant answers a shard's challenge as a writer without a secret
// does: the first frame, sent next, is the proof.
func proveByGrant(t *testing.T, c net.Conn) {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	b := make([]byte, tcp.ChallengeLen)
	_, err := io.ReadFull(c, b)
	require.NoError(t, err, "the shard opens with a challenge")
	ch, err := tcp.DecodeChallenge(b)
	require.NoError(t, err)
	require.Equal(t, tcp.ModeGrant, ch.Mode, "a shard without a secret asks for a live grant")
	_, err = c.Write(tcp.AppendPreamble(nil, tcp.Preamble{Mode: tcp.ModeGrant}))
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Time{}))
}

// Connections that send nothing cannot lock a producer out: until they
// prove themselves they hold places of their own, never a proven
// connection's, and lose them at the handshake deadline.
func TestTCPIdleConnectionsDoNotLockOutAProducer(t *testing.T) {
	s, cl := tcpShard(t, 30, func(c *config.Consumer) { c.MaxDataConns = 4 })
	var idle []net.Conn
	for range 12 {
		c, err := net.Dial("tcp", s.Info().Data)
		require.NoError(t, err)
		defer c.Close()
		idle = append(idle, c)
	}
	g := reserveOne(t, cl, "t-legit", 768<<10)
	w := tcp.NewTCP(tcp.TCPConfig{Conns: 4, ChunkSize: 128 << 10, Logger: quietLog()}).NewWriter()
	defer w.Close()
	src := make([]byte, 768<<10)
	for i := range src {
		src[i] = byte(i * 13)
	}
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	errs := w.Write(ctx, s.Info().Data, []transport.WriteItem{{Res: ids.ResID(g.Res), Token: g.Token, Src: src}})
	require.NoError(t, errs[0])
	require.Equal(t, uint64(768<<10), s.Stats().Data.Bytes)
	require.Eventually(t, func() bool { return s.Stats().Data.Closed["handshake_timeout"] == uint64(len(idle)) }, 30*time.Second, 10*time.Millisecond,
		"every silent connection loses its place at the handshake deadline")
}
