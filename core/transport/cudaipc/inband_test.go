package cudaipc

import (
	"bytes"
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/unixfd"
	"github.com/ecmooncake/ecmooncake/core/transport/transporttest"
)

const within = 10 * time.Second

// inBandItem is a grant of n bytes with a device source, asking to
// complete in-band.
func inBandItem(s *shard, n int, seed uint64) (transport.WriteItem, []byte) {
	it := s.grant(n)
	data := transporttest.RandBytes(seed, n)
	it.Dev = deviceSource(s.host, 0, data)
	it.Complete = true
	return it, data
}

// TestReadyWordCompletesTheItem: an item whose writer completes in-band
// becomes ready at the shard once its GPU stored the word, with its bytes
// in the slab, and with nothing sent but the announcement: the shard's
// sink is completed by the receiver itself.
func TestReadyWordCompletesTheItem(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	require.True(t, transport.InBand(w, s.recv.Addr()), "a shard whose sink completes in-band, a device that stores words")
	a, data := inBandItem(s, 100<<10, 1)
	b, datb := inBandItem(s, 3000, 2)
	require.Equal(t, []error{nil, nil}, write(w, s.recv.Addr(), a, b))
	require.Eventually(t, func() bool { return s.regions.Completed(a.Res) && s.regions.Completed(b.Res) }, within, 50*time.Microsecond)
	require.Equal(t, data, s.region(a))
	require.Equal(t, datb, s.region(b))
	require.Equal(t, uint64(2), s.recv.Stats().Completed)
	require.Equal(t, 1+2, host.WordsStored(), "the GPU stored the registration's probe word and both items' words")
	st := w.(*writer).Stats()
	require.Equal(t, WriterStats{InBand: 1, Announced: 2, Regions: 1}, st)

	// The slots come back: many more items than slots all complete.
	src := deviceSource(host, 0, transporttest.RandBytes(3, 256))
	for range 2 * wordSlots / 64 {
		var items []transport.WriteItem
		for range 64 {
			it := s.grant(256)
			it.Dev, it.Complete = src, true
			items = append(items, it)
		}
		for _, err := range write(w, s.recv.Addr(), items...) {
			require.NoError(t, err)
		}
		require.Eventually(t, func() bool { return s.regions.Completed(items[63].Res) }, within, 50*time.Microsecond)
	}
	require.Eventually(t, func() bool { return s.regions.Completions() == 2+2*wordSlots }, within, 50*time.Microsecond)
	require.Empty(t, s.recv.Stats().Rejected)
}

// TestLostWordCompletesNothing: a word that never reaches host memory
// leaves its item being written, however long; the next item's word
// still completes that one alone.
func TestLostWordCompletesNothing(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	require.True(t, transport.InBand(w, s.recv.Addr()), "attached, its probe word landed")
	lost, data := inBandItem(s, 4096, 1)
	host.SkipNextValueWrites(1)
	require.NoError(t, write(w, s.recv.Addr(), lost)[0])
	require.Equal(t, data, s.region(lost), "the bytes landed; only the word is lost")
	next, _ := inBandItem(s, 4096, 2)
	require.NoError(t, write(w, s.recv.Addr(), next)[0])
	require.Eventually(t, func() bool { return s.regions.Completed(next.Res) }, within, 50*time.Microsecond)
	require.False(t, s.regions.Completed(lost.Res))
	require.Equal(t, uint64(1), s.recv.Stats().Completed)
}

// TestNoRegisterCompletesByMessage: a device that cannot store words
// from a stream makes the attachment complete by message, counted; an
// item that asks for in-band completion there is refused by the writer.
func TestNoRegisterCompletesByMessage(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	host.RefuseHostRegister(errors.New("no stream memory operations"))
	w := newWriter(t, host)
	require.False(t, transport.InBand(w, s.recv.Addr()))
	require.Equal(t, uint64(1), w.(*writer).Stats().ByMessage)
	it, data := inBandItem(s, 512, 1)
	require.ErrorIs(t, write(w, s.recv.Addr(), it)[0], transport.ErrRefusedByWriter)
	it.Complete = false
	require.NoError(t, write(w, s.recv.Addr(), it)[0])
	require.Equal(t, data, s.region(it))
	require.False(t, s.regions.Completed(it.Res), "completed by the producer's message, not by the receiver")
}

// TestWordsThatDoNotLandCompleteByMessage: a device that registers the
// region but whose stream's stores do not reach it (a driver that
// accepts the calls and drops the words) would leave every item waiting
// for a word; the writer's probe at registration sees the word missing
// and the attachment completes by message instead, counted.
func TestWordsThatDoNotLandCompleteByMessage(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	w := newWriter(t, host)
	host.SkipNextValueWrites(1)
	require.False(t, transport.InBand(w, s.recv.Addr()), "the probe word did not land")
	require.Equal(t, uint64(1), w.(*writer).Stats().ByMessage)
	it, data := inBandItem(s, 512, 1)
	it.Complete = false
	require.NoError(t, write(w, s.recv.Addr(), it)[0])
	require.Equal(t, data, s.region(it))
	require.False(t, s.regions.Completed(it.Res), "left to the producer's complete message")
}

