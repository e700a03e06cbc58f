package metadata

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// jsonOf returns a JSON string value of exactly n bytes.
func jsonOf(n int) []byte { return []byte(`"` + strings.Repeat("x", n-2) + `"`) }

func TestDefaultsBoundTheStore(t *testing.T) {
	c, err := Config{Addr: "127.0.0.1:0", Open: true}.withDefaults()
	require.NoError(t, err)
	require.Equal(t, DefaultMaxValueBytes, c.MaxValueBytes)
	require.Equal(t, DefaultMaxKeys, c.MaxKeys)
	require.Equal(t, int64(DefaultMaxTotalBytes), c.MaxTotalBytes)
	require.Equal(t, DefaultMaxConns, c.MaxConns)
	require.Equal(t, DefaultMaxConnsPerPeer, c.MaxConnsPerPeer)
	c, err = Config{Open: true, MaxConns: 8}.withDefaults()
	require.NoError(t, err)
	require.Equal(t, 8, c.MaxConnsPerPeer, "a share is never above the cap")
	for name, bad := range map[string]Config{
		"value above total": {MaxValueBytes: 2 << 20, MaxTotalBytes: 1 << 20},
		"negative keys":     {MaxKeys: -1},
		"negative total":    {MaxTotalBytes: -1},
		"negative value":    {MaxValueBytes: -5},
		"negative conns":    {MaxConns: -1},
		"negative share":    {MaxConnsPerPeer: -1},
	} {
		_, err := bad.withDefaults()
		require.ErrorIs(t, err, ErrInvalid, name)
	}
}

// A value above the cap is refused with 413 before its body is read; the
// store is unchanged and the refusal counted.
func TestValueTooLargeIs413(t *testing.T) {
	s := listen(t, Config{MaxValueBytes: 1024})
	c := newClient(s)
	code, body := c.do(http.MethodPut, "k", jsonOf(4096))
	require.Equal(t, http.StatusRequestEntityTooLarge, code)
	require.Contains(t, string(body), "1024")
	code, _ = c.do(http.MethodPut, "k", jsonOf(1024))
	require.Equal(t, http.StatusOK, code, "exactly the cap fits")
	require.Equal(t, uint64(1), s.Stats().TooLarge)
	require.Equal(t, 1, s.Stats().Keys)
}

// Chunked bodies carry no length up front; the cap holds while reading.
func TestChunkedValueTooLargeIs413(t *testing.T) {
	s := listen(t, Config{MaxValueBytes: 1024})
	conn, err := net.Dial("tcp", s.Addr())
	require.NoError(t, err)
	defer conn.Close()
	chunk := jsonOf(3000)
	fmt.Fprintf(conn, "PUT /metadata?key=k HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n", len(chunk), chunk)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode)
	require.Zero(t, s.Stats().Keys)
}

func TestStoreFullIs507(t *testing.T) {
	t.Run("keys", func(t *testing.T) {
		s := listen(t, Config{MaxKeys: 3})
		c := newClient(s)
		for i := range 3 {
			require.Equal(t, http.StatusOK, c.put(fmt.Sprint("k", i), i))
		}
		code, body := c.do(http.MethodPut, "k3", []byte("3"))
		require.Equal(t, http.StatusInsufficientStorage, code)
		require.Contains(t, string(body), "3 keys")
		require.Equal(t, http.StatusOK, c.put("k1", "overwrite"), "an engine re-publishing its key is never refused for the count")
		require.Equal(t, http.StatusOK, c.del("k0"))
		require.Equal(t, http.StatusOK, c.put("k3", 3), "room again after a delete")
		require.Equal(t, uint64(1), s.Stats().StoreFull)
	})
	t.Run("bytes", func(t *testing.T) {
		s := listen(t, Config{MaxValueBytes: 1000, MaxTotalBytes: 2500})
		c := newClient(s)
		code, _ := c.do(http.MethodPut, "a", jsonOf(1000))
		require.Equal(t, http.StatusOK, code)
		code, _ = c.do(http.MethodPut, "b", jsonOf(1000))
		require.Equal(t, http.StatusOK, code)
		code, body := c.do(http.MethodPut, "c", jsonOf(1000))
		require.Equal(t, http.StatusInsufficientStorage, code)
		require.Contains(t, string(body), "of 2500 bytes")
		code, _ = c.do(http.MethodPut, "a", jsonOf(400))
		require.Equal(t, http.StatusOK, code, "an overwrite that shrinks frees room")
		code, _ = c.do(http.MethodPut, "c", jsonOf(1000))
		require.Equal(t, http.StatusOK, code)
		st := s.Stats()
		require.Equal(t, int64(400+1000+1000+3), st.Bytes, "keys and values")
		require.Equal(t, uint64(1), st.StoreFull)
	})
}

// The report that opened this work: 40 values of 15 MiB grew the store
// to 667 MB. With the defaults it stops at the total cap.
func TestManyLargeValuesStopAtTheTotal(t *testing.T) {
	if testing.Short() {
		t.Skip("moves 256 MiB")
	}
	s := listen(t, Config{})
	c := newClient(s)
	c.http.Timeout = time.Minute // 15 MiB under the race detector on a loaded machine
	value := jsonOf(15 << 20)
	full := 0
	for i := range 40 {
		code, _ := c.do(http.MethodPut, fmt.Sprint("big", i), value)
		if code == http.StatusInsufficientStorage {
			full++
			continue
		}
		require.Equal(t, http.StatusOK, code)
	}
	require.Equal(t, 40-DefaultMaxTotalBytes/(15<<20+5), full)
	require.LessOrEqual(t, s.Stats().Bytes, int64(DefaultMaxTotalBytes))
}

// Without the token a PUT is refused before its body is read: an
// anonymous client cannot make the store buffer megabytes.
func TestUnauthorizedBodyIsNotRead(t *testing.T) {
	s := listen(t, Config{Token: "s3cret", MaxValueBytes: 1 << 20})
	c := newClient(s)
	code, body := c.do(http.MethodPut, "k", jsonOf(64<<10))
	require.Equal(t, http.StatusUnauthorized, code, string(body))
	c.token = "s3cret"
	code, _ = c.do(http.MethodPut, "k", jsonOf(64<<10))
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, uint64(1), s.Stats().Unauthorized)
	require.Zero(t, s.Stats().TooLarge, "an unauthorized request is counted as that, not as too large")
}

func TestRefusalsAreInTheProcessMetrics(t *testing.T) {
	s := listen(t, Config{Token: "s3cret", MaxKeys: 1})
	c := newClient(s)
	require.Equal(t, http.StatusUnauthorized, c.put("k", 1))
	c.token = "s3cret"
	require.Equal(t, http.StatusOK, c.put("k", 1))
	require.Equal(t, http.StatusInsufficientStorage, c.put("k2", 1))
	text, err := metrics.Text(nil)
	require.NoError(t, err)
	object := fmt.Sprintf("metadata:%d", s.ln.Addr().(*net.TCPAddr).Port)
	for _, want := range []string{
		fmt.Sprintf(`ecm_metadata_refusals_total{object=%q,reason="unauthorized"} 1`, object),
		fmt.Sprintf(`ecm_metadata_refusals_total{object=%q,reason="store_full"} 1`, object),
		fmt.Sprintf(`ecm_metadata_keys{object=%q} 1`, object),
		fmt.Sprintf(`ecm_metadata_bytes{object=%q} 2`, object),
	} {
		require.Contains(t, string(text), want)
	}
	require.NoError(t, s.Close())
	text, _ = metrics.Text(nil)
	require.NotContains(t, string(text), object, "a closed store leaves the metrics")
}
