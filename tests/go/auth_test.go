package gotests

import (
	"context"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

const deploymentSecret = "tests-go-deployment-secret-0123"

// With a secret on every end, the whole path works as without one.
func TestAuthenticatedCluster(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2, secret: deploymentSecret})
	items := makeItems(31, 6, 1, 1<<20, 3)
	c.deliver("req-auth", items, "events reach the scheduler over CURVE")
	c.verify(items)
	for _, s := range c.shards {
		require.Empty(t, s.Stats().Server.Refused)
	}
}

// A producer without the deployment's secret is refused at the handshake
// and its pushes fail with a reason that names the setting, never a bare
// deadline, on every try. On a loaded host the two ends of a mismatch race
// to hang up on each other mid-greeting, so a try may see only a hang-up
// (core/control's TestClientDiagnosesAHangUpInTheGreeting replays that).
func TestProducerWithoutTheSecretIsRefused(t *testing.T) {
	const tries = 10
	for _, tc := range []struct {
		name, secret string
		reasons      []string // what the shard may count a try as
	}{
		{"no secret", "", []string{"auth_no_secret", "auth_aborted"}},
		{"wrong secret", "another-deployment-secret-000", []string{"auth_wrong_secret"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, clusterOpts{tp: 1, secret: deploymentSecret, producerSecret: &tc.secret, pushWait: time.Hour})
			for i := range tries {
				// A push that would wait for its deadline waits the
				// producer's control timeout (5 s), far less than this.
				items := makeItems(uint64(320+i), 1, 4096, 4096, 0)
				c.send(items)
				out := c.drain(1, 30*time.Second)
				require.Len(t, out.Failed, 1)
				require.Contains(t, out.Failed[0].Reason, "auth_secret", "try %d", i)
				require.NotContains(t, out.Failed[0].Reason, "deadline exceeded", "try %d", i)
			}
			// The shard counts on its own goroutine, maybe after the
			// producer already gave up.
			require.Eventually(t, func() bool {
				refused := c.shards[0].Stats().Server.Refused
				n := uint64(0)
				for _, r := range tc.reasons {
					n += refused[r]
				}
				return n > 0
			}, hang, 5*time.Millisecond)
			require.Eventually(t, func() bool { return len(c.prod.Stats().ControlRefused) > 0 }, hang, 5*time.Millisecond,
				"the producer counts the refusals it saw")
		})
	}
}

// The mm_hash poisoning of issue 11: a client without the secret tries to
// reserve a popular image's hash and complete it with its own bytes. It
// cannot reach the handler at all, and the real producer's push then
// writes the real bytes.
func TestPoisoningNeedsTheSecret(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 1, secret: deploymentSecret})
	items := makeItems(33, 1, 64<<10, 64<<10, 0)

	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	attacker, err := control.Dial(zctx, c.consumer, quietLog())
	require.NoError(t, err)
	defer attacker.Close()
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	var grants wire.ReserveBatchReply
	err = attacker.Call(ctx, wire.OpReserveBatch, wire.ReserveBatch{Requester: attackerID, Items: []wire.ReserveItem{
		{TransferID: "evil-1", MMHash: items[0].hash, NBytes: uint64(len(items[0].data))},
	}}, &grants)
	require.ErrorIs(t, err, control.ErrAuth)
	require.True(t, strings.Contains(err.Error(), "auth_secret"), err.Error())
	err = attacker.Call(ctx, wire.OpCompleteBatch, wire.CompleteBatch{Items: []wire.CompleteItem{{TransferID: "evil-1", Res: 1}}}, nil)
	require.ErrorIs(t, err, control.ErrAuth)
	require.Zero(t, c.shards[0].Stats().Table.Transfers, "nothing reached the reservation table")
	require.Zero(t, c.shards[0].Stats().InUse)

	out := c.pushAll("req-real", items)
	require.Empty(t, out.Failed)
	c.verify(items) // the real producer's bytes, not a cached forgery
}
