package mooncake

import (
	"context"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/transport"
)

// BenchmarkWriteVsEngine measures what the transport adds on top of the
// engine for one batch (staging copies, submission, polling, completion,
// freeing): each iteration moves the same batch twice over the test
// double, once driven entirely inside the double (mcd_raw_write: one
// submit, a tight C poll loop, no staging, no cgo per task) and once
// through Writer.Write. Reported: both throughputs, their ratio (1 means
// no overhead), our extra time per batch, and memcpy speed on this
// machine for scale (Write copies every byte into staging once).
//
//	go test -run NONE -bench WriteVsEngine -benchtime 20x ./core/transport/mooncake
func BenchmarkWriteVsEngine(b *testing.B) {
	needDouble(b) // the ceiling is the double's own write loop
	cases := []struct {
		name     string
		size, n  int
		stageMiB int64
	}{
		{"64KiB_x256", 64 << 10, 256, 256},
		{"32MiB_x8", 32 << 20, 8, 256},
	}
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			total := tc.size * tc.n
			cfg := Config{Library: doublePath, Engine: enginePath, Host: "127.0.0.1", StagingBytes: tc.stageMiB << 20, Logger: quiet}
			p := newPair(b, total+(1<<20), cfg, cfg)
			src := pattern(tc.size, 1)
			items := make([]transport.WriteItem, tc.n)
			for i := range items {
				items[i] = p.item(i+1, uint64(i*tc.size), src)
			}
			ctx := context.Background()
			// The first write creates the engine, the staging slab and the
			// segment: setup, not per-batch cost.
			for _, err := range p.w.Write(ctx, p.recv.Addr(), items) {
				if err != nil {
					b.Fatal(err)
				}
			}
			seg := p.w.segs[p.recv.eng.segment].id
			scratch := make([]byte, tc.size)
			var ours, raw, cp time.Duration
			b.SetBytes(int64(total))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				if rc := double.RawWrite(p.w.eng.h, p.w.stg.base, seg, p.recv.RemoteAddr(0), uint64(tc.size), tc.n); rc != 0 {
					b.Fatalf("raw write: code %d", rc)
				}
				t1 := time.Now()
				for _, err := range p.w.Write(ctx, p.recv.Addr(), items) {
					if err != nil {
						b.Fatal(err)
					}
				}
				t2 := time.Now()
				copy(scratch, src)
				raw, ours, cp = raw+t1.Sub(t0), ours+t2.Sub(t1), cp+time.Since(t2)
			}
			b.StopTimer()
			gbps := func(d time.Duration, bytes int) float64 { return float64(bytes) * float64(b.N) / d.Seconds() / 1e9 }
			b.ReportMetric(gbps(ours, total), "ours_GB/s")
			b.ReportMetric(gbps(raw, total), "engine_GB/s")
			b.ReportMetric(raw.Seconds()/ours.Seconds(), "ratio")
			b.ReportMetric(float64((ours-raw).Microseconds())/float64(b.N), "extra_us/batch")
			b.ReportMetric(gbps(cp, tc.size), "memcpy_GB/s")
		})
	}
}
