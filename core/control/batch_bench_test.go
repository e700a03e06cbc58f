package control

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// BenchmarkEventBatch times a batch's readiness, from the shard's first
// Send until the subscriber holds all of its events, two ways in turn,
// chunk by chunk, so that both see the same load: one Send per event
// (one message per event, what the shard did before event messages) and
// one Send of the whole batch (one message). Same process, the Unix and
// the ZeroMQ path; p50 and p99 per batch, and batched ÷ per-event.
//
//	GOMAXPROCS=2 go test -run=NONE -bench=EventBatch -benchtime=2000x ./core/control
func BenchmarkEventBatch(b *testing.B) {
	const batch = 8
	evs := make([]wire.Event, batch)
	for i := range evs {
		evs[i] = readyEvent(0, fmt.Sprintf("transfer-%d", i))
	}
	paths := map[string]func() (Links, Links){
		"unix": func() (Links, Links) {
			a, err := NewUnix(Security{})
			require.NoError(b, err)
			c, err := NewUnix(Security{})
			require.NoError(b, err)
			return a, c
		},
		"zmq": func() (Links, Links) {
			a, err := NewZMQ(Security{})
			require.NoError(b, err)
			c, err := NewZMQ(Security{})
			require.NoError(b, err)
			return a, c
		},
	}
	for _, name := range []string{"unix", "zmq"} {
		b.Run(name, func(b *testing.B) {
			shard, sched := paths[name]()
			pub, err := shard.Publish("127.0.0.1", nil)
			require.NoError(b, err)
			sub, err := sched.Subscribe(nil)
			require.NoError(b, err)
			require.NoError(b, sub.Connect(pub.Endpoint()))
			recv := func() {
				for got := 0; got < batch; {
					m, ok := <-sub.Events()
					if !ok {
						b.Fatal("events closed")
					}
					got += len(m)
				}
			}
			one := func(perEvent bool) time.Duration {
				start := time.Now()
				if perEvent {
					for _, ev := range evs {
						pub.Send(ev)
					}
				} else {
					pub.Send(evs...)
				}
				recv()
				return time.Since(start)
			}
			one(false) // the first waits for the connection
			var each, batched []time.Duration
			b.ResetTimer()
			for done := 0; done < b.N; done += chunk {
				for range min(chunk, b.N-done) {
					each = append(each, one(true))
				}
				for range min(chunk, b.N-done) {
					batched = append(batched, one(false))
				}
			}
			b.StopTimer()
			report := func(tag string, d []time.Duration) (p50, p99 float64) {
				slices.Sort(d)
				p50, p99 = usOf(d[len(d)/2]), usOf(d[len(d)*99/100])
				b.ReportMetric(p50, tag+"-p50-us")
				b.ReportMetric(p99, tag+"-p99-us")
				return p50, p99
			}
			e50, e99 := report("per-event", each)
			b50, b99 := report("batched", batched)
			b.ReportMetric(b50/e50, "p50-batched-x-per-event")
			b.ReportMetric(b99/e99, "p99-batched-x-per-event")
			ps, ss := pub.Stats(), sub.Stats()
			require.EqualValues(b, ps.Sent, ss.Received)
			require.NoError(b, sub.Close())
			require.NoError(b, pub.Close())
			require.NoError(b, sched.Close())
			require.NoError(b, shard.Close())
		})
	}
}

func usOf(d time.Duration) float64 { return float64(d) / 1e3 }
