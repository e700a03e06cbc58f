package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/proxy/fakevllm"
)

// rig is a proxy in front of fake encoders and PD instances, all on
// loopback.
type rig struct {
	t     *testing.T
	enc   []*fakevllm.Server
	pd    []*fakevllm.Server
	p     *Proxy
	url   string
	httpc *http.Client
}

type rigOpts struct {
	encoders, pds int
	fake          fakevllm.Config
	mut           func(*Config)
}

// startFake starts a fake vLLM instance of role, closed with the test.
func startFake(t *testing.T, role string, fc fakevllm.Config) *fakevllm.Server {
	t.Helper()
	fc.Role = role
	s, err := fakevllm.Start(fc)
	require.NoError(t, err)
	t.Cleanup(s.Close)
	return s
}

// decodeCases is a table of DecodeConfig inputs, by name, and the text
// each one's error must hold ("" for none).
type decodeCases map[string]struct{ json, want string }

func (cases decodeCases) check(t *testing.T) {
	t.Helper()
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeConfig([]byte(tc.json))
			if tc.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func newRig(t *testing.T, o rigOpts) *rig {
	t.Helper()
	r := &rig{t: t, httpc: &http.Client{Timeout: 30 * time.Second}}
	cfg := DefaultConfig()
	cfg.Host, cfg.Port = "127.0.0.1", 0
	cfg.HealthIntervalS, cfg.FailThreshold = 0.05, 2
	// The fakes answer /health at once or refuse the connection, so only
	// a loaded host makes a check slow: a timeout far above its jitter
	// keeps a slow check from dropping a live backend.
	cfg.HealthTimeoutS = 30
	cfg.EncodeTimeoutS, cfg.RequestTimeoutS = 10, 20
	// Most tests send the same images again and count encoder calls and
	// where requests went; affinity_test.go turns affinity on.
	cfg.AffinityEntries = 0
	for i := 0; i < o.encoders; i++ {
		r.enc = append(r.enc, startFake(t, fakevllm.RoleEncode, o.fake))
		cfg.Encode = append(cfg.Encode, r.enc[i].URL())
	}
	for i := 0; i < o.pds; i++ {
		r.pd = append(r.pd, startFake(t, fakevllm.RolePD, o.fake))
		cfg.PD = append(cfg.PD, r.pd[i].URL())
	}
	if o.mut != nil {
		o.mut(&cfg)
	}
	p, err := Open(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	r.p, r.url = p, "http://"+p.Addr()
	return r
}

// post sends a JSON body and returns the status and the whole answer.
func (r *rig) post(path string, body any) (int, []byte) {
	r.t.Helper()
	b, err := json.Marshal(body)
	require.NoError(r.t, err)
	resp, err := r.httpc.Post(r.url+path, "application/json", bytes.NewReader(b))
	require.NoError(r.t, err)
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	require.NoError(r.t, err)
	return resp.StatusCode, out
}

// abandon sends a chat request from a client that gives up on it after
// 300 ms, before the answer comes.
func (r *rig) abandon(body any) {
	r.t.Helper()
	c := &http.Client{Timeout: 300 * time.Millisecond}
	_, err := c.Post(r.url+"/v1/chat/completions", "application/json", strings.NewReader(mustJSON(r.t, body)))
	require.Error(r.t, err)
}

// sseText joins the content of every chunk of an SSE answer and reports
// whether it ended with [DONE] and whether it carried an error event.
func sseText(t *testing.T, body []byte) (text string, done, errored bool) {
	t.Helper()
	sc := bufio.NewScanner(bytes.NewReader(body))
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			done = true
			continue
		}
		var ch struct {
			Error   any `json:"error"`
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
				Text string `json:"text"`
			} `json:"choices"`
		}
		require.NoError(t, json.Unmarshal([]byte(data), &ch), data)
		if ch.Error != nil {
			errored = true
		}
		for _, c := range ch.Choices {
			text += c.Delta.Content + c.Text
		}
	}
	return text, done, errored
}

// eventually polls cond until it holds or the deadline passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still not true after 10s: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func image(url string) map[string]any {
	return map[string]any{"type": "image_url", "image_url": map[string]any{"url": url}}
}

func text(s string) map[string]any { return map[string]any{"type": "text", "text": s} }

func chat(stream bool, parts ...map[string]any) map[string]any {
	content := make([]any, len(parts))
	for i, p := range parts {
		content[i] = p
	}
	return map[string]any{"model": "m", "stream": stream, "max_tokens": 16,
		"messages": []any{map[string]any{"role": "system", "content": "be brief"}, map[string]any{"role": "user", "content": content}}}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return string(b)
}

func partID(t *testing.T, part map[string]any) string {
	t.Helper()
	return fakevllm.Identifier("m", json.RawMessage(mustJSON(t, part)))
}

func stringReader(s string) io.Reader { return strings.NewReader(s) }

func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

// portRange is where freePort looks: 10000 to 32000, or the part of it
// ECMOONCAKE_PORT_RANGE ("LOW-HIGH") names, so that test phases running
// side by side (build/test.sh) never pick the same port.
func portRange(t *testing.T) (low, n int) {
	text := os.Getenv("ECMOONCAKE_PORT_RANGE")
	if text == "" {
		return 10000, 22000
	}
	a, b, _ := strings.Cut(text, "-")
	lo, err1 := strconv.Atoi(a)
	hi, err2 := strconv.Atoi(b)
	if err1 != nil || err2 != nil || hi-lo < 100 {
		t.Fatalf("ECMOONCAKE_PORT_RANGE=%q is not LOW-HIGH with 100 ports or more", text)
	}
	return lo, hi - lo
}

// freePort is a port free now, taken from below the kernel's ephemeral
// range (32768 and up on Linux): a port of that range, free when checked,
// may be any process's outgoing connection by the time the test binds it.
func freePort(t *testing.T) int {
	t.Helper()
	low, n := portRange(t)
	for range 200 {
		port := low + rand.IntN(n)
		ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
		if err == nil {
			ln.Close()
			return port
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
