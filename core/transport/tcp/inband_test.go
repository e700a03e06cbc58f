package tcp

import (
	"net"
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

// publishingSink completes in-band and holds what each completion
// publishes until Flush (transport.FlushSink): published counts the
// completions Flush let out, flushes the calls that let any out.
type publishingSink struct {
	*gatedSink
	mu                 sync.Mutex
	held               int
	published, flushes int
}

func (s *publishingSink) EndComplete(res ids.ResID, tok ids.Token, off, n uint64) error {
	s.mu.Lock()
	s.held++
	s.mu.Unlock()
	s.EndWrite(res, true)
	return nil
}

func (s *publishingSink) Flush() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held > 0 {
		s.published += s.held
		s.held = 0
		s.flushes++
	}
}

func (s *publishingSink) counts() (held, published, flushes int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.held, s.published, s.flushes
}

// Frames that complete in-band and arrive together publish what they
// complete (the shard's readiness events) together, once, and before any
// of their acks leaves: a writer that hears its frames acknowledged knows
// their items are announced.
func TestInBandFramesArrivedTogetherPublishOnceBeforeTheirAcks(t *testing.T) {
	const frames, size = 8, 4 * readBuf
	sink := &publishingSink{gatedSink: &gatedSink{memSink: newMemSink(frames * size), open: make(chan struct{})}}
	r := listenTCP(t, newTCP(TCPConfig{SocketBuffer: 4 << 20}), sink)
	c := dialProven(t, r.Addr())
	require.NoError(t, c.(*net.TCPConn).SetWriteBuffer(4<<20))
	var stream []byte
	for i := range frames {
		res, tok := sink.reserve(t, size)
		stream = append(AppendHeader(stream, Header{Seq: uint64(i + 1), Res: res, Token: tok, Length: size, Complete: true}), randBytes(uint64(i), size)...)
	}
	_, err := c.Write(stream)
	require.NoError(t, err)
	close(sink.open)
	a := readAck(t, c)
	require.Equal(t, transport.StatusOK, a.Status, a.Msg)
	held, published, flushes := sink.counts()
	require.Zero(t, held, "nothing completed is held once an ack is out")
	require.Equal(t, frames, published)
	require.Equal(t, 1, flushes, "the frames that arrived together published together")
	for i := 1; i < frames; i++ {
		require.Equal(t, transport.StatusOK, readAck(t, c).Status)
	}
	sink.requireBalanced(t)
}

// panickingFlushSink is a completing sink whose Flush panics.
type panickingFlushSink struct{ *completingSink }

func (panickingFlushSink) Flush() { panic("flush failed") }

// A sink whose Flush panics costs neither the acks nor the connection:
// the panic is logged and the frames it answers are still acknowledged.
func TestAPanickingFlushStillAcks(t *testing.T) {
	sink := panickingFlushSink{&completingSink{memSink: newMemSink(1 << 20), landed: map[ids.ResID]uint64{}}}
	r := listenTCP(t, newTCP(TCPConfig{}), sink)
	c := dialProven(t, r.Addr())
	for i := range 3 {
		res, tok := sink.reserve(t, 100)
		sendFrame(t, c, Header{Seq: uint64(i + 1), Res: res, Token: tok, Length: 100, Complete: true}, randBytes(uint64(i), 100))
		a := readAck(t, c)
		require.Equal(t, uint64(i+1), a.Seq)
		require.Equal(t, transport.StatusOK, a.Status, a.Msg)
		sink.mu.Lock()
		landed := sink.landed[res]
		sink.mu.Unlock()
		require.Equal(t, uint64(100), landed)
	}
	require.Equal(t, uint64(1), r.accepted.Load(), "one connection served every frame")
	sink.requireBalanced(t)
}
