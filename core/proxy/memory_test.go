package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/proxy/fakevllm"
)

// proxyProcess is a proxy running in a process of its own (cmd/proxyrss),
// built without the race detector so that its resident set is the
// proxy's alone.
type proxyProcess struct {
	addr string
	in   io.WriteCloser
	out  *bufio.Scanner
}

func startProxyProcess(t *testing.T, cfg map[string]any) *proxyProcess {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "proxyrss")
	build := exec.Command("go", "build", "-o", bin, "github.com/ecmooncake/ecmooncake/core/proxy/cmd/proxyrss")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "build cmd/proxyrss: %s", out)
	raw, err := json.Marshal(cfg)
	require.NoError(t, err)
	cmd := exec.Command(bin, string(raw))
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	stderr := &lockedBuffer{}
	cmd.Stderr = stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		in.Close()
		if err := cmd.Wait(); err != nil {
			t.Logf("proxyrss: %v; stderr:\n%s", err, stderr.String())
		}
	})
	pp := &proxyProcess{in: in, out: bufio.NewScanner(stdout)}
	if !pp.out.Scan() {
		t.Fatalf("proxyrss printed nothing; stderr:\n%s", stderr.String())
	}
	_, err = fmt.Sscanf(pp.out.Text(), "addr %s", &pp.addr)
	require.NoError(t, err, "proxyrss said %q", pp.out.Text())
	return pp
}

// lockedBuffer is a buffer a child's output is copied into while the
// test may read it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// memory is the process's resident set now and its peak, in bytes.
func (pp *proxyProcess) memory(t *testing.T) (rss, peak int64) {
	t.Helper()
	_, err := io.WriteString(pp.in, "rss\n")
	require.NoError(t, err)
	require.True(t, pp.out.Scan())
	_, err = fmt.Sscanf(pp.out.Text(), "rss %d %d", &rss, &peak)
	require.NoError(t, err, "proxyrss said %q", pp.out.Text())
	return rss << 10, peak << 10
}

// gate lets n callers through together, once all have arrived.
type gate struct {
	mu      sync.Mutex
	n       int
	arrived chan struct{}
}

func newGate(n int) *gate { return &gate{n: n, arrived: make(chan struct{})} }

func (b *gate) wait(ctx context.Context) error {
	b.mu.Lock()
	if b.n--; b.n == 0 {
		close(b.arrived)
	}
	b.mu.Unlock()
	select {
	case <-b.arrived:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(2 * time.Minute):
		return errors.New("gate: not every call arrived")
	}
}

// imageRequest is a chat request whose one image is a data URL of n bytes.
func imageRequest(n int, fill byte) []byte {
	head := `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"describe"},{"type":"image_url","image_url":{"url":"data:image/png;base64,`
	tail := `"}}]}]}`
	b := make([]byte, 0, len(head)+n+len(tail))
	b = append(b, head...)
	b = append(b, bytes.Repeat([]byte{fill}, n)...)
	return append(b, tail...)
}

// TestProxyMemoryStaysWithinTheBodiesInFlight is the attack on the
// proxy's memory as a client runs it: three clients each send a request
// with a large image at once, each body under max_body_bytes. The
// encoder answers only once it has all three, so the proxy holds the
// three bodies together. The proxy's resident set must stay within 1.5 ×
// the body bytes it held at once (its own count, ecm_proxy_body_bytes_
// in_flight_peak) plus a fixed margin for the runtime and its buffers.
func TestProxyMemoryStaysWithinTheBodiesInFlight(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a proxy process with ~300 MiB of bodies")
	}
	const (
		clients = 3
		margin  = 64 << 20
	)
	// The proxy process never runs under the race detector; this one,
	// which builds the bodies and serves them as the backends, is slower
	// there, so the bodies are smaller (still well above the margin).
	image := 96 << 20
	if raceEnabled {
		image = 32 << 20
	}
	all := newGate(clients)
	enc := startFake(t, fakevllm.RoleEncode, fakevllm.Config{OnEncode: func(ctx context.Context, _ fakevllm.Encode) error {
		return all.wait(ctx)
	}})
	pd := startFake(t, fakevllm.RolePD, fakevllm.Config{})
	pp := startProxyProcess(t, map[string]any{
		"host": "127.0.0.1", "port": 0, "encode": []string{enc.URL()}, "pd": []string{pd.URL()},
		"max_body_bytes": image + (1 << 20), "max_bodies_in_flight": 4,
		"health_interval_s": 0.05, "fail_threshold": 2, "health_timeout_s": 30,
		"encode_timeout_s": 180, "request_timeout_s": 240,
	})
	base, _ := pp.memory(t)

	var wg sync.WaitGroup
	codes := make([]int, clients)
	answers := make([]string, clients)
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Each client from an address of its own, as three users.
			d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(11+i))}}
			c := &http.Client{Timeout: 4 * time.Minute, Transport: &http.Transport{DialContext: d.DialContext}}
			resp, err := c.Post("http://"+pp.addr+"/v1/chat/completions", "application/json", bytes.NewReader(imageRequest(image, 'A'+byte(i))))
			if err != nil {
				answers[i] = err.Error()
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			codes[i], answers[i] = resp.StatusCode, string(b)
		}()
	}
	wg.Wait()
	for i := range clients {
		require.Equal(t, http.StatusOK, codes[i], "client %d: %s", i, answers[i])
	}

	resp, err := http.Get("http://" + pp.addr + "/metrics")
	require.NoError(t, err)
	text := readAll(t, resp)
	inFlight := gauge(t, text, "ecm_proxy_body_bytes_in_flight_peak")
	_, peak := pp.memory(t)
	t.Logf("proxy RSS: %d MiB at start, %d MiB at its peak; body bytes in flight at their peak: %d MiB; bound 1.5 × in flight + %d MiB = %d MiB",
		base>>20, peak>>20, inFlight>>20, margin>>20, (3*inFlight/2+margin)>>20)
	require.GreaterOrEqual(t, inFlight, int64(clients*image), "the three bodies were held at once")
	require.Greater(t, inFlight, int64(margin), "the bodies, not the margin, decide the bound")
	require.LessOrEqual(t, peak, 3*inFlight/2+margin, "the proxy's memory is bounded by the bodies it holds")
}
