package staged

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/gpu"
)

func TestPool(t *testing.T) {
	host := gpu.NewFakeHost(1)
	dev, _ := host.Device(0)
	ctx := context.Background()

	p := newPool(3000, 1000)
	a, err := p.get(ctx, dev, 10, false)
	require.NoError(t, err)
	require.Len(t, a.Bytes(), 1000, "sizes round up")
	b, err := p.get(ctx, dev, 1500, false)
	require.NoError(t, err)
	require.Len(t, b.Bytes(), 2000)
	none, err := p.get(ctx, dev, 10, false)
	require.NoError(t, err)
	require.Nil(t, none, "the budget is spent and nothing is idle")

	p.put(a)
	again, err := p.get(ctx, dev, 900, false)
	require.NoError(t, err)
	require.Same(t, a, again, "an idle buffer that fits is reused")
	p.put(again)
	// Nothing idle fits 2500 bytes, but freeing the idle 1000-byte buffer
	// does not make room either while b is lent.
	none, err = p.get(ctx, dev, 2500, false)
	require.NoError(t, err)
	require.Nil(t, none)
	p.put(b)
	big, err := p.get(ctx, dev, 2500, false)
	require.NoError(t, err)
	require.Len(t, big.Bytes(), 3000, "idle buffers too small are freed to make room")
	require.Equal(t, 1, host.HostBuffers())
	p.put(big)
	p.close()
	require.Zero(t, host.HostBuffers())
	require.Zero(t, p.bytes())
}

func TestPoolWaitsForABufferAndCloseWakesWaiters(t *testing.T) {
	host := gpu.NewFakeHost(1)
	dev, _ := host.Device(0)
	ctx := context.Background()
	p := newPool(1000, 1000)
	a, err := p.get(ctx, dev, 1000, true)
	require.NoError(t, err)

	got := make(chan error, 1)
	go func() {
		m, err := p.get(ctx, dev, 1000, true)
		if err == nil {
			p.put(m)
		}
		got <- err
	}()
	p.put(a)
	require.NoError(t, <-got, "a waiter gets the buffer that came back")

	b, err := p.get(ctx, dev, 1000, true)
	require.NoError(t, err)
	go func() {
		_, err := p.get(ctx, dev, 1000, true)
		got <- err
	}()
	p.close()
	require.ErrorIs(t, <-got, errPoolClosed)
	p.put(b)
	require.Zero(t, host.HostBuffers(), "a buffer returned after close is freed")

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	q := newPool(1, 1)
	m, err := q.get(ctx, dev, 1, true)
	require.NoError(t, err)
	_, err = q.get(cctx, dev, 1, true)
	require.ErrorIs(t, err, context.Canceled)
	q.put(m)
	q.close()
}

func TestPoolLendsOneBufferBelowBudget(t *testing.T) {
	host := gpu.NewFakeHost(1)
	dev, _ := host.Device(0)
	p := newPool(10, 1)
	m, err := p.get(context.Background(), dev, 100, false)
	require.NoError(t, err)
	require.NotNil(t, m, "an empty pool lends one buffer even above its budget")
	p.put(m)
	p.close()
}
