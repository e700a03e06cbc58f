package control

import (
	"bufio"
	"context"
	"encoding/binary"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

const (
	secretA = "deployment-secret-A-0123456789"
	secretB = "deployment-secret-B-0123456789"
)

func mustSecurity(t *testing.T, secret string, allow bool) Security {
	t.Helper()
	sec, err := NewSecurity(secret, allow)
	require.NoError(t, err)
	return sec
}

func TestDeriveKeys(t *testing.T) {
	require.True(t, zmq.HasCurve(), "libzmq must have CURVE")
	a1, err := DeriveKeys(secretA)
	require.NoError(t, err)
	a2, err := DeriveKeys(secretA)
	require.NoError(t, err)
	require.Equal(t, a1, a2, "every holder of a secret derives the same keys")
	b, err := DeriveKeys(secretB)
	require.NoError(t, err)
	require.NotEqual(t, a1.ServerPublic, b.ServerPublic)
	require.NotEqual(t, a1.ClientPublic, b.ClientPublic)
	require.NotEqual(t, a1.ServerPublic, a1.ClientPublic, "servers and clients have pairs of their own")
	pub, err := zmq.AuthCurvePublic(a1.ServerSecret)
	require.NoError(t, err)
	require.Equal(t, a1.ServerPublic, pub)

	_, err = DeriveKeys("tiny-xyz")
	require.ErrorContains(t, err, "too short")
	require.NotContains(t, err.Error(), "tiny-xyz", "the secret itself is never in an error")

	sec := mustSecurity(t, secretA, false)
	require.Equal(t, "curve", sec.String())
	require.NotContains(t, sec.String(), a1.ServerSecret)
	var zero Security
	require.False(t, zero.Curve())
}

// TestAdmission walks the admission rule: peer address × bind address ×
// secret × allow_unauthenticated, and the peer's mechanism and key.
func TestAdmission(t *testing.T) {
	keys, err := DeriveKeys(secretA)
	require.NoError(t, err)
	other, err := DeriveKeys(secretB)
	require.NoError(t, err)
	const (
		curve = mechanismCurve
		null  = mechanismNull
	)
	for _, tc := range []struct {
		name      string
		peer      string
		bind      string
		secret    string
		allow     bool
		mechanism string
		key       string
		zap       bool
		want      refusal
	}{
		// No secret, loopback bind: served as always, no handler.
		{"plain loopback bind", "127.0.0.1", "127.0.0.1", "", false, null, "", false, admitted},
		{"plain localhost bind", "127.0.0.1", "localhost", "", false, null, "", false, admitted},
		{"plain ipv6 loopback bind", "::1", "::1", "", false, null, "", false, admitted},
		// No secret, bound beyond loopback: protected mode.
		{"protected: loopback peer", "127.0.0.1", "*", "", false, null, "", true, admitted},
		{"protected: mapped loopback peer", "::ffff:127.0.0.1", "0.0.0.0", "", false, null, "", true, admitted},
		{"protected: ipv6 loopback peer", "::1", "::", "", false, null, "", true, admitted},
		{"protected: other loopback address", "127.0.0.2", "10.0.0.5", "", false, null, "", true, admitted},
		{"protected: remote peer", "10.0.0.7", "10.0.0.5", "", false, null, "", true, refusedNotLoopback},
		{"protected: remote mapped peer", "::ffff:10.0.0.7", "*", "", false, null, "", true, refusedNotLoopback},
		{"protected: remote ipv6 peer", "2001:db8::7", "*", "", false, null, "", true, refusedNotLoopback},
		{"protected: unreadable address", "", "*", "", false, null, "", true, refusedNotLoopback},
		{"protected: curve peer", "127.0.0.1", "*", "", false, curve, keys.ClientPublic, true, refusedUnexpectedSecret},
		// No secret, opted out: anybody.
		{"allowed: remote peer", "10.0.0.7", "*", "", true, null, "", false, admitted},
		{"allowed: loopback bind", "127.0.0.1", "127.0.0.1", "", true, null, "", false, admitted},
		// A secret: the key decides, wherever the peer is.
		{"curve: right key, remote", "10.0.0.7", "*", secretA, false, curve, keys.ClientPublic, true, admitted},
		{"curve: right key, loopback", "127.0.0.1", "127.0.0.1", secretA, false, curve, keys.ClientPublic, true, admitted},
		{"curve: wrong key", "127.0.0.1", "127.0.0.1", secretA, false, curve, other.ClientPublic, true, refusedWrongKey},
		{"curve: server key as client key", "127.0.0.1", "*", secretA, false, curve, keys.ServerPublic, true, refusedWrongKey},
		{"curve: plain peer", "127.0.0.1", "127.0.0.1", secretA, false, null, "", true, refusedNoSecret},
		{"curve: allow does not weaken it", "10.0.0.7", "*", secretA, true, null, "", true, refusedNoSecret},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPolicy(mustSecurity(t, tc.secret, tc.allow), tc.bind)
			require.Equal(t, tc.zap, p.zap(), "ZAP handler needed")
			require.Equal(t, tc.want, p.decide(tc.peer, tc.mechanism, tc.key))
			if tc.want != admitted {
				require.NotEmpty(t, p.explain(tc.want, tc.peer))
			}
		})
	}
	msg := newPolicy(Security{}, "10.0.0.5").explain(refusedNotLoopback, "10.0.0.7")
	for _, want := range []string{"10.0.0.7", "10.0.0.5", "auth_secret", "allow_unauthenticated"} {
		require.Contains(t, msg, want, "the refusal names the peer, the bind and the settings that fix it")
	}
}

