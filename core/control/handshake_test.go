package control

import (
	"context"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// A ZMTP 3 greeting opens with a 10-byte signature and the major version;
// the rest (minor version, mechanism, as-server, filler) makes 64 bytes.
// libzmq sends the rest only once it has read the peer's major version,
// and checks the mechanism as soon as the peer's greeting is complete. On
// a loaded host one end often reads the other's whole greeting in one go
// and hangs up on a mismatch before its own rest is written: the other
// end then sees a connection closed mid-greeting, with no mechanism to
// compare, which is the case these tests pin down.
const (
	greetingHead = 11
	greetingSize = 64
)

func zmtpHead() []byte {
	head := make([]byte, greetingHead)
	head[0], head[9], head[10] = 0xff, 0x7f, 3
	return head
}

// hangUpServer listens on loopback and treats every connection as a
// loaded libzmq server of the other mechanism would: it sends its
// signature and major version, reads the client's whole greeting and
// hangs up. It returns the endpoint and how many connections it refused.
func hangUpServer(t *testing.T) (string, func() int) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var mu sync.Mutex
	n := 0
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.SetDeadline(time.Now().Add(settle))
			if _, err := c.Write(zmtpHead()); err == nil {
				if _, err := io.ReadFull(c, make([]byte, greetingSize)); err == nil {
					mu.Lock()
					n++
					mu.Unlock()
				}
			}
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return Endpoint("127.0.0.1", ln.Addr().(*net.TCPAddr).Port), func() int {
		mu.Lock()
		defer mu.Unlock()
		return n
	}
}

// TestClientDiagnosesAHangUpInTheGreeting: a server that closes every
// connection during the greeting is refusing this end's mechanism, and
// the call says which setting to fix, not that its deadline passed.
func TestClientDiagnosesAHangUpInTheGreeting(t *testing.T) {
	for _, tc := range []struct {
		name, secret, says string
	}{
		{"plain client", "", "requires an auth_secret"},
		{"curve client", secretA, "auth_secret"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			zctx := harness(t)
			ep, refused := hangUpServer(t)
			cli := dial(t, zctx, ep, WithClientSecurity(mustSecurity(t, tc.secret, false)))
			// A deadline far beyond the few reconnects a diagnosis takes:
			// reaching it is the failure this test exists for.
			ctx, cancel := context.WithTimeout(context.Background(), 3*settle)
			defer cancel()
			err := cli.Call(ctx, wire.OpStatus, wire.Status{}, nil)
			require.ErrorIs(t, err, ErrAuth, "fails on the hang-up, not at the deadline")
			require.NotErrorIs(t, err, context.DeadlineExceeded)
			require.ErrorContains(t, err, tc.says)
			require.GreaterOrEqual(t, refused(), 1)
			require.Positive(t, cli.Stats().Refused[string(refusedAborted)], "the client counts what it was refused")
		})
	}
}

// TestServerCountsAHangUpInTheGreeting: a peer that reads this server's
// greeting and hangs up before sending its mechanism is the other side of
// the same race (the peer found the mechanisms differ first); the server
// counts it, whatever its own mode.
func TestServerCountsAHangUpInTheGreeting(t *testing.T) {
	for _, tc := range []struct {
		name, secret string
	}{
		{"curve server", secretA},
		{"plain server", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			zctx := harness(t)
			before := failures(t, string(refusedAborted))
			srv := startServer(t, zctx, "tcp://127.0.0.1:0", HandlerFunc(statusEcho), WithServerSecurity(mustSecurity(t, tc.secret, false)))
			c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(portOf(t, srv.Endpoint()))))
			require.NoError(t, err)
			require.NoError(t, c.SetDeadline(time.Now().Add(settle)))
			_, err = c.Write(zmtpHead())
			require.NoError(t, err)
			_, err = io.ReadFull(c, make([]byte, greetingSize))
			require.NoError(t, err, "the server's whole greeting")
			require.NoError(t, c.Close())
			eventually(t, func() bool { return srv.Stats().Refused[string(refusedAborted)] == 1 })
			require.Equal(t, before+1, failures(t, string(refusedAborted)))
			require.Zero(t, srv.Stats().Served)
		})
	}
}
