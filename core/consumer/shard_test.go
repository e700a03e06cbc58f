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
	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// hang bounds every wait: events normally take microseconds.
const hang = 60 * time.Second

// rig is one shard over in-memory links and data plane, a producer's
// control client of it and a scheduler's subscription to its events.
type rig struct {
	shard  *Shard
	caller control.Caller
	sub    control.Subscriber
	writer transport.Writer
}

func newRig(t *testing.T) *rig {
	t.Helper()
	ctl, data := control.NewInmemNetwork(), transport.NewInmemNetwork()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	mem := make([]byte, 4<<20)
	cfg := config.DefaultConsumer()
	cfg.AllowUnauthenticated = true
	cfg.DataPort = 7000
	shard, err := Open(cfg, slab.HostMemory(mem), Options{Transport: transport.NewInmem(data), Log: log, Links: ctl.Links("shard-0")})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, shard.Close()) })
	caller, err := ctl.Links("producer").Dial(shard.Info().Control, log)
	require.NoError(t, err)
	t.Cleanup(func() { _ = caller.Close() })
	sub, err := ctl.Links("scheduler").Subscribe(log)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	require.NoError(t, sub.Connect(shard.Info().Events))
	w := transport.NewInmem(data).NewWriter()
	t.Cleanup(func() { _ = w.Close() })
	return &rig{shard: shard, caller: caller, sub: sub, writer: w}
}

// pushBatch reserves, writes and completes n items in one batch each.
func (r *rig) pushBatch(t *testing.T, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	rb := wire.ReserveBatch{Requester: fmt.Sprintf("%032x", 1)}
	for i := range n {
		rb.Items = append(rb.Items, wire.ReserveItem{TransferID: fmt.Sprintf("t%d", i), MMHash: fmt.Sprintf("h%d", i), NBytes: 4096})
	}
	var grants wire.ReserveBatchReply
	require.NoError(t, r.caller.Call(ctx, wire.OpReserveBatch, rb, &grants))
	require.Len(t, grants.Grants, n)
	var items []transport.WriteItem
	var cb wire.CompleteBatch
	for _, g := range grants.Grants {
		require.Empty(t, g.Err)
		items = append(items, transport.WriteItem{Res: ids.ResID(g.Res), Token: g.Token, Src: make([]byte, g.NBytes)})
		cb.Items = append(cb.Items, wire.CompleteItem{TransferID: g.TransferID, Res: g.Res, Token: g.Token})
	}
	for _, err := range r.writer.Write(ctx, r.shard.Info().Data, items) {
		require.NoError(t, err)
	}
	var rep wire.CompleteBatchReply
	require.NoError(t, r.caller.Call(ctx, wire.OpCompleteBatch, cb, &rep))
	for _, res := range rep.Results {
		require.Empty(t, res.Err)
	}
}

// One complete of 8 items is one event message holding 8 records: the
// scheduler's queue holds one message per batch, not one per item.
func TestCompleteOfABatchIsOneEventMessage(t *testing.T) {
	r := newRig(t)
	r.pushBatch(t, 8)
	var msg []wire.Event
	select {
	case msg = <-r.sub.Events():
	case <-time.After(hang):
		t.Fatal("no readiness event arrived")
	}
	require.Len(t, msg, 8, "the whole batch in the first message")
	for i, ev := range msg {
		require.True(t, ev.Ready)
		require.Equal(t, fmt.Sprintf("t%d", i), ev.TransferID, "in the order of the complete")
		require.Equal(t, msg[0].Seq+uint64(i), ev.Seq, "one seq per event")
	}
	// The publisher counts a message once it is handed over, so after the
	// subscriber has it.
	require.Eventually(t, func() bool { return r.shard.Stats().Events.Sent == 8 }, hang, time.Millisecond, "every item's readiness is sent")
	require.EqualValues(t, 1, r.shard.Stats().Events.Messages, "in one message")
	sub := r.sub.Stats()
	require.EqualValues(t, 8, sub.Received)
	require.EqualValues(t, 1, sub.Messages)
}
