package gotests

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/scheduler"
)

// loadOnce drives one request's item through the scheduler and the worker
// as the connector does: start the load, acquire and check it on every
// shard, report it loaded, free it (a resident copy now) and finish.
func (c *cluster) loadOnce(req string, it item) {
	c.t.Helper()
	load := c.sched.Step(scheduler.StepIn{Load: []string{it.hash}}).Load
	require.Len(c.t, load, 1)
	require.Empty(c.t, load[0].Error)
	c.verify([]item{it})
	c.sched.Step(scheduler.StepIn{Loaded: []scheduler.LoadedIn{{TransferID: load[0].TransferID, OK: true}}})
	c.sched.Step(scheduler.StepIn{Freed: []string{it.hash}, Finished: []string{req}})
}

// A resident copy that its shard evicts to make room stops being offered:
// has_cache_item must not say yes to bytes that a load cannot find.
func TestEvictedResidentCopyIsNotOffered(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2, slabBytes: 1 << 20})
	first := makeItems(50, 1, 600<<10, 600<<10, 0)
	require.Empty(t, c.pushAll("req-first", first).Failed)
	require.Equal(t, tids(first), c.wait(tids(first), 10*time.Second).Available)
	c.loadOnce("req-first", first[0])
	require.True(t, c.sched.Has(first[0].hash), "loaded and freed: a resident copy")

	second := makeItems(51, 1, 600<<10, 600<<10, 0)
	require.Empty(t, c.pushAll("req-second", second).Failed)
	for r, s := range c.shards {
		require.Equal(t, uint64(1), s.Stats().Table.Evictions, "shard %d made room by evicting the first copy", r)
	}
	require.Eventually(t, func() bool { return !c.sched.Has(first[0].hash) }, hang, 10*time.Millisecond,
		"has_cache_item still says yes to an evicted copy")
	load := c.sched.Step(scheduler.StepIn{Load: []string{first[0].hash}}).Load
	require.Contains(t, load[0].Error, "not available")
}