// plainSink hides the RemoteSink of a table: a shard that cannot
// complete in-band.
type plainSink struct{ transport.RegionSink }

func TestSinkWithoutInBandCompletesByMessage(t *testing.T) {
	host := gpu.NewFakeHost(1)
	dev, _ := host.Device(0)
	base, _ := host.Alloc(0, slabSize)
	regions := transporttest.NewDevice(slabSize)
	rcv, err := New(Config{Slab: slab.DeviceMemory(base, slabSize, dev.Name()), SlabDevice: dev, Logger: transporttest.Quiet()}).Listen("", plainSink{regions})
	require.NoError(t, err)
	defer rcv.Close()
	w := newWriter(t, host)
	require.False(t, transport.InBand(w, rcv.Addr()))
	require.Equal(t, uint64(1), w.(*writer).Stats().ByMessage)
	require.Zero(t, w.(*writer).Stats().Regions)
}

// rawProducer speaks the protocol by hand: a producer that may lie.
type rawProducer struct {
	t     testing.TB
	conn  *net.UnixConn
	hello hello
	words words
}

func dialRaw(t testing.TB, s *shard) *rawProducer {
	t.Helper()
	p, err := parseAddr(s.recv.Addr())
	require.NoError(t, err)
	c, err := net.Dial("unix", "@"+p.socket)
	require.NoError(t, err)
	uc := c.(*net.UnixConn)
	t.Cleanup(func() { _ = uc.Close() })
	_, err = uc.Write(appendHello(nil, p.nonce))
	require.NoError(t, err)
	buf := make([]byte, headerLen+maxMsg+helloLen)
	oob := make([]byte, syscall.CmsgSpace(4))
	n, oobn, flags, _, err := uc.ReadMsgUnix(buf, oob)
	require.NoError(t, err)
	fd, err := unixfd.TakeRights(oob[:oobn], flags)
	require.NoError(t, err)
	rep, err := readHelloReply(io.MultiReader(bytes.NewReader(buf[:n]), uc))
	require.NoError(t, err)
	require.Equal(t, uint32(wordSlots), rep.hello.Slots)
	ws, err := mapWords(fd)
	require.NoError(t, err)
	syscall.Close(fd)
	t.Cleanup(func() { _ = ws.unmap() })
	return &rawProducer{t: t, conn: uc, hello: rep.hello, words: ws}
}

func (p *rawProducer) announce(as ...announcement) {
	_, err := p.conn.Write(appendAnnounce(nil, as))
	require.NoError(p.t, err)
}

func (p *rawProducer) word(seq uint32) uint64 { return word(p.hello.Generation, seq) }

// settled waits until the shard has judged n announcements (watched or
// refused) on its receiver: the completions and refusals it counts.
func settled(t *testing.T, s *shard, refused uint64) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n uint64
		for _, v := range s.recv.Stats().Rejected {
			n += v
		}
		return n >= refused
	}, within, 50*time.Microsecond)
}

