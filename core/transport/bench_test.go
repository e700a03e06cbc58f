package transport

import (
	"context"
	"testing"
	"time"
)

// BenchmarkTCPWrite32MB writes one 32 MiB item per iteration over the
// default pool and reports its throughput against the raw loopback ceiling
// measured in the same run, with as many streams as the pool has
// connections. The ceiling is measured before and after the timed loop and
// the higher figure kept, so the ratio is not flattered by noise.
func BenchmarkTCPWrite32MB(b *testing.B) {
	const size = 32 << 20
	tr := newTCP(TCPConfig{})
	sink := newMemSink(size)
	r := listen(b, tr, "127.0.0.1:0", sink)
	w := newWriter(b, tr)
	res, tok := sink.reserve(b, size)
	items := []WriteItem{{res, tok, randBytes(1, size)}}
	ctx := context.Background()

	ceiling := func() float64 {
		c, err := LoopbackCeiling(ctx, 1<<30, tr.cfg.Conns)
		if err != nil {
			b.Fatal(err)
		}
		return c
	}
	// One write outside the timing so dials do not count.
	if err := w.Write(ctx, r.Addr(), items)[0]; err != nil {
		b.Fatal(err)
	}
	before := ceiling()

	b.SetBytes(size)
	b.ResetTimer()
	start := time.Now()
	for range b.N {
		if err := w.Write(ctx, r.Addr(), items)[0]; err != nil {
			b.Fatal(err)
		}
	}
	elapsed := time.Since(start)
	b.StopTimer()

	best := max(before, ceiling())
	got := float64(size) * float64(b.N) / elapsed.Seconds()
	b.ReportMetric(got/1e9, "GB/s")
	b.ReportMetric(best/1e9, "ceiling_GB/s")
	b.ReportMetric(got/best, "ratio")
}
