package tcp

import (
	"bytes"
	"context"
	"math"
	"syscall"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/transport"
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
	items := []transport.WriteItem{{Res: res, Token: tok, Src: randBytes(1, size)}}
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

// BenchmarkTCPWrite256x64KiB writes 256 items of 64 KiB per iteration, as
// one Write, and reports what an item costs beyond moving its bytes over
// raw loopback TCP measured in the same run (before and after the timed
// loop). On a loaded machine wall time is mostly waiting for a core, so the
// CPU time of the process (both ends live in it) is reported too:
//
//	us/item               wall time per item
//	overhead_us/item      wall time per item minus its bytes at the best
//	                      ceiling of 1, 2 and pool-size streams
//	cpu_us/item           CPU time per item
//	cpu_overhead_us/item  CPU time per item minus what raw TCP spent on as
//	                      many bytes (best of the ceiling runs)
func BenchmarkTCPWrite256x64KiB(b *testing.B) {
	const n, size = 256, 64 << 10
	const ceilingBytes = 1 << 30
	tr := newTCP(TCPConfig{})
	sink := newMemSink(n * size)
	r := listen(b, tr, "127.0.0.1:0", sink)
	w := newWriter(b, tr)
	items := make([]transport.WriteItem, n)
	for i := range items {
		res, tok := sink.reserve(b, size)
		items[i] = transport.WriteItem{Res: res, Token: tok, Src: randBytes(uint64(i), size)}
	}
	ctx := context.Background()
	ceiling, cpuPerByte := 0.0, math.Inf(1)
	measure := func() {
		for _, s := range []int{1, 2, tr.cfg.Conns} {
			before := cpuTime()
			c, err := LoopbackCeiling(ctx, ceilingBytes, s)
			if err != nil {
				b.Fatal(err)
			}
			ceiling = max(ceiling, c)
			cpuPerByte = min(cpuPerByte, (cpuTime()-before).Seconds()/ceilingBytes)
		}
	}
	write := func() {
		for i, err := range w.Write(ctx, r.Addr(), items) {
			if err != nil {
				b.Fatalf("item %d: %v", i, err)
			}
		}
	}
	write() // dials outside the timing
	measure()
	b.SetBytes(n * size)
	b.ResetTimer()
	cpu0, start := cpuTime(), time.Now()
	for range b.N {
		write()
	}
	elapsed, cpu := time.Since(start), cpuTime()-cpu0
	b.StopTimer()
	measure()
	items64 := float64(b.N * n)
	perItem := elapsed.Seconds() / items64 * 1e6
	cpuPerItem := cpu.Seconds() / items64 * 1e6
	b.ReportMetric(perItem, "us/item")
	b.ReportMetric(perItem-size/ceiling*1e6, "overhead_us/item")
	b.ReportMetric(cpuPerItem, "cpu_us/item")
	b.ReportMetric(cpuPerItem-size*cpuPerByte*1e6, "cpu_overhead_us/item")
	b.ReportMetric(ceiling/1e9, "ceiling_GB/s")
}

// cpuTime is the user and system time this process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkTCPWriteUnderLockout is the lockout attack of issue 23 under
// load: a producer pushes batches while DefaultMaxConns+64 connections
// send one header byte each and stall, reopened as soon as the receiver
// closes them. Each iteration is one batch of 8 items of 1 MiB, written by
// a writer that dials in the middle of the attack; every item is checked
// bit-exact (batches alternate between two contents, so an item that did
// not land shows). The same number of batches runs attack-free before and
// after the attack, and the faster of the two is the baseline:
//
//	GB/s          the producer's throughput under attack
//	clean_GB/s    the same pushes with no attacker
//	ratio         GB/s / clean_GB/s (issue 23 asks at least 0.8)
//	attack_conns  connections the attacker opened while the producer ran
func BenchmarkTCPWriteUnderLockout(b *testing.B) {
	for _, secret := range []Secret{testSecret, ""} {
		b.Run("mode="+modeOf(secret).String(), func(b *testing.B) {
			const n, size = 8, 1 << 20
			sink := newMemSink(n * size)
			r := listen(b, NewTCP(TCPConfig{Secret: secret, Logger: quiet}), "127.0.0.1:0", sink)
			items := [2][]transport.WriteItem{make([]transport.WriteItem, n), make([]transport.WriteItem, n)}
			for i := range n {
				res, tok := sink.reserve(b, size)
				for v := range items {
					items[v][i] = transport.WriteItem{Res: res, Token: tok, Src: randBytes(uint64(v*n+i), size)}
				}
			}
			push := func(rounds int) time.Duration {
				w := NewTCP(TCPConfig{Secret: secret, Logger: quiet}).NewWriter()
				defer w.Close()
				start := time.Now()
				for k := range rounds {
					batch := items[k%2]
					ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
					errs := w.Write(ctx, r.Addr(), batch)
					cancel()
					for i, it := range batch {
						if errs[i] != nil {
							b.Fatalf("round %d item %d: %v", k, i, errs[i])
						}
						if !bytes.Equal(it.Src, sink.region(it.Res)) {
							b.Fatalf("round %d item %d: not bit-exact", k, i)
						}
					}
				}
				return time.Since(start)
			}

			clean := push(b.N)
			attackers := DefaultMaxConns + 64
			dialed, stop := stall(b, r.Addr(), attackers)
			deadline := time.Now().Add(testTimeout)
			for dialed.Load() < uint64(attackers) {
				if time.Now().After(deadline) {
					b.Fatalf("the attack opened %d of %d connections", dialed.Load(), attackers)
				}
				time.Sleep(time.Millisecond)
			}
			before := dialed.Load()
			b.SetBytes(n * size)
			b.ResetTimer()
			attacked := push(b.N)
			b.StopTimer()
			during := dialed.Load() - before
			stop()
			clean = min(clean, push(b.N))

			bytesMoved := float64(n*size) * float64(b.N)
			b.ReportMetric(bytesMoved/attacked.Seconds()/1e9, "GB/s")
			b.ReportMetric(bytesMoved/clean.Seconds()/1e9, "clean_GB/s")
			b.ReportMetric(clean.Seconds()/attacked.Seconds(), "ratio")
			b.ReportMetric(float64(during), "attack_conns")
			sink.requireBalanced(b)
		})
	}
}
