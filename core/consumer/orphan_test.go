package consumer

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/fsm/reserve"
	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// An encoder is killed after its reserve; the proxy sends the item, under
// the same transfer id, to a second encoder on this host. Over the Unix
// control path the shard hears the first encoder's connection end, and
// the second encoder's reserve of that transfer takes the write over,
// instead of being refused while the dead writer's grant waits out its
// lease (and the request waiting on it fails).
func TestASecondEncoderTakesOverTheWriteOfAKilledOne(t *testing.T) {
	const secret = "orphan-deployment-secret-0123456789"
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	cfg := config.DefaultConsumer()
	cfg.Secret = secret
	cfg.IP = "127.0.0.1"
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	require.NoError(t, err)
	cfg.Port = l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())
	cfg.DataPort = 0
	shard, err := Open(cfg, slab.HostMemory(make([]byte, 4<<20)), Options{Transport: transport.NewInmem(transport.NewInmemNetwork()), Log: log})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, shard.Close()) })

	sec, err := control.NewSecurity(secret, false)
	require.NoError(t, err)
	dial := func() (control.Caller, func()) {
		links, err := control.NewUnix(sec)
		require.NoError(t, err)
		c, err := links.Dial(shard.Info().Control, log)
		require.NoError(t, err)
		closeAll := func() { _ = c.Close(); _ = links.Close() }
		t.Cleanup(closeAll)
		return c, closeAll
	}
	reserveT1 := func(c control.Caller, requester string) wire.Grant {
		ctx, cancel := context.WithTimeout(context.Background(), hang)
		defer cancel()
		var rep wire.ReserveBatchReply
		require.NoError(t, c.Call(ctx, wire.OpReserveBatch, wire.ReserveBatch{Requester: requester,
			Items: []wire.ReserveItem{{TransferID: "t1", MMHash: "h1", NBytes: 4096}}}, &rep))
		require.Len(t, rep.Grants, 1)
		return rep.Grants[0]
	}
	a, killA := dial()
	first := reserveT1(a, fmt.Sprintf("%032x", 0xa))
	require.Empty(t, first.Err)
	require.Equal(t, reserve.KindWrite.String(), first.Kind)
	require.Equal(t, uint64(1), shard.Stats().Server.ServedUnix, "the reserve came over the Unix path")

	b, _ := dial()
	requesterB := fmt.Sprintf("%032x", 0xb)
	require.Equal(t, wire.GrantInProgress, reserveT1(b, requesterB).Code, "the writer is alive: its grant is its own")

	killA()
	// The connection's end reaches the shard on its own goroutine: the
	// second encoder's reserve is refused until then.
	deadline := time.Now().Add(hang)
	var g wire.Grant
	for {
		g = reserveT1(b, requesterB)
		if g.Code != wire.GrantInProgress || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	require.Empty(t, g.Err)
	require.Equal(t, reserve.KindWrite.String(), g.Kind)
	require.NotEqual(t, first.Res, g.Res)
	require.Equal(t, uint64(1), shard.Stats().Table.TakenOver)
}
