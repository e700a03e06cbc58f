package gotests

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

const (
	victimID   = "0123456789abcdef0123456789abcdef"
	attackerID = "fedcba9876543210fedcba9876543210"
)

func call(t *testing.T, cl *control.Client, op wire.Op, body, out any) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	return cl.Call(ctx, op, body, out)
}

func reserveAs(t *testing.T, cl *control.Client, requester, tid string) wire.Grant {
	t.Helper()
	var rep wire.ReserveBatchReply
	require.NoError(t, call(t, cl, wire.OpReserveBatch, wire.ReserveBatch{Requester: requester,
		Items: []wire.ReserveItem{{TransferID: tid, MMHash: "h-" + tid, NBytes: 4096}}}, &rep))
	return rep.Grants[0]
}

// Another producer who learnt a victim's transfer id (ids travel with
// every request) repeats its reserve, then tries to complete and cancel
// it: it learns "in progress" and nothing more, its complete without the
// token and its cancel by id change nothing, and the victim finishes its
// own write.
func TestGrantsAreBoundToTheRequesterOnTheWire(t *testing.T) {
	s, cl := tcpShard(t, 30, func(*config.Consumer) {})
	victim := reserveAs(t, cl, victimID, "t-victim")
	require.Equal(t, wire.KindWrite, victim.Kind, victim.Err)

	stolen := reserveAs(t, cl, attackerID, "t-victim")
	require.Contains(t, stolen.Err, "in progress")
	require.Equal(t, wire.GrantInProgress, stolen.Code, "refused by name")
	require.True(t, stolen.Token.IsZero(), "no token for another requester")
	require.Zero(t, stolen.Res)

	var forged ids.Token
	forged[0] = 1
	var done wire.CompleteBatchReply
	require.NoError(t, call(t, cl, wire.OpCompleteBatch, wire.CompleteBatch{Items: []wire.CompleteItem{
		{TransferID: "t-victim", Res: victim.Res, Token: forged},
		{TransferID: "t-victim", Res: victim.Res, Token: forged, Abandon: true, Reason: "evil"},
	}}, &done))
	for _, r := range done.Results {
		require.Contains(t, r.Err, "bad token")
	}
	var cancelled wire.CancelReply
	require.NoError(t, call(t, cl, wire.OpCancel, wire.Cancel{TransferIDs: []string{"t-victim"}}, &cancelled))
	require.Zero(t, cancelled.Cancelled, "a cancel by id never ends a write")
	require.Equal(t, uint64(1), s.Stats().CancelsLeftToWriter)

	var st wire.StatusReply
	require.NoError(t, call(t, cl, wire.OpStatus, wire.Status{TransferIDs: []string{"t-victim"}}, &st))
	require.Equal(t, "writing", st.Items[0].State, "the victim's write goes on")

	again := reserveAs(t, cl, victimID, "t-victim")
	require.Equal(t, victim.Token, again.Token, "the victim's own retry gets its grant back")
	var finished wire.CompleteBatchReply
	require.NoError(t, call(t, cl, wire.OpCompleteBatch, wire.CompleteBatch{Items: []wire.CompleteItem{
		{TransferID: "t-victim", Res: victim.Res, Token: victim.Token},
	}}, &finished))
	require.Empty(t, finished.Results[0].Err, "the victim completes its own write")
}

// A producer that predates requester-bound grants sends no requester:
// it is refused with a reply that says so, not served as nobody.
func TestAReserveWithoutARequesterIsRefusedClearly(t *testing.T) {
	_, cl := tcpShard(t, 30, func(*config.Consumer) {})
	var rep wire.ReserveBatchReply
	// Raw, as an older producer encodes it: this build's client would
	// refuse to send it.
	old := json.RawMessage(`{"items":[{"transfer_id":"t-old","mm_hash":"h","nbytes":1}]}`)
	err := call(t, cl, wire.OpReserveBatch, old, &rep)
	var werr *wire.Error
	require.ErrorAs(t, err, &werr, "the shard's refusal, not this client's")
	require.Equal(t, wire.CodeBadRequest, werr.Code)
	require.Contains(t, werr.Msg, "requester")
	require.Contains(t, werr.Msg, "upgrade")
}
