package consumer

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/fsm/reserve"
	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// reserveAs sends one reserve of n bytes for a fresh hash under requester
// on caller, and returns its grant.
func reserveAs(t *testing.T, caller control.Caller, requester, tid string, n uint64) wire.Grant {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	var rep wire.ReserveBatchReply
	require.NoError(t, caller.Call(ctx, wire.OpReserveBatch, wire.ReserveBatch{Requester: requester,
		Items: []wire.ReserveItem{{TransferID: tid, MMHash: "hash-" + tid, NBytes: n}}}, &rep))
	require.Len(t, rep.Grants, 1)
	return rep.Grants[0]
}

// TestAMadeUpRequesterGainsNoRoom is the attack as a producer holding the
// deployment secret runs it: on its one authenticated connection it
// reserves up to its quota (three quarters of a 16 MiB slab) under its
// requester identity, then goes on under a second identity it made up to
// take the rest. The second identity counts against the same
// connection's quota, so another producer still gets its grant.
func TestAMadeUpRequesterGainsNoRoom(t *testing.T) {
	const secret = "quota-deployment-secret-0123456789"
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	cfg := config.DefaultConsumer()
	cfg.Secret = secret
	cfg.ControlUnix = false
	cfg.DataPort = 0
	mem := make([]byte, 16<<20)
	data := transport.NewInmemNetwork()
	shard, err := Open(cfg, slab.HostMemory(mem), Options{Transport: transport.NewInmem(data), Log: log})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, shard.Close()) })

	sec, err := control.NewSecurity(secret, false)
	require.NoError(t, err)
	dial := func() control.Caller {
		links, err := control.NewZMQ(sec)
		require.NoError(t, err)
		t.Cleanup(func() { _ = links.Close() })
		c, err := links.Dial(shard.Info().Control, log)
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	attacker, honest := dial(), dial()
	const item = 4 << 20
	first, second := fmt.Sprintf("%032x", 0xa1), fmt.Sprintf("%032x", 0xa2)

	for i := range 3 {
		g := reserveAs(t, attacker, first, fmt.Sprintf("a%d", i), item)
		require.Empty(t, g.Err, "within the quota")
	}
	g := reserveAs(t, attacker, first, "a3", item)
	require.Equal(t, wire.GrantOverQuota, g.Code, "12 MiB + 4 MiB pass the quota of 12 MiB: %s", g.Err)

	// The same connection, a requester it made up.
	g = reserveAs(t, attacker, second, "b0", item)
	require.Equal(t, wire.GrantOverQuota, g.Code, "a second identity on one connection gains no room: %s", g.Err)

	g = reserveAs(t, honest, fmt.Sprintf("%032x", 0xb0), "h0", item)
	require.Empty(t, g.Err, "another producer still gets its grant")
	require.Equal(t, reserve.KindWrite.String(), g.Kind)
}
