package cudaipc

import (
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport/transporttest"
)

// notifySink says on done which write it completed.
type notifySink struct {
	*transporttest.Regions
	done chan ids.ResID
}

func (n notifySink) CompleteRemote(res ids.ResID, tok ids.Token) error {
	err := n.Regions.CompleteRemote(res, tok)
	n.done <- res
	return err
}

// BenchmarkReadyWordSeen is the shard's side of the ready path: from a
// word stored into a watched slot to the item completed through the
// sink, against the ceiling of the path it replaces, a thread woken by a
// message on a Unix socket (the complete_batch's first hop), measured in
// the same run. Each item is announced first and its word stored once the
// shard watches it: at once ("copy_0"), 400 µs later ("copy_400us", as
// when a 256 MiB batch's copies end on an H100: with a 100 µs spin this
// cost a nap, ~1 ms where Go's sub-millisecond timers round up), or after
// the spin ("copy_3ms": a nap's cost).
func BenchmarkReadyWordSeen(b *testing.B) {
	b.Run("copy_0", func(b *testing.B) { benchWordSeen(b, 0) })
	b.Run("copy_400us", func(b *testing.B) { benchWordSeen(b, 400*time.Microsecond) })
	b.Run("copy_3ms", func(b *testing.B) { benchWordSeen(b, 3*time.Millisecond) })
}

func benchWordSeen(b *testing.B, after time.Duration) {
	host := gpu.NewFakeHost(1)
	s := listenShard(b, host, 0, "")
	done := make(chan ids.ResID, 1)
	s.recv.sink = notifySink{s.regions, done}
	p := dialRaw(b, s)
	if b.N > slabSize/256 {
		b.Skipf("at most %d items fit the slab", slabSize/256)
	}
	var word, wake time.Duration
	for i := range b.N {
		it := s.grant(64)
		p.announce(announcement{Res: uint64(it.Res), Token: it.Token, Slot: uint32(i % wordSlots), Value: p.word(uint32(i + 1))})
		for s.recv.accepted.Load() < uint64(i+1) {
			time.Sleep(time.Microsecond) // blocks: the shard's poller runs
		}
		if after > 0 {
			// A blocking sleep in the kernel, as a copy on a GPU is: it
			// keeps none of this process's threads busy, so the watcher's
			// naps run as they do in an otherwise idle shard.
			ts := unix.NsecToTimespec(after.Nanoseconds())
			_ = unix.Nanosleep(&ts, nil)
		}
		start := time.Now()
		p.words.store(uint32(i%wordSlots), p.word(uint32(i+1)))
		<-done
		word += time.Since(start)
	}
	got := make(chan time.Time)
	ua, ub, err := unixPair()
	if err != nil {
		b.Fatal(err)
	}
	defer ua.Close()
	defer ub.Close()
	go func() {
		var buf [1]byte
		for {
			if _, err := ub.Read(buf[:]); err != nil {
				return
			}
			got <- time.Now()
		}
	}()
	for range b.N {
		start := time.Now()
		if _, err := ua.Write([]byte{1}); err != nil {
			b.Fatal(err)
		}
		wake += (<-got).Sub(start)
	}
	b.ReportMetric(float64(word.Nanoseconds())/float64(b.N)/1e3, "word_us/op")
	b.ReportMetric(float64(wake.Nanoseconds())/float64(b.N)/1e3, "socket_wake_us/op")
	b.ReportMetric(float64(word)/float64(wake), "word/wake")
}

func unixPair() (*net.UnixConn, *net.UnixConn, error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@ecmooncake-cudaipc-bench-" + time.Now().Format("150405.000000000"), Net: "unix"})
	if err != nil {
		return nil, nil, err
	}
	defer ln.Close()
	a, err := net.DialUnix("unix", nil, ln.Addr().(*net.UnixAddr))
	if err != nil {
		return nil, nil, err
	}
	b, err := ln.AcceptUnix()
	if err != nil {
		a.Close()
		return nil, nil, err
	}
	return a, b, nil
}
