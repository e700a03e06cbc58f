package tcp

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/stretchr/testify/require"
	"go.uber.org/atomic"
)

// testSecret is the deployment secret of the tests that run with one.
const testSecret Secret = "a test deployment secret of 32 b"

// proveRaw answers a raw connection's challenge as a writer holding secret
// would (with none, in grant mode), and returns the challenge.
func proveRaw(t testing.TB, c net.Conn, secret Secret) Challenge {
	t.Helper()
	b := make([]byte, ChallengeLen)
	_, err := io.ReadFull(c, b)
	require.NoError(t, err, "the receiver opens with a challenge")
	ch, err := DecodeChallenge(b)
	require.NoError(t, err)
	p := Preamble{Mode: ModeGrant}
	if secret != "" {
		p = Preamble{Mode: ModeSecret, MAC: prove(proofKey(secret), b)}
	}
	_, err = c.Write(AppendPreamble(nil, p))
	require.NoError(t, err)
	return ch
}

// stall is the lockout attack: n connections that each send one byte of a
// header and wait, each reopened as soon as the receiver closes it, until
// stop is called. dialed counts the connections it opened.
func stall(t testing.TB, addr string, n int) (dialed *atomic.Uint64, stop func()) {
	t.Helper()
	done := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	open := make(map[net.Conn]struct{})
	dialed = atomic.NewUint64(0)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				default:
				}
				c, err := net.Dial("tcp", addr)
				if err != nil {
					continue
				}
				dialed.Add(1)
				mu.Lock()
				open[c] = struct{}{}
				mu.Unlock()
				_, _ = c.Write([]byte{'E'})
				_, _ = io.Copy(io.Discard, c)
				mu.Lock()
				delete(open, c)
				mu.Unlock()
				_ = c.Close()
			}
		}()
	}
	var once sync.Once
	return dialed, func() {
		once.Do(func() {
			close(done)
			mu.Lock()
			for c := range open {
				_ = c.Close()
			}
			mu.Unlock()
			wg.Wait()
		})
	}
}

// Hundreds of connections stalled one byte into a header, reopened as
// fast as they are closed, do not lock a producer out: a writer that dials
// in the middle of the attack pushes every item, bit-exact, with or
// without a deployment secret.
func TestTCPLockoutAttackLeavesProducersUnaffected(t *testing.T) {
	for _, secret := range []Secret{testSecret, ""} {
		t.Run("mode="+modeOf(secret).String(), func(t *testing.T) {
			sink := newMemSink(32 << 20)
			r := listenTCP(t, NewTCP(TCPConfig{Secret: secret, Logger: quiet}), sink)
			dialed, stop := stall(t, r.Addr(), DefaultMaxConns+64)
			defer stop()
			require.Eventually(t, func() bool { return dialed.Load() >= DefaultMaxConns+64 }, eventually, time.Millisecond,
				"the attack holds every slot it can")

			w := NewTCP(TCPConfig{Secret: secret, Conns: 4, ChunkSize: 256 << 10, Logger: quiet}).NewWriter()
			defer w.Close()
			for round := range 4 {
				items := make([]transport.WriteItem, 8)
				for i := range items {
					res, tok := sink.reserve(t, 512<<10)
					items[i] = transport.WriteItem{Res: res, Token: tok, Src: randBytes(uint64(round*100+i), 512<<10)}
				}
				ctx, cancel := context.WithTimeout(context.Background(), eventually)
				errs := w.Write(ctx, r.Addr(), items)
				cancel()
				for i, it := range items {
					require.NoError(t, errs[i], "round %d item %d", round, i)
					require.Equal(t, it.Src, sink.region(it.Res), "round %d item %d bit-exact", round, i)
				}
			}
			stop()
			require.NoError(t, r.Close())
			sink.requireBalanced(t)
		})
	}
}

// A connection without a valid proof is refused, with its reason, and not
// one of its bytes reaches the sink, even when it carries a live grant's
// token.
func TestTCPUnprovenConnectionNeverReachesTheSink(t *testing.T) {
	sink := newMemSink(1 << 20)
	r := listenTCP(t, newTCP(TCPConfig{Secret: testSecret}), sink)
	res, tok := sink.reserve(t, 64<<10)
	payload := randBytes(1, 64<<10)
	frame := append(AppendHeader(nil, Header{Seq: 1, Res: res, Token: tok, Length: 64 << 10}), payload...)

	// A v1 writer: a frame at once, no handshake.
	c := dialRaw(t, r.Addr())
	_, err := c.Write(frame)
	require.NoError(t, err)
	requireRefused(t, c, false, "without a handshake")

	// A preamble keyed by another secret.
	c = dialRaw(t, r.Addr())
	proveRaw(t, c, "another secret, also 32 bytes ok")
	_, err = c.Write(frame)
	require.NoError(t, err)
	requireRefused(t, c, true, "proof")

	// Grant mode offered to a receiver that wants the secret.
	c = dialRaw(t, r.Addr())
	proveRaw(t, c, "")
	_, err = c.Write(frame)
	require.NoError(t, err)
	requireRefused(t, c, true, "secret")

	// Real writers with the wrong secret, or none, learn why.
	for _, secret := range []Secret{"another secret, also 32 bytes ok", ""} {
		w := NewTCP(TCPConfig{Secret: secret, Logger: quiet}).NewWriter()
		ctx, cancel := context.WithTimeout(context.Background(), eventually)
		err := w.Write(ctx, r.Addr(), []transport.WriteItem{{Res: res, Token: tok, Src: payload}})[0]
		cancel()
		_ = w.Close()
		require.ErrorIs(t, err, transport.ErrNotAdmitted, "secret %q", secret)
		require.Contains(t, err.Error(), "auth_secret")
	}

	require.Zero(t, sink.beginCount(), "no frame of an unproven connection reached the sink")
	require.Equal(t, make([]byte, 64<<10), sink.region(res), "not a byte landed")
	require.Equal(t, uint64(4), r.Stats().Closed[transport.ClosedNotAdmitted], "refusals counted (three raw, one writer with another secret; the writer with none refused itself): %v", r.Stats().Closed)
}

