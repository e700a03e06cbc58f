package tcp

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// completingSink is a memSink that completes in-band: it records the bytes
// each frame that carried the completion brought, and ends its write.
type completingSink struct {
	*memSink
	mu     sync.Mutex
	landed map[ids.ResID]uint64
}

func (s *completingSink) EndComplete(res ids.ResID, tok ids.Token, off, n uint64) error {
	s.mu.Lock()
	s.landed[res] += n
	s.mu.Unlock()
	s.EndWrite(res, true)
	return nil
}

// An item that asks for in-band completion reaches the sink's EndComplete
// from every one of its frames, however many it is cut into; an item that
// does not ends its frames with EndWrite.
func TestInBandFramesReachEndComplete(t *testing.T) {
	for _, h := range transports() {
		t.Run(h.name, func(t *testing.T) {
			sink := &completingSink{memSink: newMemSink(64 << 20), landed: map[ids.ResID]uint64{}}
			if h.name == "inmem" {
				h.tr = transport.NewInmem(inBandNetwork())
			}
			r := listen(t, h.tr, h.addr, sink)
			w := newWriter(t, h.tr)
			require.True(t, transport.InBand(w, r.Addr()))
			sizes := []int{100, DefaultChunkSize + 1, 3*DefaultChunkSize - 5}
			var items []transport.WriteItem
			for i, n := range sizes {
				res, tok := sink.reserve(t, n)
				items = append(items, transport.WriteItem{Res: res, Token: tok, Src: randBytes(uint64(i), n), Complete: true})
			}
			res, tok := sink.reserve(t, 100)
			items = append(items, transport.WriteItem{Res: res, Token: tok, Src: randBytes(9, 100)})
			errs := write(t, w, r.Addr(), items...)
			requireLanded(t, sink.memSink, items, errs)
			for _, it := range items[:len(sizes)] {
				require.Equal(t, uint64(len(it.Src)), sink.landed[it.Res], "every frame of the item ended in-band")
				require.Len(t, sink.endsOf(it.Res), len(transport.Split(len(it.Src), DefaultChunkSize)))
			}
			require.Zero(t, sink.landed[res], "an item that does not ask ends by EndWrite")
			sink.requireBalanced(t)
		})
	}
}

// inBandNetwork is an in-memory network whose writers complete in-band.
func inBandNetwork() *transport.InmemNetwork {
	n := transport.NewInmemNetwork()
	n.SetInBand()
	return n
}

// A sink that does not complete in-band refuses a frame that asks it to,
// before any byte lands, and the writer learns why.
func TestInBandRefusedBySinkWithout(t *testing.T) {
	eachTransport(t, 1<<20, func(t *testing.T, h harness, sink *memSink, r transport.Receiver) {
		if h.name == "inmem" {
			t.Skip("the in-memory writer completes in-band only on a network set so")
		}
		w := newWriter(t, h.tr)
		res, tok := sink.reserve(t, 4096)
		errs := write(t, w, r.Addr(), transport.WriteItem{Res: res, Token: tok, Src: randBytes(1, 4096), Complete: true})
		require.ErrorIs(t, errs[0], transport.ErrRejected)
		require.Contains(t, errs[0].Error(), "in-band completion not served")
		require.Zero(t, sink.beginCount(), "refused before the sink was asked")
		require.Equal(t, uint64(1), r.Stats().Rejected["other"])
	})
}
