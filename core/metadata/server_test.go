package metadata

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"log/slog"

	"github.com/stretchr/testify/require"
)

// curlEscape is curl_easy_escape: everything but RFC 3986 unreserved
// characters becomes %XX (upper case), space included.
func curlEscape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '.' || c == '_' || c == '~' {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// mooncakeClient sends what Mooncake's HTTP metadata plugin sends: the
// URL-escaped key in the query, JSON bodies with their content type, a
// 3-second timeout, and any status but 200 taken as failure.
type mooncakeClient struct {
	url   string // http://host:port/metadata
	token string
	http  http.Client
}

func newClient(s *Server) *mooncakeClient {
	return &mooncakeClient{url: s.URL(), http: http.Client{Timeout: 3 * time.Second}}
}

func (c *mooncakeClient) do(method, key string, body []byte) (int, []byte) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequest(method, c.url+"?key="+curlEscape(key), rd)
	if err != nil {
		panic(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return -1, []byte(err.Error())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func (c *mooncakeClient) get(key string) (int, []byte) { return c.do(http.MethodGet, key, nil) }
func (c *mooncakeClient) put(key string, v any) int {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	code, _ := c.do(http.MethodPut, key, b)
	return code
}
func (c *mooncakeClient) del(key string) int {
	code, _ := c.do(http.MethodDelete, key, nil)
	return code
}

func listen(t *testing.T, cfg Config) *Server {
	t.Helper()
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:0"
	}
	// Tests of anything but the token run the store open.
	cfg.Open = cfg.Token == ""
	s, err := Listen(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

// The life of a key as engines use it: missing, published, re-published by
// a restarted engine (overwrite, never a refusal), removed, removed again.
func TestKeyLifeAsMooncakeSeesIt(t *testing.T) {
	s := listen(t, Config{})
	c := newClient(s)
	keys := []string{
		"mooncake/rpc_meta/10.0.0.5:15432",
		"mooncake/ram/node a/seg?x=1&y=2+3%",
		"mooncake/cluster-7/ram/[fe80::1]:99",
		"mooncake/ram/ünïcode",
	}
	for _, key := range keys {
		t.Run(key, func(t *testing.T) {
			code, _ := c.get(key)
			require.Equal(t, http.StatusNotFound, code, "a missing key is a 404")

			first := map[string]any{"ip_or_host_name": "10.0.0.5", "rpc_port": 15432}
			require.Equal(t, http.StatusOK, c.put(key, first))
			code, body := c.get(key)
			require.Equal(t, http.StatusOK, code)
			require.JSONEq(t, `{"ip_or_host_name": "10.0.0.5", "rpc_port": 15432}`, string(body))

			require.Equal(t, http.StatusOK, c.put(key, map[string]any{"rpc_port": 1}), "a second PUT overwrites")
			_, body = c.get(key)
			require.JSONEq(t, `{"rpc_port": 1}`, string(body))

			require.Equal(t, http.StatusOK, c.del(key))
			require.Equal(t, http.StatusOK, c.del(key), "deleting a missing key is still 200")
			code, _ = c.get(key)
			require.Equal(t, http.StatusNotFound, code)
		})
	}
	st := s.Stats()
	require.Zero(t, st.Keys)
	require.Zero(t, st.Bytes)
	require.Equal(t, uint64(2*len(keys)), st.Puts)
}

func TestKeysAreDistinctAfterUnescaping(t *testing.T) {
	s := listen(t, Config{})
	c := newClient(s)
	require.Equal(t, http.StatusOK, c.put("a b", 1))
	require.Equal(t, http.StatusOK, c.put("a+b", 2))
	_, one := c.get("a b")
	_, two := c.get("a+b")
	require.Equal(t, "1", string(one))
	require.Equal(t, "2", string(two))
}

func TestRefusals(t *testing.T) {
	s := listen(t, Config{})
	base := "http://" + s.Addr()
	cases := []struct {
		name, method, path, body string
		want                     int
	}{
		{"no key", http.MethodGet, "/metadata", "", http.StatusBadRequest},
		{"empty key", http.MethodGet, "/metadata?key=", "", http.StatusBadRequest},
		{"key too long", http.MethodGet, "/metadata?key=" + strings.Repeat("k", MaxKeyLen+1), "", http.StatusBadRequest},
		{"body not json", http.MethodPut, "/metadata?key=k", "{not json", http.StatusBadRequest},
		{"post", http.MethodPost, "/metadata?key=k", "{}", http.StatusMethodNotAllowed},
		{"unknown path", http.MethodGet, "/kv?key=k", "", http.StatusNotFound},
		{"health", http.MethodGet, "/health", "", http.StatusOK},
		{"health put", http.MethodPut, "/health", "{}", http.StatusMethodNotAllowed},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req, err := http.NewRequest(tc.method, base+tc.path, strings.NewReader(tc.body))
			require.NoError(t, err)
			resp, err := http.DefaultClient.Do(req)
			require.NoError(t, err)
			resp.Body.Close()
			require.Equal(t, tc.want, resp.StatusCode)
		})
	}
	require.Equal(t, uint64(4), s.Stats().BadRequests)
}

func TestTokenGuardsMetadataButNotHealth(t *testing.T) {
	s := listen(t, Config{Token: "s3cret"})
	c := newClient(s)
	require.Equal(t, http.StatusUnauthorized, c.put("k", 1))
	c.token = "wrong"
	require.Equal(t, http.StatusUnauthorized, c.put("k", 1))
	c.token = "s3cret"
	require.Equal(t, http.StatusOK, c.put("k", 1))
	resp, err := http.Get("http://" + s.Addr() + "/health")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, uint64(2), s.Stats().Unauthorized)
}

func TestEnsureUsesTheStoreAlreadyServing(t *testing.T) {
	s := listen(t, Config{})
	again, err := Ensure(Config{Addr: s.Addr(), Open: true})
	require.NoError(t, err)
	require.Nil(t, again, "the second shard owns nothing")

	// A port held by something that is not a store is an error.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			conn.Close()
		}
	}()
	_, err = Ensure(Config{Addr: ln.Addr().String(), Open: true})
	require.ErrorContains(t, err, "not a metadata store")
}

