package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/stretchr/testify/require"
)

// testTimeout bounds each Write so that a bug shows up as a failed test,
// not a hung one.
const testTimeout = 60 * time.Second

var quiet = slog.New(slog.DiscardHandler)

type harness struct {
	name string
	tr   Transport
	addr string
}

// transports lists every implementation the shared tests run against.
func transports() []harness {
	return []harness{
		{"tcp", NewTCP(TCPConfig{Logger: quiet}), "127.0.0.1:0"},
		{"inmem", NewInmem(NewInmemNetwork()), ""},
	}
}

// eachTransport runs body as a subtest for each transport, with a
// receiver of it in front of a sink of sinkBytes.
func eachTransport(t *testing.T, sinkBytes int, body func(t *testing.T, h harness, sink *memSink, r Receiver)) {
	for _, h := range transports() {
		t.Run(h.name, func(t *testing.T) {
			sink := newMemSink(sinkBytes)
			body(t, h, sink, listen(t, h.tr, h.addr, sink))
		})
	}
}

func listen(t testing.TB, tr Transport, addr string, sink Sink) Receiver {
	t.Helper()
	r, err := tr.Listen(addr, sink)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func newWriter(t testing.TB, tr Transport) Writer {
	t.Helper()
	w := tr.NewWriter()
	t.Cleanup(func() { _ = w.Close() })
	return w
}

func write(t testing.TB, w Writer, dest string, items ...WriteItem) []error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	errs := w.Write(ctx, dest, items)
	require.Len(t, errs, len(items))
	return errs
}

func requireLanded(t testing.TB, sink *memSink, items []WriteItem, errs []error) {
	t.Helper()
	for i, it := range items {
		require.NoError(t, errs[i], "item %d", i)
		require.True(t, bytes.Equal(it.Src, sink.region(it.Res)), "item %d (%d bytes) not bit-exact", i, len(it.Src))
	}
}

