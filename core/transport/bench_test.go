package transport

import (
	"context"
	"testing"
	"time"
)

// BenchmarkTCPWrite32MB writes one 32 MiB item per iteration with the
// default configuration and reports its throughput against raw loopback
// ceilings measured in the same run, before and after the timed loop (the
// higher figure kept, so noise cannot flatter the ratio):
//
//	ratio       against the ceiling with as many streams as the pool has
//	            connections (the same work done without the transport)
//	ratio_best  against the best ceiling over 1, 2 and that many streams
func BenchmarkTCPWrite32MB(b *testing.B) {
	const size = 32 << 20
	tr := newTCP(TCPConfig{})
	sink := newMemSink(size)
	r := listen(b, tr, "127.0.0.1:0", sink)
	w := newWriter(b, tr)
	res, tok := sink.reserve(b, size)
	items := []WriteItem{{Res: res, Token: tok, Src: randBytes(1, size)}}
	ctx := context.Background()

	streams := []int{tr.cfg.Conns, 1, 2}
	ceilings := make([]float64, len(streams))
	measure := func() {
		for i, s := range streams {
			c, err := LoopbackCeiling(ctx, 1<<30, s)
			if err != nil {
				b.Fatal(err)
			}
			ceilings[i] = max(ceilings[i], c)
		}
	}
	// One write outside the timing so that dials do not count.
	if err := w.Write(ctx, r.Addr(), items)[0]; err != nil {
		b.Fatal(err)
	}
	measure()

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
	measure()

	got := float64(size) * float64(b.N) / elapsed.Seconds()
	best := max(ceilings[0], ceilings[1], ceilings[2])
	b.ReportMetric(got/1e9, "GB/s")
	b.ReportMetric(ceilings[0]/1e9, "ceiling_GB/s")
	b.ReportMetric(got/ceilings[0], "ratio")
	b.ReportMetric(best/1e9, "ceiling_best_GB/s")
	b.ReportMetric(got/best, "ratio_best")
}