// requireRefused reads a connection's refusal and then its end.
// A connection that did not read its challenge (challenged false) reads
// it first.
func requireRefused(t *testing.T, c net.Conn, challenged bool, why string) {
	t.Helper()
	if !challenged {
		b := make([]byte, ChallengeLen)
		_, err := io.ReadFull(c, b)
		require.NoError(t, err)
		_, err = DecodeChallenge(b)
		require.NoError(t, err, "a challenge first")
	}
	a := readAck(t, c)
	require.Equal(t, uint64(0), a.Seq)
	require.Equal(t, transport.StatusNotAdmitted, a.Status, "refusal %q", a.Msg)
	require.Contains(t, a.Msg, why)
	_, err := io.Copy(io.Discard, c)
	require.NoError(t, err, "then closed")
}

// recorder relays one connection between a writer and a receiver and
// records what the writer sent.
type recorder struct {
	ln   net.Listener
	mu   sync.Mutex
	sent []byte
	wg   sync.WaitGroup
}

func newRecorder(t *testing.T, to string) *recorder {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	rec := &recorder{ln: ln}
	rec.wg.Add(1)
	go func() {
		defer rec.wg.Done()
		c, err := ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", to)
		if err != nil {
			_ = c.Close()
			return
		}
		go func() { _, _ = io.Copy(c, up); _ = c.Close() }()
		buf := make([]byte, 64<<10)
		for {
			n, err := c.Read(buf)
			rec.mu.Lock()
			rec.sent = append(rec.sent, buf[:n]...)
			rec.mu.Unlock()
			if _, werr := up.Write(buf[:n]); err != nil || werr != nil {
				_ = up.Close()
				return
			}
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); rec.wg.Wait() })
	return rec
}

func (rec *recorder) recorded() []byte {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]byte(nil), rec.sent...)
}

// What a writer holding the secret sent on one connection, replayed byte
// for byte on another, proves nothing there: the challenge differs.
func TestTCPReplayedPreambleIsRefused(t *testing.T) {
	sink := newMemSink(1 << 20)
	r := listenTCP(t, newTCP(TCPConfig{Secret: testSecret}), sink)
	rec := newRecorder(t, r.Addr())
	res, tok := sink.reserve(t, 64<<10)
	src := randBytes(3, 64<<10)
	w := newTCP(TCPConfig{Secret: testSecret, Conns: 1}).NewWriter()
	ctx, cancel := context.WithTimeout(context.Background(), eventually)
	require.NoError(t, w.Write(ctx, rec.ln.Addr().String(), []transport.WriteItem{{Res: res, Token: tok, Src: src}})[0])
	cancel()
	require.NoError(t, w.Close())
	require.Equal(t, src, sink.region(res))
	begins := sink.beginCount()
	recorded := rec.recorded()
	require.NotEmpty(t, recorded)

	clear(sink.region(res))
	c := dialRaw(t, r.Addr())
	_, err := c.Write(recorded)
	require.NoError(t, err)
	requireRefused(t, c, false, "proof")
	require.Equal(t, begins, sink.beginCount(), "the replay reached the sink")
	require.Equal(t, make([]byte, 64<<10), sink.region(res), "the replay wrote into the slab")
	require.Equal(t, uint64(1), r.Stats().Closed[transport.ClosedNotAdmitted])
}

// A writer whose connection is refused at the handshake before its first
// frame is registered on it (the refusal overtakes a slow sender) fails
// with the refusal, on that one connection: a refused proof is not a
// goodbye, and dialing again would only be refused again, counted twice,
// and could end in "connection closed" instead of the reason.
func TestTCPRefusedBeforeTheFirstFrameIsNotRedialed(t *testing.T) {
	sink := newMemSink(1 << 20)
	r := listenTCP(t, newTCP(TCPConfig{Secret: testSecret}), sink)
	res, tok := sink.reserve(t, 64<<10)
	w := NewTCP(TCPConfig{Secret: "another secret, also 32 bytes ok", Logger: quiet}).NewWriter()
	defer w.Close()
	w.(*tcpWriter).afterConn = func(wc *wconn) {
		require.Eventually(t, func() bool { return !wc.usable() }, eventually, time.Millisecond,
			"the refusal ends the connection")
	}
	ctx, cancel := context.WithTimeout(context.Background(), eventually)
	defer cancel()
	err := w.Write(ctx, r.Addr(), []transport.WriteItem{{Res: res, Token: tok, Src: randBytes(2, 64<<10)}})[0]
	require.ErrorIs(t, err, transport.ErrNotAdmitted)
	require.Contains(t, err.Error(), "auth_secret")
	require.Eventually(t, func() bool { return r.Stats().Closed[transport.ClosedNotAdmitted] >= 1 }, eventually, time.Millisecond)
	require.Equal(t, uint64(1), r.Stats().Closed[transport.ClosedNotAdmitted], "one connection dialed and refused: %v", r.Stats().Closed)
	require.Zero(t, sink.beginCount())
}