func TestRoundTripSizes(t *testing.T) {
	sizes := []int{1, 100, 4096, 64<<10 + 3, 1 << 20, DefaultChunkSize, DefaultChunkSize + 1, 32_000_000, 64 << 20}
	eachTransport(t, 120<<20, func(t *testing.T, h harness, sink *memSink, r Receiver) {
		w := newWriter(t, h.tr)
		var frames uint64
		var total uint64
		for i, n := range sizes {
			t.Run(fmt.Sprint(n), func(t *testing.T) {
				res, tok := sink.reserve(t, n)
				it := WriteItem{Res: res, Token: tok, Src: randBytes(uint64(i), n)}
				errs := write(t, w, r.Addr(), it)
				requireLanded(t, sink, []WriteItem{it}, errs)
				want := len(split(n, DefaultChunkSize))
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
	eachTransport(t, 64<<20, func(t *testing.T, h harness, sink *memSink, r Receiver) {
		w := newWriter(t, h.tr)
		rng := rand.New(rand.NewPCG(1, 2))
		var items []WriteItem
		for i := range 300 {
			n := rng.IntN(20_000)
			if i%100 == 7 {
				n = DefaultChunkSize + rng.IntN(1<<20)
			}
			res, tok := sink.reserve(t, n)
			items = append(items, WriteItem{Res: res, Token: tok, Src: randBytes(uint64(i), n)})
		}
		requireLanded(t, sink, items, write(t, w, r.Addr(), items...))
	})
}

func TestConcurrentWriters(t *testing.T) {
	const writers, batches, perBatch = 6, 4, 8
	eachTransport(t, 200<<20, func(t *testing.T, h harness, sink *memSink, r Receiver) {
		batchItems := make([][][]WriteItem, writers)
		for wi := range writers {
			for b := range batches {
				var items []WriteItem
				for k := range perBatch {
					n := 1 + (wi*7919+b*104729+k*31)%(256<<10)
					if k == 0 && b == 0 {
						n = DefaultChunkSize + 12345
					}
					res, tok := sink.reserve(t, n)
					items = append(items, WriteItem{Res: res, Token: tok, Src: randBytes(uint64(res), n)})
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
	eachTransport(t, 1<<20, func(t *testing.T, h harness, sink *memSink, r Receiver) {
		w := newWriter(t, h.tr)
		good, goodTok := sink.reserve(t, 1000)
		small, smallTok := sink.reserve(t, 1000)
		gone, goneTok := sink.reserve(t, 1000)
		sink.markGone(gone)
		var wrongTok ids.Token
		wrongTok[0] = 1

		cases := []struct {
			name string
			item WriteItem
			want error
		}{
			{"good", WriteItem{Res: good, Token: goodTok, Src: randBytes(1, 1000)}, nil},
			{"bad token", WriteItem{Res: good, Token: wrongTok, Src: randBytes(2, 10)}, ErrBadToken},
			{"unknown res", WriteItem{Res: ids.ResID(9999), Token: goodTok, Src: randBytes(3, 10)}, ErrUnknownRes},
			{"larger than reservation", WriteItem{Res: small, Token: smallTok, Src: randBytes(4, 1001)}, ErrOutOfBounds},
			{"chunked, larger than reservation", WriteItem{Res: small, Token: smallTok, Src: randBytes(5, DefaultChunkSize+1)}, ErrOutOfBounds},
			{"sink says gone", WriteItem{Res: gone, Token: goneTok, Src: randBytes(6, 10)}, ErrGone},
			{"good after refusals", WriteItem{Res: small, Token: smallTok, Src: randBytes(7, 1000)}, nil},
		}
		items := make([]WriteItem, len(cases))
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
			require.ErrorIs(t, errs[i], ErrRejected, c.name)
			require.Contains(t, errs[i].Error(), r.Addr(), "%s: error names the destination", c.name)
		}
		require.Equal(t, map[string]uint64{"bad_token": 1, "unknown_res": 1, "out_of_bounds": 3, "gone": 1}, r.Stats().Rejected)

		// The path stays usable after refusals.
		again := WriteItem{Res: good, Token: goodTok, Src: randBytes(8, 1000)}
		requireLanded(t, sink, []WriteItem{again}, write(t, w, r.Addr(), again))
		require.Zero(t, r.Stats().BadConns)
	})
}

func TestWriteAfterClose(t *testing.T) {
	eachTransport(t, 1<<10, func(t *testing.T, h harness, sink *memSink, r Receiver) {
		res, tok := sink.reserve(t, 10)
		w := h.tr.NewWriter()
		require.NoError(t, w.Close())
		require.NoError(t, w.Close(), "Close is idempotent")
		errs := write(t, w, r.Addr(), WriteItem{Res: res, Token: tok, Src: make([]byte, 10)})
		require.ErrorIs(t, errs[0], ErrClosed)
		require.Zero(t, sink.beginCount())
	})
}

func TestWriteToNobody(t *testing.T) {
	eachTransport(t, 1<<10, func(t *testing.T, h harness, sink *memSink, r Receiver) {
		dest := r.Addr()
		require.NoError(t, r.Close())
		w := newWriter(t, h.tr)
		errs := write(t, w, dest, WriteItem{Res: 1, Token: ids.Token{1}, Src: make([]byte, 10)}, WriteItem{Res: 2, Token: ids.Token{1}, Src: nil})
		for _, err := range errs {
			require.ErrorIs(t, err, ErrUnreachable)
			require.Contains(t, err.Error(), dest)
		}
	})
}

func TestExpiredContextSendsNothing(t *testing.T) {
	eachTransport(t, 1<<10, func(t *testing.T, h harness, sink *memSink, r Receiver) {
		res, tok := sink.reserve(t, 10)
		w := newWriter(t, h.tr)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		errs := w.Write(ctx, r.Addr(), []WriteItem{{Res: res, Token: tok, Src: make([]byte, 10)}})
		require.ErrorIs(t, errs[0], context.Canceled)
		require.Zero(t, sink.beginCount())
		require.Empty(t, w.Write(context.Background(), r.Addr(), nil))
	})
}

// shortSink hands out fewer bytes than asked, a sink bug the transport
// must contain.
type shortSink struct{ ended []bool }

func (s *shortSink) BeginWrite(ids.ResID, ids.Token, uint64, uint64) ([]byte, error) {
	return make([]byte, 1), nil
}
func (s *shortSink) EndWrite(_ ids.ResID, ok bool) { s.ended = append(s.ended, ok) }

func TestOpenFrame(t *testing.T) {
	plain := errors.New("plain sink error")
	cases := []struct {
		name       string
		sink       Sink
		off, n     uint64
		want       error
		wantStatus Status
	}{
		{"overflow never reaches the sink", nil, ^uint64(0) - 5, 10, ErrOutOfBounds, StatusOutOfBounds},
		{"short dst", &shortSink{}, 0, 10, ErrRejected, StatusOther},
		{"unclassified sink error", errSink{plain}, 0, 10, plain, StatusOther},
		{"classified sink error", errSink{fmt.Errorf("x: %w", ErrGone)}, 0, 10, ErrGone, StatusGone},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, _, err := openFrame(c.sink, 1, ids.Token{1}, c.off, c.n)
			require.ErrorIs(t, err, c.want)
			require.ErrorIs(t, err, ErrRejected)
			require.Equal(t, c.wantStatus, statusOf(err))
			if s, ok := c.sink.(*shortSink); ok {
				require.Equal(t, []bool{false}, s.ended, "a refused successful BeginWrite still gets its EndWrite")
			}
		})
	}
}

type errSink struct{ err error }

func (s errSink) BeginWrite(ids.ResID, ids.Token, uint64, uint64) ([]byte, error) { return nil, s.err }
func (s errSink) EndWrite(ids.ResID, bool)                                        { panic("EndWrite after a failed BeginWrite") }

func TestStatusMapping(t *testing.T) {
	cases := []struct {
		s    Status
		name string
		err  error
	}{
		{StatusOK, "ok", nil},
		{StatusOther, "other", ErrRejected},
		{StatusBadToken, "bad_token", ErrBadToken},
		{StatusUnknownRes, "unknown_res", ErrUnknownRes},
		{StatusOutOfBounds, "out_of_bounds", ErrOutOfBounds},
		{StatusGone, "gone", ErrGone},
		{Status(999), "status_999", ErrRejected},
	}
	for _, c := range cases {
		require.Equal(t, c.name, c.s.String())
		require.Equal(t, c.err, errOf(c.s))
		if c.s <= StatusGone {
			require.Equal(t, c.s, statusOf(errOf(c.s)), "statusOf inverts errOf for %s", c.s)
		}
	}
}

func TestSplit(t *testing.T) {
	const c = 1 << 20
	cases := []struct {
		n, chunk int
		want     []span
	}{
		{0, c, []span{{0, 0}}},
		{1, c, []span{{0, 1}}},
		{c, c, []span{{0, c}}},
		{c + 1, c, []span{{0, c/2 + chunkAlign}, {c/2 + chunkAlign, c + 1}}},
		{4 * c, c, []span{{0, c}, {c, 2 * c}, {2 * c, 3 * c}, {3 * c, 4 * c}}},
		{10, 3, []span{{0, 3}, {3, 6}, {6, 9}, {9, 10}}},
	}
	for _, tc := range cases {
		got := split(tc.n, tc.chunk)
		require.Equal(t, tc.want, got, "split(%d, %d)", tc.n, tc.chunk)
		for i, sp := range got {
			require.LessOrEqual(t, sp.end-sp.off, tc.chunk)
			if i > 0 {
				require.Equal(t, got[i-1].end, sp.off, "spans are contiguous")
			}
		}
	}
}
