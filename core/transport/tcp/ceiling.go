package tcp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// The TCP ceiling is the data plane itself with nothing around it: the
// same writer (a sender goroutine per connection, writev of header and
// chunk, acks read back) and the same receiver (a goroutine per
// connection, bufio'd headers, payloads read straight into place, acks
// written back), with the same Conns, ChunkSize and socket options as the
// transfer it is a ceiling for. Only the reservation logic is gone: the
// sink admits every frame into a region of its own and checks nothing,
// and the sender sends one item after another with no control plane in
// between. So any transfer through the data plane does this work and
// more, and the figure bounds it from above.
//
// A raw loop of plain writes and io.Copy into io.Discard, the ceiling of
// before, was not one: io.Discard reads 8 KiB at a time, a system call
// per 8 KiB where the receiver reads a frame's payload in one, and a host
// with cores to spare moved more through the data plane than through it.
//
// Both ends of a ceiling whose processes are the transfer's are built from
// ListenCeiling (one process per consumer shard) and CeilingSend (the
// producer's process), each run with the GOMAXPROCS of the process it
// stands for; LoopbackCeiling runs both in one process, the ceiling for
// benchmarks whose writer and receiver share one.

// ListenCeiling starts a ceiling receiver on addr: the data plane's own
// receiver, whose sink takes every frame into reused, pre-touched memory,
// cfg.Conns regions of cfg.ChunkSize touched up front (one per connection
// served at once; more are made as needed). Its Stats count the frames
// and bytes that landed.
func ListenCeiling(addr string, cfg TCPConfig) (transport.Receiver, error) {
	t := NewTCP(cfg)
	return t.Listen(addr, newCeilingSink(t.cfg.ChunkSize, t.cfg.Conns))
}

// CeilingSend moves total bytes from this process through the data
// plane's writer to the ceiling receivers at addrs, over cfg.Conns
// connections to each, rounds times over the same connections, and
// returns each round's bytes per second, from its first frame to its last
// ack. Before the first round, each connection is dialed and carries one
// chunk, as the connections of a running producer are open and warm. It
// also returns the bytes it sent in all, the warm-up included, for a
// receiver's count to be checked against. A caller that wants a ceiling
// keeps the fastest round: on a loaded machine that is the one the load
// took least from.
//
// The source is untouched anonymous memory, which the kernel backs with
// its one zero page: no source is cheaper to read, so the figure bounds a
// transfer from any source, however hot in cache.
func CeilingSend(ctx context.Context, addrs []string, cfg TCPConfig, total int64, rounds int) (bytesPerSec []float64, sent int64, err error) {
	t := NewTCP(cfg)
	cfg = t.cfg
	if len(addrs) == 0 || total < int64(len(addrs)) || rounds < 1 {
		return nil, 0, fmt.Errorf("transport: ceiling send: need addresses, a byte for each and a round, got %d, %d and %d",
			len(addrs), total, rounds)
	}
	if err := ctx.Err(); err != nil {
		return nil, 0, fmt.Errorf("transport: ceiling send: %w", err)
	}
	src, err := syscall.Mmap(-1, 0, cfg.ChunkSize, syscall.PROT_READ, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return nil, 0, fmt.Errorf("transport: ceiling send: source: %w", err)
	}
	w := t.NewWriter()
	// Close first: the writer never touches src after its Write returns,
	// but Close is what guarantees no sender goroutine is left either.
	defer func() {
		_ = w.Close()
		_ = syscall.Munmap(src)
	}()

	// One chunk per connection dials the pool and opens the windows.
	warm := make([]int64, len(addrs))
	for i := range warm {
		warm[i] = int64(cfg.Conns) * int64(cfg.ChunkSize)
	}
	if _, err := ceilingRound(ctx, w, addrs, warm, src); err != nil {
		return nil, 0, fmt.Errorf("transport: ceiling send: warm-up: %w", err)
	}
	for _, n := range warm {
		sent += n
	}
	shares := make([]int64, len(addrs))
	for i := range shares {
		shares[i] = total / int64(len(addrs))
	}
	shares[0] += total % int64(len(addrs))
	for r := range rounds {
		elapsed, err := ceilingRound(ctx, w, addrs, shares, src)
		if err != nil {
			return nil, 0, fmt.Errorf("transport: ceiling send: round %d of %d: %w", r+1, rounds, err)
		}
		if elapsed <= 0 {
			return nil, 0, errors.New("transport: ceiling send: clock did not advance")
		}
		sent += total
		bytesPerSec = append(bytesPerSec, float64(total)/elapsed.Seconds())
	}
	return bytesPerSec, sent, nil
}

