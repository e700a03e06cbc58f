package transport

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// ceilingBuf is the size of each write and read in LoopbackCeiling: large,
// like the frames the transport moves, so the figure is a ceiling for them.
const ceilingBuf = 8 << 20

// LoopbackCeiling measures raw Go TCP throughput over 127.0.0.1 in bytes
// per second: total bytes spread over streams parallel connections, plain
// net.Conn writes and reads of large buffers, no framing. Benchmarks divide
// their own figure by it, measured in the same run on the same machine.
func LoopbackCeiling(ctx context.Context, total int64, streams int) (bytesPerSec float64, err error) {
	if total <= 0 || streams <= 0 {
		return 0, fmt.Errorf("transport: loopback ceiling: need total > 0 and streams > 0, got %d and %d", total, streams)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("transport: loopback ceiling: %w", err)
	}
	defer ln.Close()

	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			_ = c.Close()
		}
	}()
	pairs := make([][2]net.Conn, streams)
	for i := range pairs {
		out, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			return 0, fmt.Errorf("transport: loopback ceiling: dial: %w", err)
		}
		conns = append(conns, out)
		in, err := ln.Accept()
		if err != nil {
			return 0, fmt.Errorf("transport: loopback ceiling: accept: %w", err)
		}
		conns = append(conns, in)
		pairs[i] = [2]net.Conn{out, in}
	}
	stop := context.AfterFunc(ctx, func() {
		for _, c := range conns {
			_ = c.SetDeadline(longAgo)
		}
	})
	defer stop()

	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		firstEr error
	)
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if firstEr == nil {
			firstEr = err
		}
	}
	guard := func(f func() error) {
		defer wg.Done()
		defer func() {
			if p := recover(); p != nil {
				fail(fmt.Errorf("panic: %v", p))
			}
		}()
		if err := f(); err != nil {
			fail(err)
		}
	}
	// Each stream has its own source and destination, as distinct items
	// do: one shared source would sit in cache and flatter the ceiling.
	srcs, dsts := make([][]byte, streams), make([][]byte, streams)
	for i := range dsts {
		srcs[i], dsts[i] = make([]byte, ceilingBuf), make([]byte, ceilingBuf)
	}
	start := time.Now()
	for i, p := range pairs {
		n := total / int64(streams)
		if i == 0 {
			n += total % int64(streams)
		}
		wg.Add(2)
		go guard(func() error {
			src := srcs[i]
			for left := n; left > 0; {
				k := min(left, int64(len(src)))
				if _, err := p[0].Write(src[:k]); err != nil {
					return err
				}
				left -= k
			}
			return nil
		})
		go guard(func() error {
			dst := dsts[i]
			for left := n; left > 0; {
				k := min(left, int64(len(dst)))
				if _, err := io.ReadFull(p[1], dst[:k]); err != nil {
					return err
				}
				left -= k
			}
			return nil
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("transport: loopback ceiling: %w", err)
	}
	if firstEr != nil {
		return 0, fmt.Errorf("transport: loopback ceiling: %w", firstEr)
	}
	if elapsed <= 0 {
		return 0, errors.New("transport: loopback ceiling: clock did not advance")
	}
	return float64(total) / elapsed.Seconds(), nil
}
