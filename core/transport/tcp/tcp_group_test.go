package tcp

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/stretchr/testify/require"
	"go.uber.org/atomic"
)

// Frames that arrive together are checked one by one and answered
// together: a refused frame inside a group costs only itself (its payload
// is drained, its ack says why), the frames around it land, and the
// group's acks leave in one write.
func TestTCPFramesOfAGroupAreCheckedAloneAndAckedTogether(t *testing.T) {
	sink := newMemSink(1 << 20)
	r := listenTCP(t, newTCP(TCPConfig{}), sink)
	res, tok := sink.reserve(t, 1000)
	c := dialProven(t, r.Addr())

	frames := []struct {
		h    Header
		want transport.Status
	}{
		{Header{Seq: 1, Res: res, Token: tok, Offset: 0, Length: 100}, transport.StatusOK},
		{Header{Seq: 2, Res: res, Token: ids.Token{7}, Offset: 100, Length: 50}, transport.StatusBadToken},
		{Header{Seq: 3, Res: res, Token: tok, Offset: 100, Length: 200}, transport.StatusOK},
		{Header{Seq: 4, Res: 999, Token: tok, Offset: 0, Length: 10}, transport.StatusUnknownRes},
		{Header{Seq: 5, Res: res, Token: tok, Offset: 900, Length: 200}, transport.StatusOutOfBounds},
		{Header{Seq: 6, Res: res, Token: tok, Offset: 300, Length: 700}, transport.StatusOK},
	}
	want := make([]byte, 1000)
	var group []byte
	for i, f := range frames {
		payload := randBytes(uint64(i+1), int(f.h.Length))
		if f.want == transport.StatusOK {
			copy(want[f.h.Offset:], payload)
		}
		group = append(AppendHeader(group, f.h), payload...)
	}
	_, err := c.Write(group)
	require.NoError(t, err)
	for _, f := range frames {
		a := readAck(t, c)
		require.Equal(t, f.h.Seq, a.Seq, "acks come in frame order")
		require.Equal(t, f.want, a.Status, a.Msg)
	}
	require.Equal(t, want, sink.region(res))
	require.Equal(t, uint64(1), r.ackWrites.Load(), "one write answered the whole group")

	// The connection is still in step: a lone frame after the group lands.
	sendFrame(t, c, Header{Seq: 7, Res: res, Token: tok, Offset: 0, Length: 10}, want[:10])
	require.Equal(t, transport.StatusOK, readAck(t, c).Status)
	require.Equal(t, uint64(1), r.accepted.Load())
	sink.requireBalanced(t)
}

// A bad header after good frames still costs the connection, but the
// frames before it, already landed, are acked before it closes.
func TestTCPBadHeaderInAGroupAcksWhatLandedFirst(t *testing.T) {
	sink := newMemSink(1 << 20)
	r := listenTCP(t, newTCP(TCPConfig{}), sink)
	res, tok := sink.reserve(t, 100)
	c := dialProven(t, r.Addr())
	group := append(AppendHeader(nil, Header{Seq: 1, Res: res, Token: tok, Length: 100}), randBytes(1, 100)...)
	group = append(group, []byte("this is not a frame header, not at all, no........................")...)
	_, err := c.Write(group)
	require.NoError(t, err)
	a := readAck(t, c)
	require.Equal(t, uint64(1), a.Seq)
	require.Equal(t, transport.StatusOK, a.Status)
	one := make([]byte, 1)
	_, err = c.Read(one)
	require.Error(t, err, "the connection closes after the bad header")
	require.Eventually(t, func() bool { return r.Stats().BadConns == 1 }, eventually, 10*time.Millisecond)
}