func TestConcurrentClients(t *testing.T) {
	s := listen(t, Config{})
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := newClient(s)
			for i := 0; i < 25; i++ {
				key := fmt.Sprintf("mooncake/ram/seg-%d-%d", g, i)
				if c.put(key, map[string]int{"i": i}) != http.StatusOK {
					t.Errorf("put %s failed", key)
					return
				}
				if code, _ := c.get(key); code != http.StatusOK {
					t.Errorf("get %s: %d", key, code)
				}
			}
		}()
	}
	wg.Wait()
	require.Equal(t, 200, s.Stats().Keys)
}

func TestCloseIsIdempotentAndFreesThePort(t *testing.T) {
	s, err := Listen(Config{Addr: "127.0.0.1:0", Open: true})
	require.NoError(t, err)
	addr := s.Addr()
	require.NoError(t, s.Close())
	require.NoError(t, s.Close())
	again, err := Listen(Config{Addr: addr, Open: true})
	require.NoError(t, err)
	require.NoError(t, again.Close())
}

// Whoever can PUT into the store rewrites the segment descriptors engines
// connect to, so by default it does not start without a token; serving
// open is a choice, and a loud one.
func TestStoreRequiresATokenUnlessToldToServeOpen(t *testing.T) {
	_, err := Listen(Config{Addr: "127.0.0.1:0", Logger: quiet()})
	require.ErrorIs(t, err, ErrInvalid)
	require.ErrorContains(t, err, "MC_METADATA_HTTP_TOKEN")
	require.ErrorContains(t, err, "open")
	_, err = Ensure(Config{Addr: "127.0.0.1:0", Logger: quiet()})
	require.ErrorIs(t, err, ErrInvalid, "a shard's own store is held to the same default")

	var logged bytes.Buffer
	s, err := Listen(Config{Addr: "127.0.0.1:0", Open: true, Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	require.NoError(t, err)
	defer s.Close()
	require.Contains(t, logged.String(), "level=WARN")
	require.Contains(t, logged.String(), "without a token")
	require.Equal(t, http.StatusOK, newClient(s).put("k", 1), "open means open")

	_, err = Listen(Config{Addr: "127.0.0.1:0", Token: "s3cret", Open: true, Logger: quiet()})
	require.ErrorIs(t, err, ErrInvalid, "a token and open at once is a mistake")
}

// Go's http.Transport dials a connection for a waiting request and, when
// another connection frees up first, parks the new one unused; fasthttp's
// Shutdown counts a connection that has not sent a request as busy for its
// first five seconds. Close must end such a connection, not wait for it
// or report it: a shard closing its store would otherwise fail its close.
func TestCloseEndsConnectionsThatNeverSentARequest(t *testing.T) {
	s, err := Listen(Config{Addr: "127.0.0.1:0", Open: true, Logger: quiet(), closeGrace: 100 * time.Millisecond})
	require.NoError(t, err)
	idle, err := net.Dial("tcp", s.Addr())
	require.NoError(t, err)
	defer idle.Close()
	// A request on a connection of its own, dialed after the idle one, is
	// answered only after the idle one was accepted.
	code, _ := newClient(s).get("mooncake/ram/x")
	require.Equal(t, http.StatusNotFound, code)

	require.NoError(t, s.Close())
	require.NoError(t, idle.SetReadDeadline(time.Now().Add(time.Minute)))
	_, err = idle.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF, "the store closed the connection that never sent a request")
}
