package cudaipc

import (
	"net"
	"testing"
	"time"

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
// the same run. Each item is announced first and the word stored once the
// shard watches it, as when a copy ends within the watcher's spin.
func BenchmarkReadyWordSeen(b *testing.B) {
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
