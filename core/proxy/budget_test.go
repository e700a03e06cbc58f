package proxy

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestBodyBudgetGrants(t *testing.T) {
	b := newBodyBudget(100, 100)
	g1, g2 := b.open("a"), b.open("b")
	require.NoError(t, g1.grow(60))
	require.ErrorIs(t, g2.grow(41), errOverBudget, "60 + 41 is over the budget of 100")
	require.NoError(t, g2.grow(40))
	require.Equal(t, int64(100), b.held())
	g1.shrinkTo(10)
	require.Equal(t, int64(50), b.held())
	require.NoError(t, g2.grow(50))
	g1.release()
	g1.release() // twice is once
	require.Equal(t, int64(90), b.held())
	g2.release()
	require.Equal(t, int64(0), b.held())
	require.Equal(t, int64(100), b.peak())
	require.Equal(t, uint64(1), b.refused())
}

// gauge reads one unlabelled series from a /metrics text.
func gauge(t *testing.T, text, name string) int64 {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + name + ` (\S+)$`).FindStringSubmatch(text)
	require.NotNil(t, m, "%s missing from /metrics", name)
	v, err := strconv.ParseFloat(m[1], 64)
	require.NoError(t, err)
	return int64(v)
}

func TestBodyBudgetKeepsEachClientToItsShare(t *testing.T) {
	b := newBodyBudget(100, 60)
	a1, a2, other := b.open("a"), b.open("a"), b.open("b")
	require.NoError(t, a1.grow(50))
	require.ErrorIs(t, a2.grow(20), errOverShare, "50 + 20 is over a's share of 60")
	require.NoError(t, other.grow(40), "b's room is not a's")
	require.NoError(t, a2.grow(10))
	a1.release()
	require.NoError(t, a2.grow(40), "a's share comes back with its bytes")
	require.Equal(t, uint64(1), b.refusedShare())
	require.Equal(t, uint64(0), b.refused())
}

// sendPartial opens a connection, sends a chat request's header naming a
// body of length bytes and the first sent bytes of it, and leaves it open.
func sendPartial(t *testing.T, addr string, length, sent int) net.Conn {
	t.Helper()
	return sendPartialFrom(t, nil, addr, length, sent)
}

// sendPartialFrom is sendPartial from the loopback address ip.
func sendPartialFrom(t *testing.T, ip net.IP, addr string, length, sent int) net.Conn {
	t.Helper()
	d := net.Dialer{}
	if ip != nil {
		d.LocalAddr = &net.TCPAddr{IP: ip}
	}
	c, err := d.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	head := fmt.Sprintf("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", length)
	_, err = c.Write(append([]byte(head), []byte(strings.Repeat(" ", sent))...))
	require.NoError(t, err)
	return c
}

// An attacker on the user port holds large bodies open, unfinished: what
// the proxy holds of them stops at the budget (max_body_bytes ×
// max_bodies_in_flight), a body beyond it is refused with 503 and
// Retry-After and counted, and once the attacker leaves, requests pass.
func TestConcurrentBodiesStayWithinTheBudget(t *testing.T) {
	// Larger than what loopback buffers hold, so a client still sending
	// when the proxy answers would meet a closed connection.
	const limit = 16 << 20
	r := newRig(t, rigOpts{encoders: 1, pds: 1, mut: func(c *Config) {
		c.MaxBodyBytes, c.MaxBodiesInFlight = limit, 2
		c.MaxBodyBytesPerClient = 2 * limit // one client may hold the whole budget here
	}})
	addr := r.p.Addr()
	a1 := sendPartial(t, addr, limit, limit-1)
	a2 := sendPartial(t, addr, limit, limit-1)
	require.Eventually(t, func() bool {
		return gauge(t, metricsText(t, r.url), "ecm_proxy_body_bytes_in_flight") == 2*limit
	}, 20*time.Second, 10*time.Millisecond, "the two unfinished bodies are held, each at most its length")

	// The third, a client like any, sends all of its body before it reads
	// the answer: the proxy reads it into nothing and answers.
	a3 := sendPartial(t, addr, limit, limit)
	require.NoError(t, a3.SetReadDeadline(time.Now().Add(20*time.Second)))
	resp, err := http.ReadResponse(bufio.NewReader(a3), nil)
	require.NoError(t, err)
	body := readAll(t, resp)
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, body)
	require.NotEmpty(t, resp.Header.Get("Retry-After"))
	require.Contains(t, body, "max_bodies_in_flight")

	text := metricsText(t, r.url)
	require.LessOrEqual(t, gauge(t, text, "ecm_proxy_body_bytes_in_flight_peak"), int64(2*limit))
	require.Equal(t, int64(1), gauge(t, text, "ecm_proxy_body_refusals_total"))

	a1.Close()
	a2.Close()
	require.Eventually(t, func() bool {
		return gauge(t, metricsText(t, r.url), "ecm_proxy_body_bytes_in_flight") == 0
	}, 20*time.Second, 10*time.Millisecond, "an abandoned body gives its bytes back")
	code, answer := r.post("/v1/chat/completions", chat(false, image("http://img/1.png")))
	require.Equal(t, http.StatusOK, code, string(answer))
}

// One client's stalled uploads hold only its share of the budget: its
// next body is refused with 503 and counted as a client refusal, while
// another client's request still passes.
func TestOneClientHoldsOnlyItsShareOfTheBudget(t *testing.T) {
	const limit = 1 << 20
	r := newRig(t, rigOpts{encoders: 1, pds: 1, mut: func(c *Config) {
		c.MaxBodyBytes, c.MaxBodiesInFlight = limit, 4 // the default share: 2 bodies
	}})
	addr := r.p.Addr()
	attacker := net.IPv4(127, 0, 0, 31)
	sendPartialFrom(t, attacker, addr, limit, limit/2)
	sendPartialFrom(t, attacker, addr, limit, limit/2)
	require.Eventually(t, func() bool {
		return gauge(t, metricsText(t, r.url), "ecm_proxy_body_bytes_in_flight") == 2*limit
	}, 20*time.Second, 10*time.Millisecond, "the attacker's two stalled bodies are held")

	third := sendPartialFrom(t, attacker, addr, limit, limit)
	require.NoError(t, third.SetReadDeadline(time.Now().Add(20*time.Second)))
	resp, err := http.ReadResponse(bufio.NewReader(third), nil)
	require.NoError(t, err)
	body := readAll(t, resp)
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, body)
	require.Contains(t, body, "max_body_bytes_per_client")

	// Another client, with the budget half free.
	code, answer := r.post("/v1/chat/completions", chat(false, image("http://img/1.png")))
	require.Equal(t, http.StatusOK, code, string(answer))
	text := metricsText(t, r.url)
	require.Equal(t, int64(1), gauge(t, text, "ecm_proxy_body_client_refusals_total"))
	require.Equal(t, int64(0), gauge(t, text, "ecm_proxy_body_refusals_total"))
}
