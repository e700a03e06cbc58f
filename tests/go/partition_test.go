package gotests

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A fault strikes mid-batch: right after the first frame that shard `at`
// accepts, so the batch's reservations are granted, some bytes have
// landed and no complete has left for that shard yet. The batch must end
// as want says, then the links heal, every reservation is reclaimed, and
// the next batch goes through whole. The harness checks the invariants
// throughout (inmem_harness_test.go).
func TestInmemClusterSurvivesPartitionsAndDelays(t *testing.T) {
	for i, tc := range []struct {
		name  string
		at    int
		fault func(c *inmemCluster)
		// want is every transfer's end at the scheduler: "available",
		// "failed", or "either" (each as its bytes fared; at least
		// minFailed fail).
		want      string
		minFailed int
		// writersFail: the push that writes each image fails at the
		// producer too (one that follows it may end done: it had nothing
		// to write or complete).
		writersFail bool
		// byMessage: the data plane completes by complete_batch (the
		// one-sided planes) rather than in-band (TCP).
		byMessage bool
	}{
		{name: "no fault", want: "available"},
		{
			name: "control link producer-shard-1 cut", at: 1,
			fault: func(c *inmemCluster) { c.ctl.Partition("producer", shardName(1)) },
			// The grants came before the cut, and the frames complete each
			// item in-band: the control link is not needed any more.
			want: "available",
		},
		{
			name: "control link producer-shard-1 cut, completes by message", at: 1, byMessage: true,
			fault: func(c *inmemCluster) { c.ctl.Partition("producer", shardName(1)) },
			// The completes to shard 1 are lost: its regions expire, the
			// scheduler never hears of them.
			want: "failed", writersFail: true,
		},
		{
			name: "data link to shard-1 cut", at: 1,
			fault: func(c *inmemCluster) { c.guard.setCut(1, true) },
			// The frame that landed may complete; the rest are refused and
			// their regions abandoned.
			want: "either", minFailed: 1,
		},
		{
			name: "control link scheduler-shard-0 cut", at: 0,
			fault: func(c *inmemCluster) { c.ctl.Partition("scheduler", shardName(0)) },
			// Every push lands, but shard 0's events are lost and its
			// heartbeats go unanswered: the scheduler declares it lost.
			want: "failed",
		},
		{
			name: "every link slowed", at: 0,
			fault: func(c *inmemCluster) {
				c.ctl.SetDelay("producer", shardName(1), 50*time.Millisecond)
				c.ctl.SetDelay("scheduler", shardName(0), 30*time.Millisecond)
				c.data.SetDelay(c.addrs[0], 20*time.Millisecond)
				c.data.SetDelay(c.addrs[1], 10*time.Millisecond)
			},
			want: "available",
		},
		{
			// The hook runs inside the first frame, so the fault meets a
			// later frame of the same write.
			name: "frame to shard-0 torn", at: 0,
			fault: func(c *inmemCluster) { c.data.TearNext(c.addrs[0], 100) },
			want:  "either", minFailed: 1,
		},
		{
			name: "frame to shard-1 lost", at: 1,
			fault: func(c *inmemCluster) { c.data.FailNext(c.addrs[1], 1) },
			want:  "either", minFailed: 1,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newInmemCluster(t, inmemOption{byMessage: tc.byMessage})
			if tc.fault != nil {
				c.guard.once(tc.at, func() { tc.fault(c) })
			}
			items := makeItems(uint64(100+i), 8, 1<<10, 256<<10, 4)
			c.push("req-fault", items)
			out := c.settle(items)
			switch tc.want {
			case "available":
				require.ElementsMatch(t, tids(items), out.sched.Available)
				require.ElementsMatch(t, tids(items), out.done)
			case "failed":
				require.ElementsMatch(t, tids(items), out.sched.Failed, "available: %v", out.sched.Available)
			case "either":
				require.GreaterOrEqual(t, len(out.sched.Failed), tc.minFailed)
			}
			if tc.writersFail {
				seen := map[string]bool{}
				for _, it := range items {
					if !seen[it.hash] {
						seen[it.hash] = true
						require.Contains(t, out.failed, it.tid, "the push that writes %s fails", it.hash)
					}
				}
			}

			c.ctl.HealAll()
			c.guard.setCut(1, false)
			c.data.SetDelay(c.addrs[0], 0)
			c.data.SetDelay(c.addrs[1], 0)
			c.guard.off()
			c.requireReclaimed()
			awaitHeartbeats(t, c.sched)

			next := makeItems(uint64(200+i), 8, 1<<10, 256<<10, 0)
			c.push("req-after", next)
			after := c.settle(next)
			require.ElementsMatch(t, tids(next), after.sched.Available, "once healed, a batch goes through whole")
			require.ElementsMatch(t, tids(next), after.done)
			c.requireReclaimed()
		})
	}
}

