package tcp

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/stretchr/testify/require"
)

// testTimeout bounds each Write so that a bug shows up as a failed test,
// not a hung one.
const testTimeout = 60 * time.Second

var quiet = slog.New(slog.DiscardHandler)

type harness struct {
	name string
	tr   transport.Transport
	addr string
}

// transports lists every implementation the shared tests run against.
func transports() []harness {
	return []harness{
		{"tcp", NewTCP(TCPConfig{Logger: quiet}), "127.0.0.1:0"},
		{"inmem", transport.NewInmem(transport.NewInmemNetwork()), ""},
	}
}

// eachTransport runs body as a subtest for each transport, with a
// receiver of it in front of a sink of sinkBytes.
func eachTransport(t *testing.T, sinkBytes int, body func(t *testing.T, h harness, sink *memSink, r transport.Receiver)) {
	for _, h := range transports() {
		t.Run(h.name, func(t *testing.T) {
			sink := newMemSink(sinkBytes)
			body(t, h, sink, listen(t, h.tr, h.addr, sink))
		})
	}
}

func listen(t testing.TB, tr transport.Transport, addr string, sink transport.Sink) transport.Receiver {
	t.Helper()
	r, err := tr.Listen(addr, sink)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func newWriter(t testing.TB, tr transport.Transport) transport.Writer {
	t.Helper()
	w := tr.NewWriter()
	t.Cleanup(func() { _ = w.Close() })
	return w
}

func write(t testing.TB, w transport.Writer, dest string, items ...transport.WriteItem) []error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	errs := w.Write(ctx, dest, items)
	require.Len(t, errs, len(items))
	return errs
}

func requireLanded(t testing.TB, sink *memSink, items []transport.WriteItem, errs []error) {
	t.Helper()
	for i, it := range items {
		require.NoError(t, errs[i], "item %d", i)
		require.True(t, bytes.Equal(it.Src, sink.region(it.Res)), "item %d (%d bytes) not bit-exact", i, len(it.Src))
	}
}

func TestRoundTripSizes(t *testing.T) {
	sizes := []int{1, 100, 4096, 64<<10 + 3, 1 << 20, DefaultChunkSize, DefaultChunkSize + 1, 32_000_000, 64 << 20}
	eachTransport(t, 120<<20, func(t *testing.T, h harness, sink *memSink, r transport.Receiver) {
		w := newWriter(t, h.tr)
		var frames uint64
		var total uint64
		for i, n := range sizes {
			t.Run(fmt.Sprint(n), func(t *testing.T) {
				res, tok := sink.reserve(t, n)
				it := transport.WriteItem{Res: res, Token: tok, Src: randBytes(uint64(i), n)}
				errs := write(t, w, r.Addr(), it)
				requireLanded(t, sink, []transport.WriteItem{it}, errs)
				want := len(transport.Split(n, DefaultChunkSize))
				ends := sink.endsOf(res)
				require.Len(t, ends, want, "one EndWrite per frame")
				require.NotContains(t, ends, false)
				frames += uint64(want)
				total += uint64(n)
			})
		}
		st := r.Stats()
		require.Equal(t, frames, st.Frames)
		require.Equal(t, total, st.Bytes)
		require.Empty(t, st.Rejected)
	})
}

func TestManyItemsPerBatch(t *testing.T) {
	eachTransport(t, 64<<20, func(t *testing.T, h harness, sink *memSink, r transport.Receiver) {
		w := newWriter(t, h.tr)
		rng := rand.New(rand.NewPCG(1, 2))
		var items []transport.WriteItem
		for i := range 300 {
			n := rng.IntN(20_000)
			if i%100 == 7 {
				n = DefaultChunkSize + rng.IntN(1<<20)
			}
			res, tok := sink.reserve(t, n)
			items = append(items, transport.WriteItem{Res: res, Token: tok, Src: randBytes(uint64(i), n)})
		}
		requireLanded(t, sink, items, write(t, w, r.Addr(), items...))
	})
}

func TestConcurrentWriters(t *testing.T) {
	const writers, batches, perBatch = 6, 4, 8
	eachTransport(t, 200<<20, func(t *testing.T, h harness, sink *memSink, r transport.Receiver) {
		batchItems := make([][][]transport.WriteItem, writers)
		for wi := range writers {
			for b := range batches {
				var items []transport.WriteItem
				for k := range perBatch {
					n := 1 + (wi*7919+b*104729+k*31)%(256<<10)
					if k == 0 && b == 0 {
						n = DefaultChunkSize + 12345
					}
					res, tok := sink.reserve(t, n)
					items = append(items, transport.WriteItem{Res: res, Token: tok, Src: randBytes(uint64(res), n)})
				}
				batchItems[wi] = append(batchItems[wi], items)
			}
		}
		var wg sync.WaitGroup
		results := make([][][]error, writers)
		for wi := range writers {
			w := newWriter(t, h.tr)
			wg.Go(func() {
				for _, items := range batchItems[wi] {
					ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
					results[wi] = append(results[wi], w.Write(ctx, r.Addr(), items))
					cancel()
				}
			})
		}
		wg.Wait()
		for wi := range writers {
			for b, items := range batchItems[wi] {
				requireLanded(t, sink, items, results[wi][b])
			}
		}
	})
}

