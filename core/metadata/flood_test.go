package metadata

import (
	"bufio"
	"net"
	"net/http"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// dialFrom opens a connection to the store from the loopback address ip
// and sends nothing: a peer that only holds a place.
func dialFrom(t *testing.T, s *Server, ip net.IP) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: ip}, Timeout: 10 * time.Second}
	c, err := d.Dial("tcp", s.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// healthOK is what a Mooncake engine (or Ensure) asks first: GET /health
// within the engine's 3-second timeout.
func healthOK(t *testing.T, s *Server) {
	t.Helper()
	// A connection of its own, as a new engine's.
	cli := http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := cli.Get("http://" + s.Addr() + "/health")
	require.NoError(t, err, "GET /health during the flood")
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "GET /health during the flood")
}

// engineClient is an engine with the token and keep-alive connections
// of its own.
func engineClient(s *Server) *mooncakeClient {
	c := newClient(s)
	c.token = "deployment-token"
	c.http.Transport = &http.Transport{}
	return c
}

// TestIdleFloodLeavesTheStoreToEngines is the attack as run against the
// store: whoever reaches its port, with no token, opens more connections
// than it serves and sends nothing on them, from the engines' own address
// and from others, and keeps opening new ones. An engine of the
// deployment must still be answered, within the 3 s Mooncake allows,
// and /health too.
func TestIdleFloodLeavesTheStoreToEngines(t *testing.T) {
	s := listen(t, Config{Token: "deployment-token"})
	max := s.cfg.MaxConns

	// The engines' own address, past the cap.
	for range max + 16 {
		dialFrom(t, s, net.IPv4(127, 0, 0, 1))
	}
	// Many addresses, a few connections each: no share per address
	// stops these alone.
	for i := range max {
		dialFrom(t, s, net.IPv4(127, 0, 1+byte(i/200), 1+byte(i%200)))
	}

	// The attacker keeps opening connections while the engine works.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var ring []net.Conn
		defer func() {
			for _, c := range ring {
				c.Close()
			}
		}()
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}, Timeout: 10 * time.Second}
		for n := 0; n < 4*max; n++ {
			select {
			case <-stop:
				return
			default:
			}
			c, err := d.Dial("tcp", s.Addr())
			if err != nil {
				continue
			}
			// A bounded ring keeps the test's own descriptors in check;
			// the store sees a stream of new silent connections.
			if ring = append(ring, c); len(ring) > max/2 {
				ring[0].Close()
				ring = ring[1:]
			}
		}
	}()
	defer func() { close(stop); wg.Wait() }()

	healthOK(t, s)
	engine := engineClient(s)
	code, body := engine.do(http.MethodPut, "mooncake/rpc_meta/seg0", []byte(`{"ip":"10.0.0.1","port":12345}`))
	require.Equal(t, http.StatusOK, code, "an engine publishes during the flood: %s", body)
	code, body = engine.get("mooncake/rpc_meta/seg0")
	require.Equal(t, http.StatusOK, code, "an engine reads during the flood: %s", body)
	healthOK(t, s)

	st := s.Stats()
	require.LessOrEqual(t, st.Conns, max, "the cap holds")
	require.NotZero(t, st.EvictedConns, "the flood made room from its own idle connections")
}

// TestAConnectionThatSentNothingMakesRoom: at the cap, the connection
// that has sent no complete request makes room for a newcomer, the
// address with the most such connections first and its oldest first;
// one that completed an authorized request keeps its place; with no idle
// unproven connection left, the newcomer is answered 503 and closed.
func TestAConnectionThatSentNothingMakesRoom(t *testing.T) {
	s := listen(t, Config{Token: "deployment-token", MaxConns: 3})

	// An engine's keep-alive connection, proven by a request with the token.
	engine := engineClient(s)
	require.Equal(t, http.StatusOK, engine.put("k", "v"))

	silent := dialFrom(t, s, net.IPv4(127, 0, 0, 3))
	require.Eventually(t, func() bool { return s.Stats().Conns == 2 }, time.Minute, time.Millisecond)
	dialFrom(t, s, net.IPv4(127, 0, 0, 3))
	require.Eventually(t, func() bool { return s.Stats().Conns == 3 }, time.Minute, time.Millisecond)

	// Full: the newcomer takes the place of the oldest silent one.
	healthOK(t, s)
	requireClosedByPeer(t, silent)
	require.Equal(t, uint64(1), s.Stats().EvictedConns)

	// The engine's connection was never the one to go.
	code, _ := engine.get("k")
	require.Equal(t, http.StatusOK, code)
}

// TestWithEveryPlaceProvenTheNewcomerIsRefused: connections that proved
// themselves keep their places; a newcomer past the cap is answered 503
// and counted.
func TestWithEveryPlaceProvenTheNewcomerIsRefused(t *testing.T) {
	s := listen(t, Config{Token: "deployment-token", MaxConns: 2})
	for range 2 {
		e := engineClient(s)
		require.Equal(t, http.StatusOK, e.put("k", "v"))
	}
	require.Eventually(t, func() bool { return s.Stats().Conns == 2 }, time.Minute, time.Millisecond)
	c := dialFrom(t, s, net.IPv4(127, 0, 0, 1))
	require.NoError(t, c.SetReadDeadline(time.Now().Add(time.Minute)))
	status, err := bufio.NewReader(c).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "HTTP/1.1 503 Service Unavailable\r\n", status)
	require.Equal(t, uint64(1), s.Stats().RejectedConns)
}

// TestOneAddressHoldsOnlyItsShare: past its share, an address's own
// oldest idle connection makes room, even with room in the cap.
func TestOneAddressHoldsOnlyItsShare(t *testing.T) {
	s := listen(t, Config{MaxConns: 100, MaxConnsPerPeer: 2})
	first := dialFrom(t, s, net.IPv4(127, 0, 0, 4))
	dialFrom(t, s, net.IPv4(127, 0, 0, 4))
	dialFrom(t, s, net.IPv4(127, 0, 0, 4))
	requireClosedByPeer(t, first)
	require.Eventually(t, func() bool { return s.Stats().Conns == 2 }, time.Minute, time.Millisecond)
	healthOK(t, s) // from 127.0.0.1, not held to 127.0.0.4's share
}

// requireClosedByPeer waits until the store has closed c.
func requireClosedByPeer(t *testing.T, c net.Conn) {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(time.Minute)))
	var b [64]byte
	for {
		if _, err := c.Read(b[:]); err != nil {
			require.NotErrorIs(t, err, os.ErrDeadlineExceeded, "the store kept the connection")
			return
		}
	}
}
