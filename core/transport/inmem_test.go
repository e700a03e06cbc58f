package transport

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestInmemFaults(t *testing.T) {
	const addr = "consumer-0"
	cases := []struct {
		name   string
		inject func(n *InmemNetwork)
		ctx    time.Duration
		want   []error
		ends   [][]bool
	}{
		{
			name:   "fail next two frames",
			inject: func(n *InmemNetwork) { n.FailNext(addr, 2) },
			want:   []error{ErrConnLost, ErrConnLost, nil},
			ends:   [][]bool{nil, nil, {true}},
		},
		{
			name:   "tear a frame after 40 bytes",
			inject: func(n *InmemNetwork) { n.TearNext(addr, 40) },
			want:   []error{ErrConnLost, nil, nil},
			ends:   [][]bool{{false}, {true}, {true}},
		},
		{
			name:   "delay past the deadline",
			inject: func(n *InmemNetwork) { n.SetDelay(addr, time.Hour) },
			ctx:    20 * time.Millisecond,
			want:   []error{context.DeadlineExceeded, context.DeadlineExceeded, context.DeadlineExceeded},
			ends:   [][]bool{nil, nil, nil},
		},
		{
			name:   "killed listener",
			inject: func(n *InmemNetwork) { require.True(t, n.Kill(addr)) },
			want:   []error{ErrUnreachable, ErrUnreachable, ErrUnreachable},
			ends:   [][]bool{nil, nil, nil},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			network := NewInmemNetwork()
			tr := NewInmem(network)
			sink := newMemSink(1 << 10)
			r := listen(t, tr, addr, sink)
			w := newWriter(t, tr)
			var items []WriteItem
			for i := range 3 {
				res, tok := sink.reserve(t, 100)
				items = append(items, WriteItem{Res: res, Token: tok, Src: randBytes(uint64(i), 100)})
			}
			tc.inject(network)
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			if tc.ctx > 0 {
				ctx, cancel = context.WithTimeout(context.Background(), tc.ctx)
			}
			defer cancel()
			errs := w.Write(ctx, r.Addr(), items)
			for i, want := range tc.want {
				require.ErrorIs(t, errs[i], want, "item %d", i)
				require.Equal(t, tc.ends[i], sink.endsOf(items[i].Res), "item %d", i)
			}
			sink.requireBalanced(t)
		})
	}
}

func TestInmemTearKeepsThePrefix(t *testing.T) {
	network := NewInmemNetwork()
	tr := NewInmem(network)
	sink := newMemSink(1 << 10)
	r := listen(t, tr, "", sink)
	w := newWriter(t, tr)
	res, tok := sink.reserve(t, 100)
	network.TearNext(r.Addr(), 40)
	src := randBytes(1, 100)
	errs := write(t, w, r.Addr(), WriteItem{Res: res, Token: tok, Src: src})
	require.ErrorIs(t, errs[0], ErrConnLost)
	require.Equal(t, src[:40], sink.region(res)[:40])
	require.Equal(t, make([]byte, 60), sink.region(res)[40:])
	require.Zero(t, r.Stats().Frames)
}

func TestInmemListen(t *testing.T) {
	tr := NewInmem(NewInmemNetwork())
	a := listen(t, tr, "", newMemSink(1))
	b := listen(t, tr, "", newMemSink(1))
	require.NotEqual(t, a.Addr(), b.Addr(), "empty addresses get fresh names")
	_, err := tr.Listen(a.Addr(), newMemSink(1))
	require.ErrorContains(t, err, "in use")
	_, err = tr.Listen("x", nil)
	require.Error(t, err)

	require.NoError(t, a.Close())
	listen(t, tr, a.Addr(), newMemSink(1))
	require.False(t, NewInmemNetwork().Kill("nobody"))
}
