package gotests

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// With control_unix on every end of one host, the producer's and the
// scheduler's control calls go over the shards' Unix path, admitted by uid
// and secret, and the whole path works as over ZeroMQ.
func TestUnixControlCluster(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2, secret: deploymentSecret, unix: true})
	items := makeItems(37, 6, 1, 1<<20, 3)
	c.deliver("req-unix", items, "events reach the scheduler")
	c.verify(items)
	for _, s := range c.shards {
		st := s.Stats().Server
		require.Empty(t, st.Refused)
		require.NotZero(t, st.ServedUnix, "same-host calls go over Unix")
		require.Equal(t, st.Served, st.ServedUnix, "no same-host call fell back to ZeroMQ")
	}
}
