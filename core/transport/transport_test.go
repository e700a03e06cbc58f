package transport

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/stretchr/testify/require"
)

// testTimeout bounds each Write so that a bug shows up as a failed test,
// not a hung one.
const testTimeout = 60 * time.Second

var quiet = slog.New(slog.DiscardHandler)

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
			_, _, err := OpenFrame(c.sink, 1, ids.Token{1}, c.off, c.n, false)
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
		want     []Span
	}{
		{0, c, []Span{{0, 0}}},
		{1, c, []Span{{0, 1}}},
		{c, c, []Span{{0, c}}},
		{c + 1, c, []Span{{0, c/2 + chunkAlign}, {c/2 + chunkAlign, c + 1}}},
		{4 * c, c, []Span{{0, c}, {c, 2 * c}, {2 * c, 3 * c}, {3 * c, 4 * c}}},
		{10, 3, []Span{{0, 3}, {3, 6}, {6, 9}, {9, 10}}},
	}
	for _, tc := range cases {
		got := Split(tc.n, tc.chunk)
		require.Equal(t, tc.want, got, "split(%d, %d)", tc.n, tc.chunk)
		for i, sp := range got {
			require.LessOrEqual(t, sp.End-sp.Off, tc.chunk)
			if i > 0 {
				require.Equal(t, got[i-1].End, sp.Off, "spans are contiguous")
			}
		}
	}
}
