package gotests

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// With control_unix on every end of one host, the producer's and the
// scheduler's control calls go over the shards' Unix path, admitted by uid
// and secret, the readiness events too, and the whole path works as over
// ZeroMQ; a shard that restarts is followed over Unix on its new endpoint.
func TestUnixControlCluster(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2, secret: deploymentSecret, unix: true})
	items := makeItems(37, 6, 1, 1<<20, 3)
	c.deliver("req-unix", items, "events reach the scheduler")
	c.verify(items)
	requireAllUnix := func() {
		t.Helper()
		for _, s := range c.shards {
			st := s.Stats()
			require.Empty(t, st.Server.Refused)
			require.NotZero(t, st.Server.ServedUnix, "same-host calls go over Unix")
			require.Equal(t, st.Server.Served, st.Server.ServedUnix, "no same-host call fell back to ZeroMQ")
			require.NotZero(t, st.Events.SentUnix, "events go over Unix")
			require.Equal(t, st.Events.Sent, st.Events.SentUnix, "no event went over ZeroMQ")
			require.Empty(t, st.Events.Refused)
		}
		ev := c.sched.Stats().Events
		require.NotZero(t, ev.ReceivedUnix)
		require.Equal(t, ev.Received, ev.ReceivedUnix, "the scheduler read every event over Unix")
	}
	requireAllUnix()

	c.restart(1)
	after := makeItems(38, 6, 1, 1<<20, 3)
	c.deliver("req-unix-after", after, "events of the restarted shard reach the scheduler")
	c.verify(after)
	requireAllUnix()
}