// TestZAPHandlerRefusesARemotePeer feeds the handler a request as libzmq
// would send it for a peer beyond loopback (which a test cannot open).
func TestZAPHandlerRefusesARemotePeer(t *testing.T) {
	zctx := harness(t)
	srv := startServer(t, zctx, "tcp://*:0", HandlerFunc(statusEcho))
	z := zapHandlers[zctx]
	require.NotNil(t, z, "a wildcard bind without secret runs the ZAP handler")
	domain := ""
	z.mu.Lock()
	for d := range z.domains {
		domain = d
	}
	z.mu.Unlock()
	before := failures(t, string(refusedNotLoopback))
	req := func(addr string) [][]byte {
		return [][]byte{[]byte("1.0"), []byte("7"), []byte(domain), []byte(addr), nil, []byte(mechanismNull)}
	}
	require.Equal(t, "400", z.answer(req("192.0.2.10"))[2])
	require.Equal(t, "200", z.answer(req("127.0.0.1"))[2])
	require.Equal(t, "400", z.answer([][]byte{[]byte("1.0"), []byte("8"), []byte("other"), []byte("127.0.0.1"), nil, []byte(mechanismNull)})[2],
		"a domain nobody registered is refused")
	require.Equal(t, map[string]uint64{string(refusedNotLoopback): 1}, srv.Stats().Refused)
	require.Equal(t, before+1, failures(t, string(refusedNotLoopback)))

	// And the real path, on loopback: protected mode serves this host.
	cli := dial(t, zctx, Endpoint("127.0.0.1", portOf(t, srv.Endpoint())))
	require.NoError(t, cli.Call(context.Background(), wire.OpStatus, wire.Status{TransferIDs: []string{"t"}}, nil))
}

func TestCurveRoundTrip(t *testing.T) {
	zctx := harness(t)
	sec := mustSecurity(t, secretA, false)
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho), WithServerSecurity(sec))
	cli := dial(t, zctx, srv.Endpoint(), WithClientSecurity(sec))
	var got wire.StatusReply
	require.NoError(t, cli.Call(context.Background(), wire.OpStatus, wire.Status{TransferIDs: []string{"t1"}}, &got))
	require.Equal(t, "t1", got.Items[0].TransferID)
	require.Empty(t, srv.Stats().Refused)

	pub := newPub(t, zctx, "127.0.0.1", WithServerSecurity(sec))
	sub := newSub(t, zctx, WithClientSecurity(sec))
	require.NoError(t, sub.Connect(pub.Endpoint()))
	pub.Send(readyEvent(0, "t1"))
	require.Equal(t, "t1", next(t, sub).TransferID)
}

