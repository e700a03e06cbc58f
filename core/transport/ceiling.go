package transport

import (
	"context"
	"encoding/binary"
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

// The two halves of a ceiling whose ends run in different processes, as a
// producer and a consumer shard do: one process runs CeilingReceive on a
// listener, another runs CeilingSend to it. Measuring both ends inside one
// runtime would give them one GOMAXPROCS between them while the transfer
// gives each process its own, and the ceiling would sit below the transfer.
//
// A round on each connection: the receiver sends one go byte once it has
// accepted the connection, the sender waits for every go before its clock
// starts, writes its share, half-closes, and the receiver reads to EOF and
// answers with the count it read (8 bytes, big-endian). The sender's clock
// stops at the last count, so the span covers every byte's arrival and
// only one small frame more.
const ceilingGo = 'g'

// CeilingReceive serves one round on ln: accepts conns connections and
// reads each to EOF; returns the bytes read over all of them.
func CeilingReceive(ctx context.Context, ln net.Listener, conns int) (int64, error) {
	if conns <= 0 {
		return 0, fmt.Errorf("transport: ceiling receive: need conns > 0, got %d", conns)
	}
	accepted := make([]net.Conn, 0, conns)
	var mu sync.Mutex
	stop := context.AfterFunc(ctx, func() {
		if d, ok := ln.(interface{ SetDeadline(time.Time) error }); ok {
			_ = d.SetDeadline(longAgo)
		}
		mu.Lock()
		defer mu.Unlock()
		for _, c := range accepted {
			_ = c.SetDeadline(longAgo)
		}
	})
	defer stop()
	defer func() {
		for _, c := range accepted {
			_ = c.Close()
		}
	}()
	var g ceilingGroup
	counts := make([]int64, conns)
	for i := range conns {
		c, err := ln.Accept()
		if err != nil {
			// Readers already started would wait for a sender that is gone.
			mu.Lock()
			for _, c := range accepted {
				_ = c.SetDeadline(longAgo)
			}
			mu.Unlock()
			_ = g.wait()
			return 0, fmt.Errorf("transport: ceiling receive: accept %d of %d: %w", i+1, conns, errors.Join(ctx.Err(), err))
		}
		mu.Lock()
		accepted = append(accepted, c)
		mu.Unlock()
		if ctx.Err() != nil {
			_ = c.SetDeadline(longAgo)
		}
		g.run(func() error {
			if _, err := c.Write([]byte{ceilingGo}); err != nil {
				return fmt.Errorf("go: %w", err)
			}
			n, err := io.CopyBuffer(io.Discard, c, make([]byte, ceilingBuf))
			if err != nil {
				return fmt.Errorf("read after %d bytes: %w", n, err)
			}
			counts[i] = n
			var ack [8]byte
			binary.BigEndian.PutUint64(ack[:], uint64(n))
			if _, err := c.Write(ack[:]); err != nil {
				return fmt.Errorf("count: %w", err)
			}
			return nil
		})
	}
	if err := g.wait(); err != nil {
		return 0, fmt.Errorf("transport: ceiling receive: %w", errors.Join(ctx.Err(), err))
	}
	var total int64
	for _, n := range counts {
		total += n
	}
	return total, nil
}

// CeilingSend dials conns connections to each of addrs and moves total
// bytes over all of them; returns the bytes per second from the first
// write to the last count.
func CeilingSend(ctx context.Context, addrs []string, conns int, total int64) (bytesPerSec float64, err error) {
	streams := len(addrs) * conns
	if streams <= 0 || total < int64(streams) {
		return 0, fmt.Errorf("transport: ceiling send: need addresses, conns > 0 and total >= streams, got %d, %d and %d",
			len(addrs), conns, total)
	}
	var d net.Dialer
	out := make([]net.Conn, 0, streams)
	defer func() {
		for _, c := range out {
			_ = c.Close()
		}
	}()
	for _, addr := range addrs {
		for range conns {
			c, err := d.DialContext(ctx, "tcp", addr)
			if err != nil {
				return 0, fmt.Errorf("transport: ceiling send: dial %s: %w", addr, err)
			}
			out = append(out, c)
		}
	}
	stop := context.AfterFunc(ctx, func() {
		for _, c := range out {
			_ = c.SetDeadline(longAgo)
		}
	})
	defer stop()
	for _, c := range out {
		var b [1]byte
		if _, err := io.ReadFull(c, b[:]); err != nil || b[0] != ceilingGo {
			return 0, fmt.Errorf("transport: ceiling send: no go from %s: %w", c.RemoteAddr(), errors.Join(ctx.Err(), err))
		}
	}
	// As in LoopbackCeiling: a source per stream, so that no single buffer
	// sits in cache for all of them.
	srcs := make([][]byte, streams)
	for i := range srcs {
		srcs[i] = make([]byte, ceilingBuf)
	}
	var g ceilingGroup
	start := time.Now()
	for i, c := range out {
		n := total / int64(streams)
		if i == 0 {
			n += total % int64(streams)
		}
		g.run(func() error {
			src := srcs[i]
			for left := n; left > 0; {
				k := min(left, int64(len(src)))
				if _, err := c.Write(src[:k]); err != nil {
					return fmt.Errorf("write to %s: %w", c.RemoteAddr(), err)
				}
				left -= k
			}
			if err := c.(*net.TCPConn).CloseWrite(); err != nil {
				return fmt.Errorf("close write to %s: %w", c.RemoteAddr(), err)
			}
			var ack [8]byte
			if _, err := io.ReadFull(c, ack[:]); err != nil {
				return fmt.Errorf("count from %s: %w", c.RemoteAddr(), err)
			}
			if got := int64(binary.BigEndian.Uint64(ack[:])); got != n {
				return fmt.Errorf("%s read %d bytes, %d were written", c.RemoteAddr(), got, n)
			}
			return nil
		})
	}
	err = g.wait()
	elapsed := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("transport: ceiling send: %w", errors.Join(ctx.Err(), err))
	}
	if elapsed <= 0 {
		return 0, errors.New("transport: ceiling send: clock did not advance")
	}
	return float64(total) / elapsed.Seconds(), nil
}

// ceilingGroup runs functions on goroutines and keeps the first error,
// turning a panic into one.
type ceilingGroup struct {
	wg    sync.WaitGroup
	mu    sync.Mutex
	first error
}

func (g *ceilingGroup) run(f func() error) {
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		defer func() {
			if p := recover(); p != nil {
				g.fail(fmt.Errorf("panic: %v", p))
			}
		}()
		if err := f(); err != nil {
			g.fail(err)
		}
	}()
}

func (g *ceilingGroup) fail(err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.first == nil {
		g.first = err
	}
}

func (g *ceilingGroup) wait() error {
	g.wg.Wait()
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.first
}
