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
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// directInmem is the in-memory data plane made one-sided: its receiver
// names a remote address for each slab offset, as shm and cuda_ipc do, so
// that a test writes straight into the slab, as their writers do.
type directInmem struct{ *transport.Inmem }

type directRecv struct{ transport.Receiver }

const testBase = 1 << 40

func (r directRecv) RemoteAddr(off uint64) uint64 { return testBase + off }

func (d directInmem) Listen(addr string, sink transport.Sink) (transport.Receiver, error) {
	r, err := d.Inmem.Listen(addr, sink)
	if err != nil {
		return nil, err
	}
	return directRecv{r}, nil
}

// creditRig is a shard with a one-sided plane and credit on, its slab
// memory (which the test writes as a one-sided writer would), a producer's
// control client and a scheduler's subscription.
type creditRig struct {
	rig
	mem []byte
}

const creditRequester = "000000000000000000000000000000c1"

func newCreditRig(t *testing.T, window uint64, direct bool) *creditRig {
	t.Helper()
	ctl, data := control.NewInmemNetwork(), transport.NewInmemNetwork()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	mem := make([]byte, 4<<20)
	cfg := config.DefaultConsumer()
	cfg.AllowUnauthenticated = true
	cfg.DataPort = 7000
	cfg.CreditWindowBytes = window
	var tr transport.Transport = transport.NewInmem(data)
	if direct {
		tr = directInmem{transport.NewInmem(data)}
	}
	shard, err := Open(cfg, slab.HostMemory(mem), Options{Transport: tr, Log: log, Links: ctl.Links("shard-0")})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, shard.Close()) })
	caller, err := ctl.Links("producer").Dial(shard.Info().Control, log)
	require.NoError(t, err)
	t.Cleanup(func() { _ = caller.Close() })
	sub, err := ctl.Links("scheduler").Subscribe(log)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	require.NoError(t, sub.Connect(shard.Info().Events))
	return &creditRig{rig: rig{shard: shard, caller: caller, sub: sub}, mem: mem}
}

func (r *creditRig) call(t *testing.T, op wire.Op, req, rep any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	require.NoError(t, r.caller.Call(ctx, op, req, rep))
}

// window asks for credit with a reserve of one item, as a producer's
// first batch does.
func (r *creditRig) window(t *testing.T, want uint64) *wire.CreditGrant {
	t.Helper()
	var rep wire.ReserveBatchReply
	r.call(t, wire.OpReserveBatch, wire.ReserveBatch{Requester: creditRequester, CreditBytes: want,
		Items: []wire.ReserveItem{{TransferID: "first", MMHash: "first", NBytes: 256}}}, &rep)
	require.Empty(t, rep.Grants[0].Err)
	return rep.Credit
}

func (r *creditRig) events(t *testing.T) []wire.Event {
	t.Helper()
	select {
	case msg := <-r.sub.Events():
		return msg
	case <-time.After(hang):
		t.Fatal("no readiness event arrived")
	}
	return nil
}

