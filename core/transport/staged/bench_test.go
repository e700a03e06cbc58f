package staged

import (
	"context"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/tcp"
	"github.com/ecmooncake/ecmooncake/core/transport/transporttest"
)

// BenchmarkStagedWrite256x64KiB writes batches of 256 items of 64 KiB over
// loopback TCP into a host slab through the staged writer, with the
// producer's defaults (8 MiB chunks, 64 MiB of staging): once from device
// sources (the fake GPU, whose copies are memcpys) and once from host
// sources, alternated, each batch timed on its own.
//
//	us/item                 device sources
//	host_us/item            host sources through the same writer (the floor)
//	staging_us/item         the difference: what staging costs an item
//	copy_us/item            a memcpy of an item's bytes, the fake GPU's
//	                        copy alone, timed in the same run
//
// The fake GPU takes no time to learn a copy ended, so the figure is what
// the staging's own structure costs (buffers, goroutines, inner writes);
// a real GPU adds each copy's wait on top.
func BenchmarkStagedWrite256x64KiB(b *testing.B) {
	const n, size = 256, 64 << 10
	host := gpu.NewFakeHost(1)
	regions := transporttest.NewHost(n * size)
	r, err := New(Config{Inner: tcp.NewTCP(tcp.TCPConfig{Logger: transporttest.Quiet()}), Logger: transporttest.Quiet()}).Listen("127.0.0.1:0", regions)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = r.Close() })
	w := New(Config{Inner: tcp.NewTCP(tcp.TCPConfig{Logger: transporttest.Quiet()}), Devices: host, Logger: transporttest.Quiet()}).NewWriter()
	b.Cleanup(func() { _ = w.Close() })
	dev := make([]transport.WriteItem, n)
	hst := make([]transport.WriteItem, n)
	windows := make([][]byte, n)
	for i := range dev {
		res, tok := regions.Reserve(size)
		data := transporttest.RandBytes(uint64(i), size)
		addr, window := host.Alloc(0, size)
		copy(window, data)
		windows[i] = window
		dev[i] = transport.WriteItem{Res: res, Token: tok, Dev: &transport.DeviceSrc{Addr: addr, Len: size}}
		hst[i] = transport.WriteItem{Res: res, Token: tok, Src: data}
	}
	ctx := context.Background()
	write := func(items []transport.WriteItem) time.Duration {
		start := time.Now()
		for i, err := range w.Write(ctx, r.Addr(), items) {
			if err != nil {
				b.Fatalf("item %d: %v", i, err)
			}
		}
		return time.Since(start)
	}
	write(hst) // dials outside the timing
	write(dev)
	scratch := make([]byte, n*size)
	copyAll := func() time.Duration {
		start := time.Now()
		for i, win := range windows {
			copy(scratch[i*size:], win)
		}
		return time.Since(start)
	}
	var devT, hostT, copyT time.Duration
	b.SetBytes(n * size)
	b.ResetTimer()
	for range b.N {
		devT += write(dev)
		hostT += write(hst)
		copyT += copyAll()
	}
	b.StopTimer()
	items := float64(b.N * n)
	b.ReportMetric(devT.Seconds()/items*1e6, "us/item")
	b.ReportMetric(hostT.Seconds()/items*1e6, "host_us/item")
	b.ReportMetric((devT-hostT).Seconds()/items*1e6, "staging_us/item")
	b.ReportMetric(copyT.Seconds()/items*1e6, "copy_us/item")
}