// Small frames queued together for one connection leave in one write, and
// every item lands whole, whatever mix of sizes one Write carries.
func TestTCPWriterSendsQueuedFramesTogether(t *testing.T) {
	tr := newTCP(TCPConfig{Conns: 1})
	sink := newMemSink(64 << 20)
	r := listenTCP(t, tr, sink)
	w := newWriter(t, tr)
	tw := w.(*tcpWriter)

	var small []transport.WriteItem
	for i := range maxGroupFrames {
		res, tok := sink.reserve(t, 1+i*37)
		small = append(small, transport.WriteItem{Res: res, Token: tok, Src: randBytes(uint64(i), 1+i*37)})
	}
	requireLanded(t, sink, small, write(t, w, r.Addr(), small...))
	require.Equal(t, uint64(1), tw.frameWrites.Load(), "one write carried all %d frames", len(small))

	var mixed []transport.WriteItem
	for i, n := range []int{64 << 10, 1, 3 << 20, 64 << 10, 100, maxGroupBytes, 64<<10 + 5, DefaultChunkSize + 3, 7} {
		res, tok := sink.reserve(t, n)
		mixed = append(mixed, transport.WriteItem{Res: res, Token: tok, Src: randBytes(uint64(100+i), n)})
	}
	for i := range 200 {
		res, tok := sink.reserve(t, 64<<10)
		mixed = append(mixed, transport.WriteItem{Res: res, Token: tok, Src: randBytes(uint64(1000+i), 64<<10)})
	}
	requireLanded(t, sink, mixed, write(t, w, r.Addr(), mixed...))
	require.Less(t, tw.frameWrites.Load(), uint64(1+len(mixed)+1), "frames were grouped")
	require.Equal(t, uint64(1), r.accepted.Load())
	sink.requireBalanced(t)
}