// ceilingRound writes shares[i] bytes to addrs[i], all destinations at
// once, each as one Write of chunk-sized items (as a producer's batch is
// one Write), and returns how long the slowest took.
func ceilingRound(ctx context.Context, w transport.Writer, addrs []string, shares []int64, src []byte) (time.Duration, error) {
	calls := make([][]transport.WriteItem, len(addrs))
	for i, n := range shares {
		chunk := int64(len(src))
		items := make([]transport.WriteItem, 0, (n+chunk-1)/chunk)
		for left := n; left > 0; left -= chunk {
			k := min(left, chunk)
			items = append(items, transport.WriteItem{Res: ids.ResID(len(items) + 1), Src: src[:k]})
		}
		calls[i] = items
	}
	errs := make([]error, len(addrs))
	var wg sync.WaitGroup
	start := time.Now()
	for i, items := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = errors.Join(w.Write(ctx, addrs[i], items)...)
		}()
	}
	wg.Wait()
	return time.Since(start), errors.Join(errs...)
}

// LoopbackCeiling measures the data plane over 127.0.0.1 with both ends in
// this process: total bytes over streams connections, default chunk size
// and socket options, in bytes per second. It is the ceiling for a
// benchmark whose writer and receiver share one process and so one
// GOMAXPROCS.
func LoopbackCeiling(ctx context.Context, total int64, streams int) (bytesPerSec float64, err error) {
	if total <= 0 || streams <= 0 {
		return 0, fmt.Errorf("transport: loopback ceiling: need total > 0 and streams > 0, got %d and %d", total, streams)
	}
	cfg := TCPConfig{Conns: streams}
	r, err := ListenCeiling("127.0.0.1:0", cfg)
	if err != nil {
		return 0, fmt.Errorf("transport: loopback ceiling: %w", err)
	}
	defer r.Close()
	bps, _, err := CeilingSend(ctx, []string{r.Addr()}, cfg, total, 1)
	if err != nil {
		return 0, fmt.Errorf("transport: loopback ceiling: %w", err)
	}
	return bps[0], nil
}

// ceilingSink admits every frame into a region of its own: regions of the
// chunk size are reused once their frame ends, so that after the first
// frame of each connection none is faulted in on the clock, and a region
// is never shared by two frames at once. Every page of a region is
// touched when it is made, as a shard touches its slab.
type ceilingSink struct {
	size int
	mu   sync.Mutex
	free [][]byte
}

func newCeilingSink(size, regions int) *ceilingSink {
	s := &ceilingSink{size: size}
	for range regions {
		s.free = append(s.free, touched(size))
	}
	return s
}

func touched(n int) []byte {
	b := make([]byte, n)
	for i := 0; i < n; i += 4096 {
		b[i] = 1
	}
	return b
}

func (s *ceilingSink) region(n uint64) []byte {
	if n > uint64(s.size) {
		return touched(int(n))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if k := len(s.free); k > 0 {
		b := s.free[k-1]
		s.free = s.free[:k-1]
		return b
	}
	return touched(s.size)
}

func (s *ceilingSink) put(b []byte) {
	if len(b) != s.size {
		return
	}
	s.mu.Lock()
	s.free = append(s.free, b)
	s.mu.Unlock()
}

// BeginFrame implements FrameSink, the path the TCP receiver takes.
func (s *ceilingSink) BeginFrame(_ ids.ResID, _ ids.Token, _, n uint64) (transport.Frame, error) {
	return &ceilingFrame{s: s, buf: s.region(n), n: n}, nil
}

// BeginWrite implements Sink for a transport that does not ask for frames;
// its region is not reused.
func (s *ceilingSink) BeginWrite(_ ids.ResID, _ ids.Token, _, n uint64) ([]byte, error) {
	return touched(int(n)), nil
}

func (s *ceilingSink) EndWrite(ids.ResID, bool) {}

type ceilingFrame struct {
	s   *ceilingSink
	buf []byte
	n   uint64
}

func (f *ceilingFrame) Bytes() []byte { return f.buf[:f.n] }

func (f *ceilingFrame) End(bool) error {
	f.s.put(f.buf)
	return nil
}