func TestRejectionsArePerItem(t *testing.T) {
	eachTransport(t, 1<<20, func(t *testing.T, h harness, sink *memSink, r transport.Receiver) {
		w := newWriter(t, h.tr)
		good, goodTok := sink.reserve(t, 1000)
		small, smallTok := sink.reserve(t, 1000)
		gone, goneTok := sink.reserve(t, 1000)
		sink.markGone(gone)
		var wrongTok ids.Token
		wrongTok[0] = 1

		cases := []struct {
			name string
			item transport.WriteItem
			want error
		}{
			{"good", transport.WriteItem{Res: good, Token: goodTok, Src: randBytes(1, 1000)}, nil},
			{"bad token", transport.WriteItem{Res: good, Token: wrongTok, Src: randBytes(2, 10)}, transport.ErrBadToken},
			{"unknown res", transport.WriteItem{Res: ids.ResID(9999), Token: goodTok, Src: randBytes(3, 10)}, transport.ErrUnknownRes},
			{"larger than reservation", transport.WriteItem{Res: small, Token: smallTok, Src: randBytes(4, 1001)}, transport.ErrOutOfBounds},
			{"chunked, larger than reservation", transport.WriteItem{Res: small, Token: smallTok, Src: randBytes(5, DefaultChunkSize+1)}, transport.ErrOutOfBounds},
			{"sink says gone", transport.WriteItem{Res: gone, Token: goneTok, Src: randBytes(6, 10)}, transport.ErrGone},
			{"good after refusals", transport.WriteItem{Res: small, Token: smallTok, Src: randBytes(7, 1000)}, nil},
		}
		items := make([]transport.WriteItem, len(cases))
		for i, c := range cases {
			items[i] = c.item
		}
		errs := write(t, w, r.Addr(), items...)
		for i, c := range cases {
			if c.want == nil {
				require.NoError(t, errs[i], c.name)
				require.True(t, bytes.Equal(c.item.Src, sink.region(c.item.Res)), c.name)
				continue
			}
			require.ErrorIs(t, errs[i], c.want, c.name)
			require.ErrorIs(t, errs[i], transport.ErrRejected, c.name)
			require.Contains(t, errs[i].Error(), r.Addr(), "%s: error names the destination", c.name)
		}
		require.Equal(t, map[string]uint64{"bad_token": 1, "unknown_res": 1, "out_of_bounds": 3, "gone": 1}, r.Stats().Rejected)

		// The path stays usable after refusals.
		again := transport.WriteItem{Res: good, Token: goodTok, Src: randBytes(8, 1000)}
		requireLanded(t, sink, []transport.WriteItem{again}, write(t, w, r.Addr(), again))
		require.Zero(t, r.Stats().BadConns)
	})
}

func TestWriteAfterClose(t *testing.T) {
	eachTransport(t, 1<<10, func(t *testing.T, h harness, sink *memSink, r transport.Receiver) {
		res, tok := sink.reserve(t, 10)
		w := h.tr.NewWriter()
		require.NoError(t, w.Close())
		require.NoError(t, w.Close(), "Close is idempotent")
		errs := write(t, w, r.Addr(), transport.WriteItem{Res: res, Token: tok, Src: make([]byte, 10)})
		require.ErrorIs(t, errs[0], transport.ErrClosed)
		require.Zero(t, sink.beginCount())
	})
}

func TestWriteToNobody(t *testing.T) {
	eachTransport(t, 1<<10, func(t *testing.T, h harness, sink *memSink, r transport.Receiver) {
		dest := r.Addr()
		require.NoError(t, r.Close())
		w := newWriter(t, h.tr)
		errs := write(t, w, dest, transport.WriteItem{Res: 1, Token: ids.Token{1}, Src: make([]byte, 10)}, transport.WriteItem{Res: 2, Token: ids.Token{1}, Src: nil})
		for _, err := range errs {
			require.ErrorIs(t, err, transport.ErrUnreachable)
			require.Contains(t, err.Error(), dest)
		}
	})
}

func TestExpiredContextSendsNothing(t *testing.T) {
	eachTransport(t, 1<<10, func(t *testing.T, h harness, sink *memSink, r transport.Receiver) {
		res, tok := sink.reserve(t, 10)
		w := newWriter(t, h.tr)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		errs := w.Write(ctx, r.Addr(), []transport.WriteItem{{Res: res, Token: tok, Src: make([]byte, 10)}})
		require.ErrorIs(t, errs[0], context.Canceled)
		require.Zero(t, sink.beginCount())
		require.Empty(t, w.Write(context.Background(), r.Addr(), nil))
	})
}
