package control

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// dialBare opens a TCP connection to a shard's control port that never
// says a word: a peer that only holds a slot.
func dialBare(t *testing.T, port int) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// closedByPeer waits until the server has closed c.
func closedByPeer(t *testing.T, c net.Conn) {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(settle)))
	buf := make([]byte, 256)
	for {
		_, err := c.Read(buf)
		if err == nil {
			continue // the server's greeting
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("the server kept a silent connection past %s", settle)
		}
		require.True(t, errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || isReset(err), "closed, got %v", err)
		return
	}
}

func isReset(err error) bool {
	var op *net.OpError
	return errors.As(err, &op)
}

// TestSilentConnectionsMeetTheHandshakeDeadline: a connection that never
// completes the handshake is closed after handshakeTimeout, not held for
// libzmq's default of 30 s (or forever).
func TestSilentConnectionsMeetTheHandshakeDeadline(t *testing.T) {
	zctx := harness(t)
	sec := mustSecurity(t, "conncap-deployment-secret-0123", false)
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho), WithServerSecurity(sec))
	require.LessOrEqual(t, 2*handshakeTimeout, settle, "the deadline must be well inside the test's bound")
	closedByPeer(t, dialBare(t, portOf(t, srv.Endpoint())))
}

// TestConnectionCapKeepsRoomForAPeerWithTheSecret: at the cap the
// youngest connection that may still be mid-handshake makes room, so a
// flood of silent connections neither grows without bound nor locks out
// a producer that holds the secret.
func TestConnectionCapKeepsRoomForAPeerWithTheSecret(t *testing.T) {
	zctx := harness(t)
	sec := mustSecurity(t, "conncap-deployment-secret-0123", false)
	const limit = 8
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho), WithServerSecurity(sec), WithMaxConns(limit))
	port := portOf(t, srv.Endpoint())
	var flood []net.Conn
	for range 4 * limit {
		flood = append(flood, dialBare(t, port))
	}
	eventually(t, func() bool { return srv.Stats().ConnsEvicted >= 3*limit })
	// The server closed the flood beyond the cap, oldest first.
	closedByPeer(t, flood[0])

	cli, err := Dial(zctx, srv.Endpoint(), nil, WithClientSecurity(sec))
	require.NoError(t, err)
	t.Cleanup(func() { cli.Close() })
	for range limit {
		dialBare(t, port) // the attacker keeps at it
	}
	eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		return cli.Call(ctx, wire.OpStatus, wire.Status{}, nil) == nil
	})
	st := srv.Stats()
	require.LessOrEqual(t, st.ConnsLive, limit, "never more than the cap")
	t.Logf("evicted %d silent connections; %d live", st.ConnsEvicted, st.ConnsLive)
}

// TestConnCapChoosesTheLongestWaitingUnproven walks the cap's decision
// with a fake clock: proven connections (older than the handshake
// deadline) stay, the oldest young one goes, and with none the newcomer.
func TestConnCapChoosesTheLongestWaitingUnproven(t *testing.T) {
	now := time.Unix(1000, 0)
	c := newConnCap(3, 3)
	c.now = func() time.Time { return now }
	step := func(d time.Duration) { now = now.Add(d) }

	for _, fd := range []int{10, 11} {
		_, why := c.accepted(fd, "a")
		require.Empty(t, why)
	}
	step(time.Minute) // 10 and 11 are proven now
	_, why := c.accepted(12, "a")
	require.Empty(t, why, "at the cap, not over it")
	step(time.Millisecond)
	victim, why := c.accepted(13, "a")
	require.Equal(t, capTotal, why)
	require.Equal(t, 12, victim, "the young one that waited longest goes, not a proven one")
	step(time.Minute)
	victim, why = c.accepted(14, "a")
	require.Equal(t, capTotal, why)
	require.Equal(t, 14, victim, "with every other one proven, the newcomer is refused")
	c.gone(10)
	_, why = c.accepted(15, "a")
	require.Empty(t, why, "a hang-up makes room")
	live, evicted := c.stats()
	require.Equal(t, 3, live)
	require.Equal(t, uint64(2), evicted)
}

// TestConnCapIsFairAcrossPeerAddresses: a flood from one address makes
// room from its own connections, never from another address's, even
// one still young; and one address holds at most its share of the cap.
func TestConnCapIsFairAcrossPeerAddresses(t *testing.T) {
	now := time.Unix(1000, 0)
	step := func() { now = now.Add(time.Millisecond) }

	c := newConnCap(4, 4)
	c.now = func() time.Time { return now }
	_, why := c.accepted(10, "192.0.2.1") // a producer, mid-handshake
	require.Empty(t, why)
	for fd := 11; fd <= 13; fd++ {
		step()
		_, why := c.accepted(fd, "192.0.2.66")
		require.Empty(t, why)
	}
	for fd := 14; fd <= 40; fd++ {
		step()
		victim, why := c.accepted(fd, "192.0.2.66")
		require.Equal(t, capTotal, why)
		require.Equal(t, fd-3, victim, "the flooding address's own oldest goes, not the producer's")
	}

	c = newConnCap(100, 2)
	c.now = func() time.Time { return now }
	for _, fd := range []int{20, 21} {
		step()
		_, why := c.accepted(fd, "192.0.2.66")
		require.Empty(t, why)
	}
	step()
	victim, why := c.accepted(22, "192.0.2.66")
	require.Equal(t, capPeer, why, "over its share, with room in the cap")
	require.Equal(t, 20, victim)
	now = now.Add(time.Minute) // 21 and 22 are proven
	victim, why = c.accepted(23, "192.0.2.66")
	require.Equal(t, capPeer, why)
	require.Equal(t, 23, victim, "with its share proven, the newcomer of that address is refused")
	_, why = c.accepted(24, "192.0.2.1")
	require.Empty(t, why, "another address is not held to the first one's share")
	c.gone(21)
	_, why = c.accepted(25, "192.0.2.66")
	require.Empty(t, why, "a hang-up gives the address room again")
}

// TestOneAddressHoldsOnlyItsShare: a flood of silent connections from one
// address (127.0.0.2) is held to its share of the cap, counted as
// conn_cap_peer, while a producer of another address (127.0.0.1) that
// holds the secret keeps calling.
func TestOneAddressHoldsOnlyItsShare(t *testing.T) {
	zctx := harness(t)
	sec := mustSecurity(t, "conncap-deployment-secret-0123", false)
	const limit, share = 8, 3
	srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho), WithServerSecurity(sec),
		WithMaxConns(limit), WithMaxConnsPerPeer(share))
	port := portOf(t, srv.Endpoint())
	cli, err := Dial(zctx, srv.Endpoint(), nil, WithClientSecurity(sec))
	require.NoError(t, err)
	t.Cleanup(func() { cli.Close() })
	call := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		return cli.Call(ctx, wire.OpStatus, wire.Status{}, nil)
	}
	eventually(t, func() bool { return call() == nil })

	before := failures(t, capPeer)
	from := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	var flood []net.Conn
	for range 4 * limit {
		c, err := from.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		flood = append(flood, c)
	}
	eventually(t, func() bool { return failures(t, capPeer)-before >= 4*limit-share })
	closedByPeer(t, flood[0])
	require.LessOrEqual(t, srv.Stats().ConnsLive, 1+share, "the producer's connection and the flood's share")
	require.NoError(t, call(), "the producer never lost its place")
}