// Batch after batch while the links flap: whatever each push meets, the
// invariants hold (settle checks every item the scheduler calls available)
// and nothing leaks.
func TestInmemClusterUnderFlappingLinks(t *testing.T) {
	c := newInmemCluster(t)
	for b := range 6 {
		items := makeItems(uint64(300+b), 6, 1<<10, 128<<10, 3)
		switch b % 3 {
		case 0:
			c.guard.once(1, func() { c.ctl.Partition("producer", shardName(1)) })
		case 1:
			c.guard.once(0, func() { c.guard.setCut(0, true) })
		case 2:
			c.guard.once(1, func() { c.ctl.SetDelay("producer", shardName(1), 20*time.Millisecond) })
		}
		c.push(fmt.Sprintf("req-flap-%d", b), items)
		c.settle(items)
		c.ctl.HealAll()
		c.guard.setCut(0, false)
	}
	c.guard.off()
	c.requireReclaimed()
}

// The write guard itself: what it must flag, and what it must let pass.
func TestWriteGuardFlagsStrayWrites(t *testing.T) {
	for _, tc := range []struct {
		name string
		run  func(g *writeGuard)
		bad  string
	}{
		{name: "frames inside their grant", run: func(g *writeGuard) {
			g.granted(0, 1, 100)
			g.landed(0, 1, 0, 60, 512)
			g.landed(0, 1, 60, 40, 572)
		}},
		{name: "a later reservation reuses ended memory", run: func(g *writeGuard) {
			g.granted(0, 1, 100)
			g.landed(0, 1, 0, 100, 0)
			g.granted(0, 2, 100)
			g.landed(0, 2, 0, 100, 0)
		}},
		{name: "never granted", bad: "never granted", run: func(g *writeGuard) { g.landed(0, 9, 0, 1, 0) }},
		{name: "past the grant", bad: "reaches past the grant", run: func(g *writeGuard) {
			g.granted(0, 1, 100)
			g.landed(0, 1, 90, 20, 90)
		}},
		{name: "region moved", bad: "region moved", run: func(g *writeGuard) {
			g.granted(0, 1, 100)
			g.landed(0, 1, 0, 10, 0)
			g.landed(0, 1, 10, 10, 4096)
		}},
		{name: "an ended reservation writes into a later one's memory", bad: "given since to res 2", run: func(g *writeGuard) {
			g.granted(0, 1, 100)
			g.landed(0, 1, 0, 50, 0)
			g.granted(0, 2, 100)
			g.landed(0, 2, 0, 10, 0)
			g.landed(0, 1, 50, 50, 50)
		}},
		{name: "shards are apart", run: func(g *writeGuard) {
			g.granted(0, 1, 100)
			g.granted(1, 2, 100)
			g.landed(1, 2, 0, 100, 0)
			g.landed(0, 1, 0, 100, 0)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newWriteGuard(2)
			tc.run(g)
			if tc.bad == "" {
				require.Empty(t, g.violations())
				return
			}
			require.Len(t, g.violations(), 1)
			require.Contains(t, g.violations()[0], tc.bad)
		})
	}
}