// TestRefusedPeersGetAClearError: each mismatch of secrets fails the
// call with ErrAuth well within its deadline, says what to set, and is
// counted by the server.
func TestRefusedPeersGetAClearError(t *testing.T) {
	for _, tc := range []struct {
		name           string
		server, client string
		reason         refusal
		says           string
	}{
		{"wrong secret", secretA, secretB, refusedWrongSecret, "different auth_secret"},
		{"no secret", secretA, "", refusedNoSecret, "requires an auth_secret"},
		{"secret on a plain server", "", secretA, refusedUnexpectedSecret, "has no auth_secret"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			zctx := harness(t)
			before := failures(t, string(tc.reason))
			srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho), WithServerSecurity(mustSecurity(t, tc.server, false)))
			cli := dial(t, zctx, srv.Endpoint(), WithClientSecurity(mustSecurity(t, tc.client, false)))
			ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
			defer cancel()
			err := cli.Call(ctx, wire.OpStatus, wire.Status{TransferIDs: []string{"t"}}, nil)
			require.ErrorIs(t, err, ErrAuth, "fails on the refusal, not at the deadline")
			require.ErrorContains(t, err, tc.says)
			require.ErrorIs(t, cli.Call(ctx, wire.OpStatus, wire.Status{}, nil), ErrAuth, "later calls fail at once too")
			eventually(t, func() bool { return srv.Stats().Refused[string(tc.reason)] > 0 })
			require.Greater(t, failures(t, string(tc.reason)), before)
			require.Zero(t, srv.Stats().Served, "nothing was served")
		})
	}
}

// TestSubscriberWithoutSecretReadsNothing: events carry transfer ids and
// hashes; only holders of the secret may read them.
func TestSubscriberWithoutSecretReadsNothing(t *testing.T) {
	zctx := harness(t)
	pub := newPub(t, zctx, "127.0.0.1", WithServerSecurity(mustSecurity(t, secretA, false)))
	sub := newSub(t, zctx)
	require.NoError(t, sub.Connect(pub.Endpoint()))
	pub.Send(readyEvent(0, "secret-transfer"))
	eventually(t, func() bool { return pub.Stats().Refused[string(refusedNoSecret)] > 0 })
	require.Zero(t, pub.Stats().Sent, "the event waits for an admitted subscriber")
	require.Zero(t, sub.Stats().Received)
}

// TestClientRecoversOnceTheServerIsFixed: libzmq gives up on a refused
// handshake for good; the client reconnects on a backoff.
func TestClientRecoversOnceTheServerIsFixed(t *testing.T) {
	zctx := harness(t)
	sec := mustSecurity(t, secretA, false)
	port := freePort(t)
	ep := Endpoint("127.0.0.1", port)
	plain, err := NewServer(zctx, ep, HandlerFunc(statusEcho), nil)
	require.NoError(t, err)
	cli := dial(t, zctx, ep, WithClientSecurity(sec))
	err = cli.Call(context.Background(), wire.OpStatus, wire.Status{}, nil)
	require.ErrorIs(t, err, ErrAuth)
	require.NoError(t, plain.Close())

	// libzmq releases a closed socket's port on its own thread, a moment
	// after Close returns.
	var fixed *Server
	eventually(t, func() bool {
		fixed, err = NewServer(zctx, ep, HandlerFunc(statusEcho), nil, WithServerSecurity(sec))
		return err == nil
	})
	t.Cleanup(func() { require.NoError(t, fixed.Close()) })
	eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		return cli.Call(ctx, wire.OpStatus, wire.Status{}, nil) == nil
	})
}

// TestPartOverWhatControlNeeds: the message of 16 parts of 30 MiB that
// grew a shard by 447 MB. Its first part announces more than any control
// message can be (wire.MaxMessage), so libzmq refuses it at the part's
// header and disconnects the peer before holding the part, nothing
// reaches the server, and the server goes on serving.
func TestPartOverWhatControlNeeds(t *testing.T) {
	zctx := harness(t)
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho))
	peer := dialZMTP(t, portOf(t, srv.Endpoint()))

	const parts, partBytes = 16, 30 << 20
	sent, err := peer.sendUntilClosed(parts, partBytes)
	require.Error(t, err, "the server closes the connection")
	require.Less(t, sent, int64(parts*partBytes), "the server hung up before the message was sent")
	_, err = peer.r.ReadByte()
	require.Error(t, err, "no reply: the peer was disconnected")

	st := srv.Stats()
	require.Zero(t, st.Oversized, "the message never reached the server")
	require.Zero(t, st.HeldPeak)
	t.Logf("the peer got %d MiB of a %d MiB message out before the server hung up", sent>>20, parts*partBytes>>20)

	fresh := dialZMTP(t, portOf(t, srv.Endpoint()))
	fresh.sendStreamed(1, 0) // an empty frame: a reply, so still serving
	require.Equal(t, wire.CodeBadRequest, fresh.reply().Err.Code)
}

