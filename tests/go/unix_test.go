package gotests

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/control"
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
	// Every call each shard served since before went over Unix, and every event.
	requireAllUnix := func(before []control.ServerStats) {
		t.Helper()
		for i, s := range c.shards {
			st := s.Stats()
			require.Empty(t, st.Server.Refused)
			unix := st.Server.ServedUnix - before[i].ServedUnix
			require.NotZero(t, unix, "same-host calls go over Unix")
			require.Equal(t, st.Server.Served-before[i].Served, unix, "no same-host call fell back to ZeroMQ")
			require.NotZero(t, st.Events.SentUnix, "events go over Unix")
			require.Equal(t, st.Events.Sent, st.Events.SentUnix, "no event went over ZeroMQ")
			require.Empty(t, st.Events.Refused)
		}
		ev := c.sched.Stats().Events
		require.NotZero(t, ev.ReceivedUnix)
		require.Equal(t, ev.Received, ev.ReceivedUnix, "the scheduler read every event over Unix")
	}
	requireAllUnix(make([]control.ServerStats, len(c.shards)))

	c.restart(1)
	after := makeItems(38, 6, 1, 1<<20, 3)
	c.deliver("req-unix-after", after, "events of the restarted shard reach the scheduler")
	c.verify(after)
	// A call made while shard 1 was down found no Unix listener and went
	// over ZeroMQ, which holds it for the new shard: by design (counted as
	// an "unreachable" fallback), and on a loaded machine a heartbeat lands
	// in that window often enough. The caller keeps to ZeroMQ for the Unix
	// path's retry interval (control's unixRetry, 1 s); past it, every call
	// to the restarted shard is over Unix again.
	time.Sleep(1100 * time.Millisecond)
	before := make([]control.ServerStats, len(c.shards))
	for i, s := range c.shards {
		before[i] = s.Stats().Server
	}
	later := makeItems(39, 6, 1, 1<<20, 3)
	c.deliver("req-unix-later", later, "events of the restarted shard reach the scheduler")
	c.verify(later)
	requireAllUnix(before)
}