// TestShardRefusesWhatAnnouncementsDoNotEarn walks the hostile cases: each
// is refused and counted, and none marks anything ready, even when the
// value it names is then stored in the slot.
func TestShardRefusesWhatAnnouncementsDoNotEarn(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	p := dialRaw(t, s)
	it := s.grant(64)
	other := s.grant(64)

	p.announce(announcement{Res: uint64(it.Res), Token: it.Token, Slot: wordSlots, Value: p.word(1)})
	settled(t, s, 1)
	require.Equal(t, uint64(1), s.recv.Stats().Rejected[refusedSlotRange])

	p.announce(announcement{Res: uint64(it.Res), Token: ids.Token{0xba, 0xd}, Slot: 1, Value: p.word(2)})
	settled(t, s, 2)
	require.Equal(t, uint64(1), s.recv.Stats().Rejected[refusedBadToken])

	p.announce(announcement{Res: 9999, Token: it.Token, Slot: 2, Value: p.word(3)})
	settled(t, s, 3)
	require.Equal(t, uint64(1), s.recv.Stats().Rejected[refusedUnknownRes])

	p.announce(announcement{Res: uint64(it.Res), Token: it.Token, Slot: 3, Value: word(p.hello.Generation+1, 4)})
	settled(t, s, 4)
	require.Equal(t, uint64(1), s.recv.Stats().Rejected[refusedStaleValue], "another attachment's generation")

	// Storing what they named completes nothing. The entries the sink
	// refused are watched only to free their slots (a 0 once the value
	// lands, so that the producer may take them again); one of another
	// generation is not watched at all.
	p.words.store(1, p.word(2))
	p.words.store(2, p.word(3))
	p.words.store(3, word(p.hello.Generation+1, 4))
	require.Eventually(t, func() bool { return p.words.load(1) == 0 && p.words.load(2) == 0 }, within, 50*time.Microsecond)
	require.Zero(t, s.recv.Stats().Completed)

	// A good one on slot 5, then one on the same slot while it is
	// watched, then a replayed sequence.
	p.announce(announcement{Res: uint64(it.Res), Token: it.Token, Slot: 5, Value: p.word(5)})
	p.announce(announcement{Res: uint64(other.Res), Token: other.Token, Slot: 5, Value: p.word(6)})
	p.announce(announcement{Res: uint64(other.Res), Token: other.Token, Slot: 6, Value: p.word(5)})
	settled(t, s, 6)
	require.Equal(t, uint64(1), s.recv.Stats().Rejected[refusedSlotBusy])
	require.Equal(t, uint64(2), s.recv.Stats().Rejected[refusedStaleValue], "a sequence not above the last")
	require.False(t, s.regions.Completed(it.Res))
	require.False(t, s.regions.Completed(other.Res))

	// A stale value left in slot 5 (not the one announced) leaves the
	// item waiting; the announced one completes it, and the shard frees
	// the slot with a 0.
	p.words.store(5, p.word(4))
	p.words.store(6, p.word(5))
	p.announce(announcement{Res: uint64(other.Res), Token: other.Token, Slot: 7, Value: p.word(7)})
	p.words.store(7, p.word(7))
	require.Eventually(t, func() bool { return s.regions.Completed(other.Res) }, within, 50*time.Microsecond)
	require.False(t, s.regions.Completed(it.Res), "a stale value in its slot does not complete it")
	p.words.store(5, p.word(5))
	require.Eventually(t, func() bool { return s.regions.Completed(it.Res) }, within, 50*time.Microsecond)
	require.Eventually(t, func() bool { return p.words.load(5) == 0 }, within, 50*time.Microsecond, "the shard frees the slot")
	require.Equal(t, uint64(2), s.recv.Stats().Completed)

	// The same reservation announced again completes nothing twice.
	p.announce(announcement{Res: uint64(it.Res), Token: it.Token, Slot: 8, Value: p.word(8)})
	settled(t, s, 7)
	require.Equal(t, uint64(1), s.recv.Stats().Rejected[refusedGone])
	p.words.store(8, p.word(8))
	require.Eventually(t, func() bool { return p.words.load(8) == 0 }, within, 50*time.Microsecond, "its slot is freed")
	require.Equal(t, 2, s.regions.Completions())
	require.Equal(t, uint64(2), s.recv.Stats().Completed)
	require.Equal(t, word(p.hello.Generation+1, 4), p.words.load(3), "a word no announcement earned is left alone")
}

// TestGarbageEndsTheConnection: bytes that are not an announcement end the
// producer's connection, counted; what it announced before is no longer
// watched.
func TestGarbageEndsTheConnection(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	p := dialRaw(t, s)
	it := s.grant(64)
	p.announce(announcement{Res: uint64(it.Res), Token: it.Token, Slot: 0, Value: p.word(1)})
	_, err := p.conn.Write([]byte("GET / HTTP/1.1\r\n\r\n"))
	require.NoError(t, err)
	settled(t, s, 1)
	require.Equal(t, uint64(1), s.recv.Stats().Rejected[refusedBadMessage])
	require.Equal(t, uint64(1), s.recv.Stats().BadConns)
	_ = p.conn.SetReadDeadline(time.Now().Add(within))
	_, err = p.conn.Read(make([]byte, 1))
	require.Error(t, err, "the shard closed the connection")
	require.Eventually(t, func() bool { return s.recv.live.Load() == 0 }, within, 50*time.Microsecond, "the shard stopped watching")
	p.words.store(0, p.word(1))
	requireNotCompletedAfterScans(t, s, it.Res)
}

// TestProducerGoneBeforeItsWord: a producer that dies after announcing
// and before its word leaves the item being written: its word, stored
// afterwards, completes nothing, and the write stays open for the shard
// to end after its writer grace (it is not freed early).
func TestProducerGoneBeforeItsWord(t *testing.T) {
	host := gpu.NewFakeHost(1)
	s := listenShard(t, host, 0, "127.0.0.1:0")
	p := dialRaw(t, s)
	it := s.grant(64)
	p.announce(announcement{Res: uint64(it.Res), Token: it.Token, Slot: 0, Value: p.word(1)})
	require.NoError(t, p.conn.Close())
	require.Eventually(t, func() bool { return s.recv.live.Load() == 0 }, within, 50*time.Microsecond, "the shard saw the producer go")
	p.words.store(0, p.word(1))
	requireNotCompletedAfterScans(t, s, it.Res)
	_, err := s.regions.WatchRemote(it.Res, it.Token)
	require.NoError(t, err, "the write is still open: only the shard's grace ends it")
}

// requireNotCompletedAfterScans checks that res stays incomplete while a
// second producer's item, announced later, completes: the shard scanned
// every word it watches in between.
func requireNotCompletedAfterScans(t *testing.T, s *shard, res ids.ResID) {
	t.Helper()
	q := dialRaw(t, s)
	probe := s.grant(64)
	q.announce(announcement{Res: uint64(probe.Res), Token: probe.Token, Slot: 0, Value: q.word(1)})
	q.words.store(0, q.word(1))
	require.Eventually(t, func() bool { return s.regions.Completed(probe.Res) }, within, 50*time.Microsecond)
	require.False(t, s.regions.Completed(res))
}