// TestWholeMessageCap sends one message of 6 parts of 8 MiB from a peer
// that streams it without holding it, so that only the server's memory is
// at stake. The server keeps at most the cap and answers too_large.
func TestWholeMessageCap(t *testing.T) {
	zctx := harness(t)
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho))
	peer := dialZMTP(t, portOf(t, srv.Endpoint()))
	rssBefore := rssBytes(t)

	const parts, partBytes = 6, 8 << 20
	require.Less(t, partBytes, maxFrame, "each part passes the per-frame cap: only the whole-message cap stops it")
	peer.sendStreamed(parts, partBytes)
	rep := peer.reply()
	require.NotNil(t, rep.Err)
	require.Equal(t, wire.CodeTooLarge, rep.Err.Code, rep.Err.Msg)

	st := srv.Stats()
	require.Equal(t, uint64(1), st.Oversized)
	require.LessOrEqual(t, st.HeldPeak, uint64(MaxMessageBytes), "the server never kept more than the cap")
	t.Logf("message of %d MiB: server kept at most %d MiB; RSS grew by %d MiB",
		parts*partBytes>>20, st.HeldPeak>>20, (rssBytes(t)-rssBefore)>>20)

	peer.sendStreamed(1, 0) // an empty frame: still a reply, still serving
	require.Equal(t, wire.CodeBadRequest, peer.reply().Err.Code)
}

// zmtpPeer speaks ZMTP 3.0 (NULL mechanism, as a DEALER) over a plain
// connection, so a test can stream a message no libzmq peer would buffer.
type zmtpPeer struct {
	t *testing.T
	c net.Conn
	r *bufio.Reader
}

func dialZMTP(t *testing.T, port int) *zmtpPeer {
	t.Helper()
	c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(2*settle)))
	p := &zmtpPeer{t: t, c: c, r: bufio.NewReader(c)}
	greeting := make([]byte, 64)
	greeting[0], greeting[9], greeting[10] = 0xff, 0x7f, 3
	copy(greeting[12:], mechanismNull)
	ready := []byte("\x05READY\x0bSocket-Type")
	ready = binary.BigEndian.AppendUint32(ready, 6)
	ready = append(ready, "DEALER"...)
	_, err = c.Write(append(append(greeting, 0x04, byte(len(ready))), ready...))
	require.NoError(t, err)
	_, err = p.r.Discard(64) // the server's greeting
	require.NoError(t, err)
	flags, body := p.frame()
	require.Equal(t, byte(0x04), flags&0x04, "a READY command")
	require.True(t, strings.HasPrefix(string(body), "\x05READY"))
	return p
}

// sendStreamed sends one message of n parts of size bytes from a 1 MiB
// buffer.
func (p *zmtpPeer) sendStreamed(n, size int) {
	chunk := make([]byte, 1<<20)
	for i := range n {
		flags := byte(0x02) // long frame
		if i < n-1 {
			flags |= 0x01 // more
		}
		_, err := p.c.Write(binary.BigEndian.AppendUint64([]byte{flags}, uint64(size)))
		require.NoError(p.t, err)
		for left := size; left > 0; left -= len(chunk) {
			_, err := p.c.Write(chunk[:min(left, len(chunk))])
			require.NoError(p.t, err)
		}
	}
}

// sendUntilClosed sends what sendStreamed does until a write fails, and
// returns the bytes written and the failure.
func (p *zmtpPeer) sendUntilClosed(n, size int) (int64, error) {
	chunk := make([]byte, 1<<20)
	var sent int64
	for i := range n {
		flags := byte(0x03) // long frame, more
		if i == n-1 {
			flags = 0x02
		}
		if _, err := p.c.Write(binary.BigEndian.AppendUint64([]byte{flags}, uint64(size))); err != nil {
			return sent, err
		}
		for left := size; left > 0; left -= len(chunk) {
			k, err := p.c.Write(chunk[:min(left, len(chunk))])
			sent += int64(k)
			if err != nil {
				return sent, err
			}
		}
	}
	return sent, nil
}

