package consumer

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/fsm/reserve"
	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// oneSided is a one-sided data plane that keeps the sink it was given,
// so that a test can complete writes as cuda_ipc's receiver does when a
// ready word appears.
type oneSided struct{ sink transport.Sink }

func (o *oneSided) Name() string                { return "one_sided" }
func (o *oneSided) NewWriter() transport.Writer { return nil }
func (o *oneSided) Listen(_ string, sink transport.Sink) (transport.Receiver, error) {
	o.sink = sink
	return oneSidedRecv{}, nil
}

type oneSidedRecv struct{}

func (oneSidedRecv) Addr() string                     { return "one-sided" }
func (oneSidedRecv) Close() error                     { return nil }
func (oneSidedRecv) Stats() transport.RecvStats       { return transport.RecvStats{} }
func (oneSidedRecv) RemoteAddr(slabOff uint64) uint64 { return 1<<40 + slabOff }

// TestRemoteCompleteIsReadyOnce: a one-sided write completed by its
// receiver (CompleteRemote) makes the region ready and publishes its
// readiness once; the token must be the grant's, a second completion is
// refused, and a complete message after it publishes nothing more.
func TestRemoteCompleteIsReadyOnce(t *testing.T) {
	ctl := control.NewInmemNetwork()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	cfg := config.DefaultConsumer()
	cfg.AllowUnauthenticated = true
	plane := &oneSided{}
	shard, err := Open(cfg, slab.HostMemory(make([]byte, 1<<20)), Options{Transport: plane, Log: log, Links: ctl.Links("shard-0")})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, shard.Close()) })
	caller, err := ctl.Links("producer").Dial(shard.Info().Control, log)
	require.NoError(t, err)
	t.Cleanup(func() { _ = caller.Close() })
	sub, err := ctl.Links("scheduler").Subscribe(log)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	require.NoError(t, sub.Connect(shard.Info().Events))

	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	var grants wire.ReserveBatchReply
	require.NoError(t, caller.Call(ctx, wire.OpReserveBatch, wire.ReserveBatch{Requester: fmt.Sprintf("%032x", 1),
		Items: []wire.ReserveItem{{TransferID: "t0", MMHash: "h0", NBytes: 4096}}}, &grants))
	g := grants.Grants[0]
	require.Empty(t, g.Err)
	require.NotZero(t, g.Addr, "a one-sided grant names the region")
	rs := plane.sink.(transport.RemoteSink)
	res := ids.ResID(g.Res)

	until, err := rs.WatchRemote(res, g.Token)
	require.NoError(t, err)
	require.True(t, until.After(time.Now().Add(cfg.Lease())), "watched until the shard's writer grace ends")
	_, err = rs.WatchRemote(res, ids.Token{1})
	require.ErrorIs(t, err, transport.ErrBadToken)
	_, err = rs.WatchRemote(res+100, g.Token)
	require.ErrorIs(t, err, transport.ErrUnknownRes)
	require.ErrorIs(t, rs.CompleteRemote(res, ids.Token{1}), transport.ErrBadToken)
	require.Zero(t, shard.Stats().Table.Completed, "a wrong token completes nothing")

	require.NoError(t, rs.CompleteRemote(res, g.Token))
	select {
	case msg := <-sub.Events():
		require.Len(t, msg, 1)
		require.True(t, msg[0].Ready)
		require.Equal(t, "t0", msg[0].TransferID)
	case <-time.After(hang):
		t.Fatal("no readiness event arrived")
	}
	require.ErrorIs(t, rs.CompleteRemote(res, g.Token), transport.ErrUnknownRes, "the write is no longer open")
	var rep wire.CompleteBatchReply
	require.NoError(t, caller.Call(ctx, wire.OpCompleteBatch, wire.CompleteBatch{Items: []wire.CompleteItem{{TransferID: "t0", Res: g.Res, Token: g.Token}}}, &rep))
	require.Empty(t, rep.Results[0].Err, "a complete after it is a no-op")
	require.EqualValues(t, 1, shard.Stats().Table.Completed)
	// The shard publishes before it answers: a second event would be
	// counted by now.
	require.EqualValues(t, 1, shard.Stats().Events.Sent, "readiness published once")
}

// TestRemoteWriteWithoutItsWordEndsByTheGrace: a one-sided write whose
// ready word never comes (its producer died after announcing it) is not
// completed, nor is its region reused, until the shard's writer grace
// ends it; then it can no longer be watched nor completed.
func TestRemoteWriteWithoutItsWordEndsByTheGrace(t *testing.T) {
	ctl := control.NewInmemNetwork()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	cfg := config.DefaultConsumer()
	cfg.AllowUnauthenticated = true
	cfg.LeaseS = 0.05
	plane := &oneSided{}
	shard, err := Open(cfg, slab.HostMemory(make([]byte, 1<<20)), Options{Transport: plane, Log: log, Links: ctl.Links("shard-0")})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, shard.Close()) })
	caller, err := ctl.Links("producer").Dial(shard.Info().Control, log)
	require.NoError(t, err)
	t.Cleanup(func() { _ = caller.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	var grants wire.ReserveBatchReply
	require.NoError(t, caller.Call(ctx, wire.OpReserveBatch, wire.ReserveBatch{Requester: fmt.Sprintf("%032x", 1),
		Items: []wire.ReserveItem{{TransferID: "t0", MMHash: "h0", NBytes: 4096}}}, &grants))
	g := grants.Grants[0]
	rs := plane.sink.(transport.RemoteSink)
	res := ids.ResID(g.Res)
	_, err = rs.WatchRemote(res, g.Token)
	require.NoError(t, err)
	// The region's lease runs out first: it stays, being written, for
	// bytes that may still land.
	require.Eventually(t, func() bool { return shard.Stats().Table.Regions[reserve.ExpirePending] == 1 }, hang, time.Millisecond)
	// Then the writer grace ends the write and the memory returns.
	require.Eventually(t, func() bool {
		r := shard.Stats().Table.Regions
		return r[reserve.ExpirePending] == 0 && r[reserve.Writing] == 0
	}, hang, time.Millisecond)
	_, err = rs.WatchRemote(res, g.Token)
	require.ErrorIs(t, err, transport.ErrUnknownRes, "a receiver stops watching it")
	require.Error(t, rs.CompleteRemote(res, g.Token))
	require.Zero(t, shard.Stats().Table.Completed)
}