// One item refused inside a group fails alone.
func TestTCPWriterGroupWithARefusedItem(t *testing.T) {
	tr := newTCP(TCPConfig{Conns: 1})
	sink := newMemSink(4 << 20)
	r := listenTCP(t, tr, sink)
	w := newWriter(t, tr)
	var items []transport.WriteItem
	for i := range 16 {
		res, tok := sink.reserve(t, 4096)
		if i == 5 {
			tok = ids.Token{1}
		}
		items = append(items, transport.WriteItem{Res: res, Token: tok, Src: randBytes(uint64(i), 4096)})
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	errs := w.Write(ctx, r.Addr(), items)
	for i, err := range errs {
		if i == 5 {
			require.ErrorIs(t, err, transport.ErrBadToken)
			continue
		}
		require.NoError(t, err, "item %d", i)
		require.Equal(t, items[i].Src, sink.region(items[i].Res))
	}
}

// FuzzTCPFrameGroups sends the receiver groups of frames, built from the
// fuzzer's bytes, in one write: valid frames, frames with a wrong token,
// an unknown reservation or a range outside it, and a tail of raw bytes.
// Whatever the mix, the receiver answers the frames before the first
// undecodable header in order, one ack each, refuses exactly the bad ones,
// lands exactly the good ones, and leaves the sink balanced.
func FuzzTCPFrameGroups(f *testing.F) {
	f.Add([]byte{0, 10, 1, 20, 0, 30, 2, 5, 3, 9, 0, 40}, []byte(nil))
	f.Add([]byte{0, 200, 0, 200, 0, 200}, []byte("ECMW garbage"))
	f.Add([]byte{3, 255, 1, 1, 2, 2}, []byte{})
	tr := newTCP(TCPConfig{})
	const region = 4096
	f.Fuzz(func(t *testing.T, spec, tail []byte) {
		if len(spec) > 64 {
			spec = spec[:64]
		}
		sink := newMemSink(region)
		r := listenTCP(t, tr, sink)
		res, tok := sink.reserve(t, region)
		want := make([]byte, region)
		var group []byte
		var wantAcks []transport.Status
		for i := 0; i+1 < len(spec); i += 2 {
			kind, n := spec[i]%4, uint64(spec[i+1])*16
			h := Header{Seq: uint64(len(wantAcks) + 1), Res: res, Token: tok, Offset: uint64(i) * 32 % region, Length: n}
			st := transport.StatusOK
			switch kind {
			case 1:
				h.Token[0] ^= 0xff
				st = transport.StatusBadToken
			case 2:
				h.Res = res + 1<<40
				st = transport.StatusUnknownRes
			case 3:
				h.Offset = region - 1
				h.Length = n + 2
				st = transport.StatusOutOfBounds
			}
			if st == transport.StatusOK && h.Offset+h.Length > region {
				st = transport.StatusOutOfBounds
			}
			payload := randBytes(uint64(i), int(h.Length))
			if st == transport.StatusOK {
				copy(want[h.Offset:], payload)
			}
			group = append(AppendHeader(group, h), payload...)
			wantAcks = append(wantAcks, st)
		}
		if len(tail) > 0 {
			// A tail that decodes as a header is some other frame: keep
			// this test about bytes that do not.
			tail = append([]byte("XXXX"), tail...)
		}
		group = append(group, tail...)
		c, err := net.Dial("tcp", r.Addr())
		require.NoError(t, err)
		defer c.Close()
		require.NoError(t, c.SetDeadline(time.Now().Add(eventually)))
		proveRaw(t, c, testSecret)
		_, err = c.Write(group)
		require.NoError(t, err)
		require.NoError(t, c.(*net.TCPConn).CloseWrite())
		for i, st := range wantAcks {
			a := readAck(t, c)
			require.Equal(t, uint64(i+1), a.Seq)
			require.Equal(t, st, a.Status, a.Msg)
		}
		rest, _ := io.ReadAll(c)
		require.Empty(t, rest, "no ack beyond one per frame")
		require.Equal(t, want, sink.region(res))
		sink.markGone(res)
		require.Eventually(t, func() bool {
			sink.mu.Lock()
			defer sink.mu.Unlock()
			return sink.res[res].open == 0
		}, eventually, 10*time.Millisecond)
		require.Empty(t, sink.broken)
	})
}

// gatedSink holds the first frame's BeginWrite until open is closed, so a
// test can have a whole stream of frames queued in the socket before the
// receiver reads past the first header.
type gatedSink struct {
	*memSink
	open chan struct{}
	once sync.Once
	// opened, when set, runs as the gate opens.
	opened func()
}

func (g *gatedSink) BeginWrite(res ids.ResID, tok ids.Token, off, n uint64) ([]byte, error) {
	g.once.Do(func() {
		<-g.open
		if g.opened != nil {
			g.opened()
		}
	})
	return g.memSink.BeginWrite(res, tok, off, n)
}

func (g *gatedSink) EndWrite(res ids.ResID, ok bool) { g.memSink.EndWrite(res, ok) }

// Frames whose payloads are too large for the read buffer, arriving back
// to back, are still acked together: the receiver writes what it owes
// only when its next read would wait, not before every payload it reads
// into the slab (one write system call, and one wake of the writer's ack
// reader, per frame).
func TestTCPLargeFramesArrivedTogetherAreAckedTogether(t *testing.T) {
	r, _ := largeFramesArrivedTogether(t, 7)
	require.Equal(t, uint64(1), r.ackWrites.Load(), "one write answered the %d frames that arrived together", largeFrames)
}

// A frame whose payload is larger than the read buffer is read in one
// system call with the next frame's header (a readv into the slab and the
// buffer), not in two: one for the header (which fills the buffer) and
// one for the rest of the payload.
func TestTCPLargeFramesArrivedTogetherAreReadInOneCallEach(t *testing.T) {
	r, atGate := largeFramesArrivedTogether(t, 8)
	// From the first payload on: one a frame, the read that found the
	// socket empty before the acks went out, and the one that then waits.
	require.LessOrEqual(t, r.reads.Load()-atGate, uint64(largeFrames+2), "read system calls for %d frames", largeFrames)
}

const largeFrames, largeFrame = 8, 4 * readBuf

// largeFramesArrivedTogether writes largeFrames frames too large for the
// receiver's read buffer as one stream, whole in the receiver's socket
// before it reads past the first header (a gate holds the first frame;
// socket buffers hold the whole stream), reads their acks and checks the
// bytes. atGate is the receiver's read calls when the gate opened.
func largeFramesArrivedTogether(t *testing.T, seed uint64) (r *tcpReceiver, atGate uint64) {
	t.Helper()
	const frames, size = largeFrames, largeFrame
	sink := &gatedSink{memSink: newMemSink(frames * size), open: make(chan struct{})}
	r = listenTCP(t, newTCP(TCPConfig{SocketBuffer: 4 << 20}), sink)
	var gate atomic.Uint64
	sink.opened = func() { gate.Store(r.reads.Load()) }
	res, tok := sink.reserve(t, frames*size)
	c := dialProven(t, r.Addr())
	require.NoError(t, c.(*net.TCPConn).SetWriteBuffer(4<<20))
	want := randBytes(seed, frames*size)
	var stream []byte
	for i := range frames {
		h := Header{Seq: uint64(i + 1), Res: res, Token: tok, Offset: uint64(i * size), Length: size}
		stream = append(AppendHeader(stream, h), want[i*size:(i+1)*size]...)
	}
	_, err := c.Write(stream)
	require.NoError(t, err)
	close(sink.open)
	for i := range frames {
		a := readAck(t, c)
		require.Equal(t, uint64(i+1), a.Seq)
		require.Equal(t, transport.StatusOK, a.Status, a.Msg)
	}
	require.Equal(t, want, sink.region(res))
	sink.requireBalanced(t)
	return r, gate.Load()
}