// A batch written into the window is named in one claim_batch: every item
// is ready (one event message) and loads the bytes the writer put there,
// with no reserve for it; the reply renews the window.
func TestClaimBatchFilesWrittenItems(t *testing.T) {
	r := newCreditRig(t, 1<<20, true)
	c := r.window(t, 1<<20)
	require.NotNil(t, c)
	require.Equal(t, uint64(testBase), c.Base)
	require.Len(t, c.Extents, 1)
	require.Equal(t, uint64(1<<20), c.Extents[0].Len)
	require.Positive(t, c.LeaseMs)

	const n, size = 8, 4096
	cb := wire.ClaimBatch{Requester: creditRequester, Gen: c.Gen, Token: c.Token, CreditBytes: 1 << 20}
	off := c.Extents[0].Off
	for i := range n {
		for k := range size {
			r.mem[off+uint64(k)] = byte(i + 1)
		}
		cb.Items = append(cb.Items, wire.ClaimItem{TransferID: fmt.Sprintf("t%d", i), MMHash: fmt.Sprintf("h%d", i), NBytes: size, Offset: off, Meta: "m"})
		off += size
	}
	var rep wire.ClaimBatchReply
	r.call(t, wire.OpClaimBatch, cb, &rep)
	require.Len(t, rep.Grants, n)
	for _, g := range rep.Grants {
		require.Empty(t, g.Err)
		require.Equal(t, wire.KindWrite, g.Kind)
	}
	require.NotNil(t, rep.Credit, "the claim's reply renews the window")
	require.Equal(t, c.Gen, rep.Credit.Gen)
	var room uint64
	for _, e := range rep.Credit.Extents {
		room += e.Len
	}
	require.Equal(t, uint64(1<<20), room, "topped up again from free room")

	msg := r.events(t)
	require.Len(t, msg, n, "the whole batch in one message")
	for i, ev := range msg {
		require.True(t, ev.Ready)
		require.Equal(t, fmt.Sprintf("t%d", i), ev.TransferID)
	}
	hashes := make([]string, n)
	for i := range hashes {
		hashes[i] = fmt.Sprintf("h%d", i)
	}
	for i, l := range r.shard.Acquire(hashes) {
		require.Empty(t, l.Error)
		require.Equal(t, "m", l.Meta)
		require.Equal(t, byte(i+1), r.mem[l.Offset], "the bytes the writer put in the window")
		require.Equal(t, byte(i+1), r.mem[l.Offset+size-1])
	}
	st := r.shard.Stats().Table.Credit
	require.Equal(t, uint64(n), st.Claimed)
	require.Equal(t, 1, st.Windows)
}

// Claims the window does not cover are refused by name, before any region
// exists, so that the producer reserves them again; the reserve then
// serves them as before.
func TestRefusedClaimsAreNamedAndReserved(t *testing.T) {
	r := newCreditRig(t, 1<<20, true)
	c := r.window(t, 1<<20)
	item := wire.ClaimItem{TransferID: "t1", MMHash: "h1", NBytes: 4096, Offset: c.Extents[0].Off}
	wrongToken := c.Token
	wrongToken[0] ^= 1
	for name, cb := range map[string]wire.ClaimBatch{
		"stale generation":  {Requester: creditRequester, Gen: c.Gen + 1, Token: c.Token, Items: []wire.ClaimItem{item}},
		"wrong token":       {Requester: creditRequester, Gen: c.Gen, Token: wrongToken, Items: []wire.ClaimItem{item}},
		"another requester": {Requester: "000000000000000000000000000000c2", Gen: c.Gen, Token: c.Token, Items: []wire.ClaimItem{item}},
		"past the window": {Requester: creditRequester, Gen: c.Gen, Token: c.Token,
			Items: []wire.ClaimItem{{TransferID: "t1", MMHash: "h1", NBytes: 4096, Offset: c.Extents[0].Off + c.Extents[0].Len}}},
	} {
		var rep wire.ClaimBatchReply
		r.call(t, wire.OpClaimBatch, cb, &rep)
		require.Len(t, rep.Grants, 1, name)
		require.Equal(t, wire.GrantCreditRefused, rep.Grants[0].Code, name)
		require.NotContains(t, rep.Grants[0].Err, c.Token.String(), name)
	}
	require.Zero(t, r.shard.Stats().Table.Credit.Claimed)

	var rep wire.ReserveBatchReply
	r.call(t, wire.OpReserveBatch, wire.ReserveBatch{Requester: creditRequester, Items: []wire.ReserveItem{{TransferID: "t1", MMHash: "h1", NBytes: 4096}}}, &rep)
	require.Empty(t, rep.Grants[0].Err, "the refused claim's item reserves")
	require.Equal(t, wire.KindWrite, rep.Grants[0].Kind)
}

// No credit without a one-sided plane (TCP completes in-band and admits
// frames only into live regions), without the shard's setting, or when the
// producer asks for none.
func TestNoCreditWhereItCannotServe(t *testing.T) {
	require.Nil(t, newCreditRig(t, 1<<20, false).window(t, 1<<20), "no one-sided plane")
	require.Nil(t, newCreditRig(t, 0, true).window(t, 1<<20), "off at the shard")
	require.Nil(t, newCreditRig(t, 1<<20, true).window(t, 0), "not asked")
}
