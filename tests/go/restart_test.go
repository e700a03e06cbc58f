package gotests

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// restartPlanes are the data planes a shard restart is tried on: each
// names its new incarnation differently (a new port, a new slab file, a
// new segment and slab address).
var restartPlanes = []struct {
	name string
	open func(t *testing.T, o clusterOpts) *cluster
}{
	{"tcp", func(t *testing.T, o clusterOpts) *cluster { return newCluster(t, o) }},
	{"shm", func(t *testing.T, o clusterOpts) *cluster { o.shm = true; return newCluster(t, o) }},
	{"mooncake", func(t *testing.T, o clusterOpts) *cluster { return mooncakeCluster(t, o, nil, nil) }},
}

// A shard that restarts while idle costs the next batch nothing: the
// producer learns the new incarnation from the reserve reply and writes to
// its new data plane, and the scheduler sees the items arrive.
func TestIdleShardRestart(t *testing.T) {
	for i, pl := range restartPlanes {
		t.Run(pl.name, func(t *testing.T) {
			c := pl.open(t, clusterOpts{tp: 2})
			seed := uint64(40 + 2*i)
			before := makeItems(seed, 3, 1000, 1<<20, 0)
			require.Empty(t, c.pushAll("req-before", before).Failed)
			c.verify(before)

			c.restart(1)
			awaitHeartbeats(t, c.sched)

			after := makeItems(seed+1, 3, 1000, 1<<20, 0)
			out := c.pushAll("req-after", after)
			require.Empty(t, out.Failed, "the first batch after an idle restart succeeds")
			require.Len(t, out.Done, len(after))
			w := c.wait(tids(after), 10*time.Second)
			require.ElementsMatch(t, tids(after), w.Available)
			c.verify(after)
		})
	}
}