func (p *zmtpPeer) frame() (byte, []byte) {
	flags, err := p.r.ReadByte()
	require.NoError(p.t, err)
	var size uint64
	if flags&0x02 != 0 {
		var b [8]byte
		_, err = io.ReadFull(p.r, b[:])
		size = binary.BigEndian.Uint64(b[:])
	} else {
		var b byte
		b, err = p.r.ReadByte()
		size = uint64(b)
	}
	require.NoError(p.t, err)
	body := make([]byte, size)
	_, err = io.ReadFull(p.r, body)
	require.NoError(p.t, err)
	return flags, body
}

func (p *zmtpPeer) reply() wire.Reply {
	flags, body := p.frame()
	require.Zero(p.t, flags&0x05, "one data frame")
	rep, err := wire.DecodeReply(body)
	require.NoError(p.t, err)
	return rep
}

func portOf(t *testing.T, ep string) int {
	t.Helper()
	_, port, err := SplitEndpoint(ep)
	require.NoError(t, err)
	return port
}

func rssBytes(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	pages, _ := strconv.ParseInt(f[1], 10, 64)
	return pages * int64(os.Getpagesize())
}

// failures reads ecm_failures_total{component="control",reason=r}.
func failures(t *testing.T, r string) float64 {
	t.Helper()
	text, err := metrics.Text(nil)
	require.NoError(t, err)
	prefix := `ecm_failures_total{component="control",reason="` + r + `"} `
	for _, line := range strings.Split(string(text), "\n") {
		if v, ok := strings.CutPrefix(line, prefix); ok {
			n, err := strconv.ParseFloat(v, 64)
			require.NoError(t, err)
			return n
		}
	}
	return 0
}

// eventually waits, within the harness bound, for cond.
func eventually(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(settle)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// BenchmarkCurveCost measures what CURVE adds to a control round trip:
// each iteration makes one call on a plain client/server pair and one on a
// CURVE pair, timed apart, so both see the same machine load. x-plain is
// the CURVE round trip as a ratio to the plain one.
func BenchmarkCurveCost(b *testing.B) {
	zctx, err := zmq.NewContext()
	require.NoError(b, err)
	defer zctx.Term()
	sec, err := NewSecurity(secretA, false)
	require.NoError(b, err)
	pair := func(opts ...ServerOption) (*Server, *Client) {
		srv, err := NewServer(zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho), nil, opts...)
		require.NoError(b, err)
		var copts []ClientOption
		if len(opts) > 0 {
			copts = append(copts, WithClientSecurity(sec))
		}
		cli, err := Dial(zctx, srv.Endpoint(), nil, copts...)
		require.NoError(b, err)
		return srv, cli
	}
	plainSrv, plain := pair()
	defer plainSrv.Close()
	defer plain.Close()
	curveSrv, curve := pair(WithServerSecurity(sec))
	defer curveSrv.Close()
	defer curve.Close()
	ctx := context.Background()

	for _, size := range []int{4, 256} {
		// A status of n ids is about the size of a reserve_batch of n
		// items, and its reply of a reserve_batch reply.
		body := wire.Status{TransferIDs: names("transfer-id-", size)}
		for _, c := range []*Client{plain, curve} {
			require.NoError(b, c.Call(ctx, wire.OpStatus, body, nil)) // connect
		}
		b.Run("ids="+strconv.Itoa(size), func(b *testing.B) {
			var tPlain, tCurve time.Duration
			for b.Loop() {
				start := time.Now()
				if err := plain.Call(ctx, wire.OpStatus, body, nil); err != nil {
					b.Fatal(err)
				}
				mid := time.Now()
				if err := curve.Call(ctx, wire.OpStatus, body, nil); err != nil {
					b.Fatal(err)
				}
				tPlain += mid.Sub(start)
				tCurve += time.Since(mid)
			}
			n := time.Duration(b.N)
			b.ReportMetric(float64(tPlain/n)/1e3, "plain-us")
			b.ReportMetric(float64(tCurve/n)/1e3, "curve-us")
			b.ReportMetric(float64(tCurve)/float64(tPlain), "x-plain")
		})
	}
}
