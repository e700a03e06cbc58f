package proxy

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/proxy/fakevllm"
)

// barrier holds the first n callers until all n have arrived, so that n
// concurrent requests really hold n backend connections at once; later
// callers pass at once.
func barrier(n int) func(ctx context.Context) error {
	var mu sync.Mutex
	arrived := 0
	all := make(chan struct{})
	return func(ctx context.Context) error {
		mu.Lock()
		arrived++
		if arrived == n {
			close(all)
		}
		mu.Unlock()
		t := time.NewTimer(10 * time.Second)
		defer t.Stop()
		select {
		case <-all:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			return fmt.Errorf("barrier: %d of %d callers after 10s", arrived, n)
		}
	}
}

// proxySeries returns the proxy's own series from its /metrics.
func proxySeries(t *testing.T, base string) string {
	t.Helper()
	var b strings.Builder
	for line := range strings.Lines(metricsText(t, base)) {
		if strings.HasPrefix(line, "ecm_proxy_") && !strings.Contains(line, "_seconds_") {
			b.WriteString(line)
		}
	}
	return b.String()
}

// The operator's reproduction, scaled down: vLLM closes a connection idle
// for its keep-alive (5 s; 300 ms here), 6 concurrent requests leave 6
// idle connections to each backend, the fleet idles past the keep-alive,
// then 3 more requests come (and 3 streamed ones). Not one item may fall
// back and no backend may be dropped, whether the proxy's idle timeout is
// below the backend's (connections expire first) or above it (the close
// is seen before the connection is reused). A backend that closes a
// connection just as a request goes out on it (dropReused: every request
// after a connection's first is dropped unanswered) must cost a retry on
// a fresh connection, never a fallback or a failure counted against it.
func TestIdlePauseNeverReachesADeadConnection(t *testing.T) {
	cases := []struct {
		name       string
		keepAlive  time.Duration // the backends' idle close; 0: none
		idle       float64       // the proxy's upstream_idle_timeout_s
		dropReused bool
	}{
		{"proxy idle timeout below the backend's keep-alive", 300 * time.Millisecond, 0.1, false},
		{"proxy idle timeout above the backend's keep-alive", 300 * time.Millisecond, 30, false},
		{"backend closes as the request goes out", 0, 30, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fc := fakevllm.Config{KeepAlive: tc.keepAlive, DropReused: tc.dropReused}
			encBarrier, pdBarrier := barrier(6), barrier(6)
			fc.OnEncode = func(ctx context.Context, _ fakevllm.Encode) error { return encBarrier(ctx) }
			fc.BeforeAnswer = func(ctx context.Context, _ []fakevllm.ECItem) error { return pdBarrier(ctx) }
			r := newRig(t, rigOpts{encoders: 1, pds: 1, fake: fc, mut: func(c *Config) {
				// No health check keeps a connection warm: every idle
				// connection ages alike.
				c.HealthIntervalS = 3600
				c.FailThreshold = 3
				c.UpstreamIdleTimeoutS = tc.idle
			}})
			burst := func(n int, stream bool) {
				var wg sync.WaitGroup
				errs := make(chan error, n)
				for i := range n {
					wg.Add(1)
					go func() {
						defer wg.Done()
						resp, err := r.httpc.Post(r.url+"/v1/chat/completions", "application/json",
							strings.NewReader(mustJSON(t, chat(stream, text("describe"), image(fmt.Sprintf("http://img/%d-%v.png", i, stream))))))
						if err != nil {
							errs <- err
							return
						}
						body := readAll(t, resp)
						if resp.StatusCode != 200 {
							errs <- fmt.Errorf("status %d: %s", resp.StatusCode, body)
						}
					}()
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					require.NoError(t, err)
				}
			}
			burst(6, false)
			for _, s := range append(append([]*fakevllm.Server(nil), r.enc...), r.pd...) {
				opened, _ := s.Conns()
				require.GreaterOrEqual(t, opened, int64(6), "the burst holds 6 connections to each backend at once")
				if tc.keepAlive == 0 {
					continue
				}
				eventually(t, "every idle connection closed (by the backend or the proxy)", func() bool {
					o, c := s.Conns()
					return o == c
				})
			}
			burst(3, false)
			burst(3, true)

			m := proxySeries(t, r.url)
			require.NotContains(t, m, `ecm_proxy_media_items_total{outcome="fallback"}`)
			require.Contains(t, m, `ecm_proxy_media_items_total{outcome="encoded"} 12`)
			require.NotContains(t, m, `ecm_proxy_retries_total`, "no consumer attempt failed")
			for role, list := range r.p.Stats().Backends {
				for _, b := range list {
					require.True(t, b.Healthy, "%s %s dropped: %s", role, b.URL, b.LastErr)
					require.Zero(t, b.Fails, "%s %s: %s", role, b.URL, b.LastErr)
				}
			}
			if tc.dropReused {
				// The pooled connections failed, and fresh ones answered.
				require.Regexp(t, `ecm_proxy_upstream_redials_total\{role="encode"\} [1-9]`, m)
				require.Regexp(t, `ecm_proxy_upstream_redials_total\{role="pd"\} [1-9]`, m)
			}
		})
	}
}

// Health checks are counted by role and outcome, so an operator sees a
// backend failing its checks before it is dropped.
func TestHealthChecksAreCounted(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1})
	r.pd[0].SetHealthy(false)
	eventually(t, "a failed check of the pd and a passed one of the encoder counted", func() bool {
		m := proxySeries(t, r.url)
		return strings.Contains(m, `ecm_proxy_health_checks_total{outcome="failed",role="pd"}`) &&
			strings.Contains(m, `ecm_proxy_health_checks_total{outcome="ok",role="encode"}`)
	})
	eventually(t, "the pd dropped after its failed checks", func() bool { return !r.p.Stats().Backends["pd"][0].Healthy })
	r.pd[0].SetHealthy(true)
	eventually(t, "a passed check of the pd counted", func() bool {
		return strings.Contains(proxySeries(t, r.url), `ecm_proxy_health_checks_total{outcome="ok",role="pd"}`)
	})
}
