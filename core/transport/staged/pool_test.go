package staged

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/gpu"
)

// poolTest is a pool over a fake GPU host, and its device.
type poolTest struct {
	t    *testing.T
	host *gpu.FakeHost
	dev  gpu.Device
	p    *pool
}

func newPoolTest(t *testing.T, limit, round int) *poolTest {
	host := gpu.NewFakeHost(1)
	dev, _ := host.Device(0)
	return &poolTest{t: t, host: host, dev: dev, p: newPool(limit, round)}
}

// get is p.get with a background context, which must not fail.
func (pt *poolTest) get(n int, wait bool) gpu.HostMem {
	pt.t.Helper()
	m, err := pt.p.get(context.Background(), pt.dev, n, wait)
	require.NoError(pt.t, err)
	return m
}

func TestPool(t *testing.T) {
	pt := newPoolTest(t, 3000, 1000)
	p := pt.p

	a := pt.get(10, false)
	require.Len(t, a.Bytes(), 1000, "sizes round up")
	b := pt.get(1500, false)
	require.Len(t, b.Bytes(), 2000)
	require.Nil(t, pt.get(10, false), "the budget is spent and nothing is idle")

	p.put(a)
	again := pt.get(900, false)
	require.Same(t, a, again, "an idle buffer that fits is reused")
	p.put(again)
	// Nothing idle fits 2500 bytes, but freeing the idle 1000-byte buffer
	// does not make room either while b is lent.
	require.Nil(t, pt.get(2500, false))
	p.put(b)
	big := pt.get(2500, false)
	require.Len(t, big.Bytes(), 3000, "idle buffers too small are freed to make room")
	require.Equal(t, 1, pt.host.HostBuffers())
	p.put(big)
	p.close()
	require.Zero(t, pt.host.HostBuffers())
	require.Zero(t, p.bytes())
}

func TestPoolWaitsForABufferAndCloseWakesWaiters(t *testing.T) {
	pt := newPoolTest(t, 1000, 1000)
	p, dev, ctx := pt.p, pt.dev, context.Background()
	a := pt.get(1000, true)

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

	b := pt.get(1000, true)
	go func() {
		_, err := p.get(ctx, dev, 1000, true)
		got <- err
	}()
	p.close()
	require.ErrorIs(t, <-got, errPoolClosed)
	p.put(b)
	require.Zero(t, pt.host.HostBuffers(), "a buffer returned after close is freed")

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	q := newPoolTest(t, 1, 1)
	m := q.get(1, true)
	_, err := q.p.get(cctx, q.dev, 1, true)
	require.ErrorIs(t, err, context.Canceled)
	q.p.put(m)
	q.p.close()
}

func TestPoolLendsOneBufferBelowBudget(t *testing.T) {
	pt := newPoolTest(t, 10, 1)
	m := pt.get(100, false)
	require.NotNil(t, m, "an empty pool lends one buffer even above its budget")
	pt.p.put(m)
	pt.p.close()
}
