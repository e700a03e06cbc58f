package tcp

import (
	"context"
	"errors"
	"testing"

	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/stretchr/testify/require"
)

func TestLoopbackCeiling(t *testing.T) {
	bps, err := LoopbackCeiling(context.Background(), 16<<20, 2)
	require.NoError(t, err)
	require.Positive(t, bps)

	_, err = LoopbackCeiling(context.Background(), 0, 2)
	require.Error(t, err)
	_, err = LoopbackCeiling(context.Background(), 1, 0)
	require.Error(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = LoopbackCeiling(ctx, 1<<30, 2)
	require.True(t, errors.Is(err, context.Canceled), "%v", err)
}

// Two receivers, as two consumer shards would be, each served by two of
// the sender's connections through the data plane's writer: every byte
// sent, warm-up included, lands as a frame of at most the chunk size.
func TestCeilingSendReceive(t *testing.T) {
	const chunk = 1 << 20
	const total = 16<<20 + 3 // not a multiple of the receivers or the chunk
	cfg := TCPConfig{Conns: 2, ChunkSize: chunk}
	rs := make([]transport.Receiver, 2)
	addrs := make([]string, len(rs))
	for i := range rs {
		r, err := ListenCeiling("127.0.0.1:0", cfg)
		require.NoError(t, err)
		t.Cleanup(func() { _ = r.Close() })
		rs[i], addrs[i] = r, r.Addr()
	}
	bps, sent, err := CeilingSend(context.Background(), addrs, cfg, total, 2)
	require.NoError(t, err)
	require.Len(t, bps, 2)
	require.Positive(t, bps[0])
	require.Positive(t, bps[1])
	require.Equal(t, int64(2*total+2*2*chunk), sent, "two rounds and one chunk per connection")
	var landed, frames uint64
	for _, r := range rs {
		st := r.Stats()
		require.Empty(t, st.Rejected)
		landed += st.Bytes
		frames += st.Frames
	}
	require.Equal(t, uint64(sent), landed)
	// Each round: 8 whole chunks and a tail (2 bytes, 1 byte) to each;
	// and the warm-up's 2 per receiver.
	require.Equal(t, uint64(2*(9+9)+2+2), frames)

	_, _, err = CeilingSend(context.Background(), nil, cfg, total, 1)
	require.Error(t, err)
	_, _, err = CeilingSend(context.Background(), addrs, cfg, 1, 1)
	require.Error(t, err)
	_, _, err = CeilingSend(context.Background(), addrs, cfg, total, 0)
	require.Error(t, err)
}

// A sender whose receiver is gone fails instead of waiting.
func TestCeilingSendNoReceiver(t *testing.T) {
	r, err := ListenCeiling("127.0.0.1:0", TCPConfig{})
	require.NoError(t, err)
	addr := r.Addr()
	require.NoError(t, r.Close())
	_, _, err = CeilingSend(context.Background(), []string{addr}, TCPConfig{Conns: 1, ChunkSize: 64 << 10}, 1<<20, 1)
	require.ErrorIs(t, err, transport.ErrUnreachable)
}

// A region serves one frame at a time and is reused once that frame ends;
// a frame larger than the chunk size gets memory of its own.
func TestCeilingSinkRegions(t *testing.T) {
	s := newCeilingSink(4096, 1)
	a, err := s.BeginFrame(1, [16]byte{}, 0, 4096)
	require.NoError(t, err)
	b, err := s.BeginFrame(2, [16]byte{}, 0, 100)
	require.NoError(t, err)
	require.Len(t, a.Bytes(), 4096)
	require.Len(t, b.Bytes(), 100)
	require.NotSame(t, &a.Bytes()[0], &b.Bytes()[0], "two open frames share a region")
	require.NoError(t, a.End(true))
	c, err := s.BeginFrame(3, [16]byte{}, 0, 10)
	require.NoError(t, err)
	require.Same(t, &a.Bytes()[0], &c.Bytes()[0], "an ended frame's region is not reused")
	big, err := s.BeginFrame(4, [16]byte{}, 0, 8192)
	require.NoError(t, err)
	require.Len(t, big.Bytes(), 8192)
	require.NoError(t, big.End(true))
	require.NoError(t, b.End(false))
	require.NoError(t, c.End(true))
	require.Len(t, s.free, 2, "the large frame's memory is not pooled")
}
