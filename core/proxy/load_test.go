package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// loadSize is the number of requests per mode and the concurrency
// (ECM_LOAD_REQUESTS, ECM_LOAD_CONCURRENCY override them). The race
// detector slows everything about tenfold, so CI runs fewer: 300, which
// under a 2-CPU hog at load 50 still takes about two minutes for the four
// modes (1,000 did not finish in four).
func loadSize() (n, conc int) {
	n, conc = 5000, 64
	if raceEnabled {
		n = 300
	}
	if v, err := strconv.Atoi(os.Getenv("ECM_LOAD_REQUESTS")); err == nil && v > 0 {
		n = v
	}
	if v, err := strconv.Atoi(os.Getenv("ECM_LOAD_CONCURRENCY")); err == nil && v > 0 {
		conc = v
	}
	return n, conc
}

// TestLoad sends the same streamed requests through the proxy and straight
// to the backends, in one run, and checks that no request is lost. It
// reports the proxy's added latency at p50 and p99 as a ratio to the
// direct path: for text-only requests the direct path is one call to the
// PD instance; for one-image requests it is what a client would do without
// the proxy, an encoder call and then a PD call.
func TestLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("load test")
	}
	n, conc := loadSize()
	r := newRig(t, rigOpts{encoders: 1, pds: 1, mut: func(c *Config) { c.HealthIntervalS = 1 }})
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: conc, MaxConnsPerHost: conc}}
	pd, enc := r.pd[0].URL(), r.enc[0].URL()
	textReq := mustJSON(t, chat(true, text("hello")))
	imgPart := image("http://img/load.png")
	imgReq := mustJSON(t, chat(true, text("what is this?"), imgPart))
	id := partID(t, imgPart)

	directText := func(int) error { return streamOnce(client, pd, textReq, "fake answer with 0 embeds and 0 media parts") }
	proxyText := func(int) error {
		return streamOnce(client, r.url, textReq, "fake answer with 0 embeds and 0 media parts")
	}
	directImage := func(i int) error {
		tid := fmt.Sprintf("direct-%d", i)
		encBody := mustJSON(t, map[string]any{"model": "m", "max_tokens": 1, "stream": false,
			"messages":           []any{map[string]any{"role": "user", "content": []any{imgPart}}},
			"ec_transfer_params": map[string]any{"consumer": "tcp://127.0.0.1:14579", "ec_items": []any{map[string]any{"transfer_id": tid}}}})
		if err := postOnce(client, enc, encBody); err != nil {
			return err
		}
		pdReq := mustJSON(t, map[string]any{"model": "m", "stream": true, "max_tokens": 16,
			"messages":           []any{map[string]any{"role": "user", "content": []any{text("what is this?"), map[string]any{"type": "image_embeds", "image_embeds": map[string]any{"image_grid_thw": []int{1, 8, 8}}, "uuid": id}}}},
			"ec_transfer_params": map[string]any{"ec_items": []any{map[string]any{"mm_hash": id, "transfer_id": tid}}}})
		return streamOnce(client, pd, pdReq, "fake answer with 1 embeds and 0 media parts")
	}
	proxyImage := func(int) error {
		return streamOnce(client, r.url, imgReq, "fake answer with 1 embeds and 0 media parts")
	}

	// A bound on a hung run, not a speed check: far above what the four
	// modes take on a loaded machine, and below the package's go test
	// -timeout.
	deadline := time.Now().Add(12 * time.Minute)
	results := map[string][]time.Duration{}
	for _, mode := range []struct {
		name string
		f    func(int) error
	}{{"direct text", directText}, {"proxy text", proxyText}, {"direct image", directImage}, {"proxy image", proxyImage}} {
		_, err := hammer(200, conc, mode.f, deadline) // warm connections and code paths
		require.NoError(t, err, mode.name)
		lat, err := hammer(n, conc, mode.f, deadline)
		require.NoError(t, err, mode.name)
		require.Len(t, lat, n, "%s: every request answered", mode.name)
		results[mode.name] = lat
	}
	report := func(kind string) {
		d, p := results["direct "+kind], results["proxy "+kind]
		d50, d99, p50, p99 := pct(d, 50), pct(d, 99), pct(p, 50), pct(p, 99)
		t.Logf("%-5s n=%d c=%d  direct p50 %v p99 %v | proxy p50 %v p99 %v | added p50 %v p99 %v | ratio p50 %.2f p99 %.2f",
			kind, n, conc, d50, d99, p50, p99, p50-d50, p99-d99, float64(p50)/float64(d50), float64(p99)/float64(d99))
	}
	report("text")
	report("image")
	stats := r.p.Stats()
	require.Equal(t, uint64(2*(n+200)), stats.Served, "the proxy answered every request it got")
}

// hammer runs n calls of f with conc workers and returns each latency.
func hammer(n, conc int, f func(int) error, deadline time.Time) ([]time.Duration, error) {
	var next atomic.Int64
	var mu sync.Mutex
	var lat []time.Duration
	var firstErr error
	var wg sync.WaitGroup
	for w := 0; w < conc; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n || time.Now().After(deadline) {
					return
				}
				t0 := time.Now()
				err := f(i)
				d := time.Since(t0)
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = fmt.Errorf("request %d: %w", i, err)
				}
				if err == nil {
					lat = append(lat, d)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if firstErr == nil && len(lat) < n {
		firstErr = fmt.Errorf("deadline passed after %d of %d requests", len(lat), n)
	}
	return lat, firstErr
}

func pct(d []time.Duration, p int) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[(len(s)-1)*p/100]
}

// chatOnce sends one chat request and returns the whole answer, an error
// unless its status is 200.
func chatOnce(c *http.Client, base, body string) ([]byte, error) {
	resp, err := c.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader([]byte(body)))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != 200 {
		return nil, fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	return b, nil
}

func postOnce(c *http.Client, base, body string) error {
	_, err := chatOnce(c, base, body)
	return err
}

// streamOnce sends one streamed request and checks the whole answer.
func streamOnce(c *http.Client, base, body, want string) error {
	b, err := chatOnce(c, base, body)
	if err != nil {
		return err
	}
	got, done := "", false
	for _, line := range bytes.Split(b, []byte("\n")) {
		data, ok := bytes.CutPrefix(line, []byte("data: "))
		if !ok {
			continue
		}
		if string(data) == "[DONE]" {
			done = true
			continue
		}
		var ch struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(data, &ch); err != nil {
			return fmt.Errorf("bad event %q: %w", data, err)
		}
		for _, c := range ch.Choices {
			got += c.Delta.Content
		}
	}
	if !done || got != want {
		return fmt.Errorf("incomplete answer: done=%v text=%q", done, got)
	}
	return nil
}
