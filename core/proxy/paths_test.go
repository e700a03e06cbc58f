package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/discovery"
	"github.com/ecmooncake/ecmooncake/core/proxy/fakevllm"
)

type pdBody struct {
	Messages []struct {
		Content json.RawMessage `json:"content"`
	} `json:"messages"`
	Params *struct {
		Items []fakevllm.ECItem `json:"ec_items"`
	} `json:"ec_transfer_params"`
}

func decodePD(t *testing.T, c fakevllm.Call) pdBody {
	t.Helper()
	var b pdBody
	require.NoError(t, json.Unmarshal(c.Body, &b))
	return b
}

func partTypes(t *testing.T, b pdBody) []string {
	t.Helper()
	var parts []struct {
		Type string `json:"type"`
	}
	require.NoError(t, json.Unmarshal(b.Messages[1].Content, &parts))
	var out []string
	for _, p := range parts {
		out = append(out, p.Type)
	}
	return out
}

// An item the encoder could not serve is sent as media; the others still
// go as embeds.
func TestFallbackToMedia(t *testing.T) {
	cases := []struct {
		name   string
		setup  func(r *rig)
		images int
		want   []string
	}{
		{"encoder answers 503", func(r *rig) { r.enc[0].Inject(fakevllm.Status503) }, 1, []string{"image_url"}},
		{"encoder is not a producer", func(r *rig) { r.enc[0].Inject(fakevllm.NoParams) }, 1, []string{"image_url"}},
		{"encoder drops the connection", func(r *rig) { r.enc[0].Inject(fakevllm.Drop) }, 1, []string{"image_url"}},
		{"encoder is down", func(r *rig) { r.enc[0].Stop() }, 2, []string{"image_url", "image_url"}},
		{"one of two items fails", func(r *rig) { r.enc[0].Inject(fakevllm.Status503) }, 2, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, rigOpts{encoders: 1, pds: 1})
			tc.setup(r)
			var parts []map[string]any
			for i := 0; i < tc.images; i++ {
				parts = append(parts, image(fmt.Sprintf("http://img/%d.png", i)))
			}
			code, body := r.post("/v1/chat/completions", chat(false, parts...))
			require.Equal(t, 200, code, string(body))
			b := decodePD(t, r.pd[0].Calls()[0])
			got := partTypes(t, b)
			if tc.want != nil {
				require.Equal(t, tc.want, got)
				require.Nil(t, b.Params, "nothing encoded: the body goes unchanged")
				return
			}
			require.ElementsMatch(t, []string{"image_url", "image_embeds"}, got)
			require.Len(t, b.Params.Items, 1)
		})
	}
}

// A consumer failure before the first byte is retried with fresh transfer
// ids; a client error is not; the last attempt's failure reaches the client.
func TestRetries(t *testing.T) {
	cases := []struct {
		name     string
		stream   bool
		faults   []fakevllm.Fault
		wantCode int
		wantPD   int // consumer calls
		clean    bool
	}{
		{"503 then ok", false, []fakevllm.Fault{fakevllm.Status503}, 200, 2, true},
		{"stream error before the first token, then ok", true, []fakevllm.Fault{fakevllm.StreamError}, 200, 2, true},
		{"dropped connection, then ok", true, []fakevllm.Fault{fakevllm.Drop}, 200, 2, true},
		{"two failures, then ok", true, []fakevllm.Fault{fakevllm.Status503, fakevllm.StreamError}, 200, 3, true},
		{"retries exhausted: 503 reaches the client", false, []fakevllm.Fault{fakevllm.Status503, fakevllm.Status503, fakevllm.Status503}, 503, 3, false},
		{"retries exhausted: the stream error reaches the client", true, []fakevllm.Fault{fakevllm.StreamError, fakevllm.StreamError, fakevllm.StreamError}, 200, 3, false},
		{"400 is not retried", false, []fakevllm.Fault{fakevllm.Status400}, 400, 1, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, rigOpts{encoders: 1, pds: 1})
			r.pd[0].Inject(tc.faults...)
			code, body := r.post("/v1/chat/completions", chat(tc.stream, text("hi"), image("http://img/1.png")))
			require.Equal(t, tc.wantCode, code, string(body))
			calls := r.pd[0].Calls()
			require.Len(t, calls, tc.wantPD)
			require.Len(t, r.enc[0].Calls(), tc.wantPD, "every attempt encodes again")
			seen := map[string]bool{}
			for _, c := range calls {
				b := decodePD(t, c)
				require.Len(t, b.Params.Items, 1)
				tid := b.Params.Items[0].TransferID
				require.False(t, seen[tid], "transfer id %s reused across attempts", tid)
				seen[tid] = true
			}
			if tc.stream && tc.wantCode == 200 {
				txt, done, errored := sseText(t, body)
				require.True(t, done)
				require.Equal(t, !tc.clean, errored, "an error event reaches the client only when retries ran out")
				if tc.clean {
					require.Equal(t, "fake answer with 1 embeds and 0 media parts", txt)
				}
			}
		})
	}
}

// A retry goes to another consumer when there is one.
func TestRetryMovesToAnotherConsumer(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 2})
	r.pd[0].Inject(fakevllm.Status503)
	r.pd[1].Inject(fakevllm.Status503)
	code, body := r.post("/v1/chat/completions", chat(false, image("http://img/1.png")))
	require.Equal(t, 200, code, string(body))
	first, second := len(r.pd[0].Calls()), len(r.pd[1].Calls())
	require.Equal(t, 3, first+second)
	require.True(t, first >= 1 && second >= 1, "the second attempt went to the other instance (%d, %d)", first, second)
	require.Equal(t, int64(1), r.pd[0].Served()+r.pd[1].Served())
}

func TestBackendDownAndBack(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 2})
	healthy := func(i int) bool {
		for _, b := range r.p.Stats().Backends[discovery.RolePD] {
			if b.URL == r.pd[i].URL() {
				return b.Healthy
			}
		}
		return false
	}
	r.pd[0].Stop()
	for i := 0; i < 10; i++ {
		code, body := r.post("/v1/chat/completions", chat(true, image(fmt.Sprintf("http://img/%d.png", i))))
		require.Equal(t, 200, code, string(body))
		_, done, errored := sseText(t, body)
		require.True(t, done)
		require.False(t, errored)
	}
	eventually(t, "the stopped PD instance is dropped", func() bool { return !healthy(0) })
	served := r.pd[1].Served()
	require.Equal(t, int64(10), served, "every request was served by the instance still up")

	require.NoError(t, r.pd[0].Restart())
	eventually(t, "the restarted PD instance is re-admitted", func() bool { return healthy(0) })
	for i := 0; i < 10; i++ {
		code, _ := r.post("/v1/chat/completions", chat(false, image("http://img/x.png")))
		require.Equal(t, 200, code)
	}
	require.Positive(t, r.pd[0].Served(), "traffic returns to the re-admitted instance")

	// An unhealthy /health drops an instance that still accepts connections.
	r.pd[1].SetHealthy(false)
	eventually(t, "a PD instance whose /health fails is dropped", func() bool { return !healthy(1) })
	r.pd[1].SetHealthy(true)
	eventually(t, "and re-admitted when it passes", func() bool { return healthy(1) })
}

func TestNoHealthyConsumer(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1})
	r.pd[0].SetHealthy(false)
	eventually(t, "the proxy reports itself unhealthy", func() bool {
		resp, err := http.Get(r.url + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 503
	})
	code, body := r.post("/v1/chat/completions", chat(false, text("hi")))
	require.Equal(t, 503, code, string(body))
	require.Contains(t, string(body), "no healthy pd instance")
}

// A client that goes away cancels the backend call it was waiting on.
func TestClientDisconnectCancelsUpstream(t *testing.T) {
	t.Run("while the consumer streams", func(t *testing.T) {
		r := newRig(t, rigOpts{encoders: 1, pds: 1, fake: fakevllm.Config{Tokens: 200, TokenDelay: 20 * time.Millisecond}})
		ctx, cancel := context.WithCancel(context.Background())
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.url+"/v1/chat/completions", strings.NewReader(mustJSON(t, chat(true, image("http://img/1.png")))))
		require.NoError(t, err)
		resp, err := r.httpc.Do(req)
		require.NoError(t, err)
		line, err := bufio.NewReader(resp.Body).ReadString('\n')
		require.NoError(t, err)
		require.True(t, strings.HasPrefix(line, "data: "))
		cancel()
		resp.Body.Close()
		eventually(t, "the PD instance sees its request cancelled", func() bool { return r.pd[0].Cancelled() == 1 })
		require.Zero(t, r.pd[0].Served())
	})
	t.Run("while the consumer has not answered", func(t *testing.T) {
		r := newRig(t, rigOpts{encoders: 1, pds: 1})
		r.pd[0].Inject(fakevllm.Hang)
		r.abandon(chat(false, text("hi")))
		eventually(t, "the PD instance sees its request cancelled", func() bool { return r.pd[0].Cancelled() == 1 })
	})
	t.Run("while the encoder works", func(t *testing.T) {
		r := newRig(t, rigOpts{encoders: 1, pds: 1})
		r.enc[0].Inject(fakevllm.Hang)
		r.abandon(chat(false, image("http://img/1.png")))
		eventually(t, "the encoder sees its request cancelled", func() bool { return r.enc[0].Cancelled() == 1 })
		eventually(t, "no consumer call follows", func() bool { return r.p.served.Load() == 1 })
		require.Empty(t, r.pd[0].Calls())
	})
}

// Consumers that register themselves need no static list; the proxy
// spreads requests over their DP ranks and derives each rank's endpoint.
func TestDiscovery(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 0, mut: func(c *Config) { c.RegisterToken = testToken }})
	pd := startFake(t, fakevllm.RolePD, fakevllm.Config{})
	code, _ := r.post("/v1/chat/completions", chat(false, text("hi")))
	require.Equal(t, 503, code, "nothing registered yet")

	reg, err := discovery.Start(discovery.RegistrarConfig{
		Proxies:      []string{r.url},
		Registration: discovery.Registration{Role: discovery.RolePD, URL: pd.URL(), Consumer: "tcp://127.0.0.1:15000", TPSize: 2, DPSize: 2, Host: "node-a", TTLS: 1},
		IntervalS:    0.1,
		Token:        testToken,
	}, nil)
	require.NoError(t, err)
	eventually(t, "the instance registers", func() bool { return len(r.p.Stats().Backends[discovery.RolePD]) == 1 })
	for i := 0; i < 4; i++ {
		code, body := r.post("/v1/chat/completions", chat(false, image("http://img/1.png")))
		require.Equal(t, 200, code, string(body))
	}
	var ranks []string
	for _, c := range pd.Calls() {
		ranks = append(ranks, c.DPRank)
	}
	require.ElementsMatch(t, []string{"0", "0", "1", "1"}, ranks, "sequential requests alternate DP ranks")
	consumers := map[string]bool{}
	for _, c := range r.enc[0].Calls() {
		var b struct {
			P struct {
				Consumer string `json:"consumer"`
			} `json:"ec_transfer_params"`
		}
		require.NoError(t, json.Unmarshal(c.Body, &b))
		consumers[b.P.Consumer] = true
	}
	require.Equal(t, map[string]bool{"tcp://127.0.0.1:15000": true, "tcp://127.0.0.1:15002": true}, consumers, "rank r listens at ec_port + r*tp_size")
	require.Positive(t, reg.Stats().Beats)

	require.NoError(t, reg.Close())
	require.Empty(t, r.p.Stats().Backends[discovery.RolePD], "deregistered on close")

	// An instance that stops its heartbeat lapses after its TTL.
	code, body := adminCall(t, r.url, discovery.RegisterPath, testToken, discovery.Registration{Role: discovery.RolePD, URL: pd.URL(), Consumer: "tcp://127.0.0.1:15000", TTLS: 0.2})
	require.Equal(t, 200, code, body)
	require.Len(t, r.p.Stats().Backends[discovery.RolePD], 1)
	eventually(t, "the registration lapses", func() bool { return len(r.p.Stats().Backends[discovery.RolePD]) == 0 })

	for name, body := range map[string]string{
		"unknown role":      `{"role": "router", "url": "http://h:1"}`,
		"consumer missing":  `{"role": "pd", "url": "http://h:1"}`,
		"unknown key":       `{"role": "encode", "url": "http://h:1", "colour": "red"}`,
		"https":             `{"role": "encode", "url": "https://h:1"}`,
		"bad consumer port": `{"role": "pd", "url": "http://h:1", "consumer": "tcp://h:99999"}`,
	} {
		code, _ := adminCall(t, r.url, discovery.RegisterPath, testToken, json.RawMessage(body))
		require.Equal(t, 400, code, name)
	}
}

func TestSplitPrefillDecode(t *testing.T) {
	var prefill, decode *fakevllm.Server
	r := newRig(t, rigOpts{encoders: 1, mut: func(c *Config) {
		var err error
		prefill, err = fakevllm.Start(fakevllm.Config{Role: fakevllm.RolePD})
		require.NoError(t, err)
		decode, err = fakevllm.Start(fakevllm.Config{Role: fakevllm.RolePD})
		require.NoError(t, err)
		c.Prefill, c.Decode = []string{prefill.URL()}, []string{decode.URL()}
	}})
	t.Cleanup(prefill.Close)
	t.Cleanup(decode.Close)
	code, body := r.post("/v1/chat/completions", chat(true, image("http://img/1.png")))
	require.Equal(t, 200, code, string(body))
	txt, done, _ := sseText(t, body)
	require.True(t, done)
	require.Equal(t, "fake answer with 1 embeds and 0 media parts", txt)

	var pre map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(prefill.Calls()[0].Body, &pre))
	require.JSONEq(t, `false`, string(pre["stream"]))
	require.JSONEq(t, `1`, string(pre["max_tokens"]))
	require.Contains(t, string(pre["kv_transfer_params"]), `"do_remote_decode":true`)
	require.Contains(t, string(pre["ec_transfer_params"]), `"ec_items"`)

	var dec map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(decode.Calls()[0].Body, &dec))
	require.NotContains(t, dec, "ec_transfer_params")
	require.JSONEq(t, `true`, string(dec["stream"]))
	require.JSONEq(t, `{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"fake-prefill","remote_block_ids":[1,2,3],"remote_host":"127.0.0.1","remote_port":5600}`, string(dec["kv_transfer_params"]))
	require.Contains(t, string(dec["messages"]), `"image_embeds"`)
}

// An encoder that reports no modality (vLLM 0.32) still serves every item:
// the proxy takes the modality from the part it sent, counts it, and
// nothing falls back to the consumer's own encoder.
func TestEncoderWithoutModality(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1, fake: fakevllm.Config{OmitModality: true}})
	code, body := r.post("/v1/chat/completions", chat(false, image("http://img/1.png"), image("http://img/2.png")))
	require.Equal(t, 200, code, string(body))
	b := decodePD(t, r.pd[0].Calls()[0])
	require.Equal(t, []string{"image_embeds", "image_embeds"}, partTypes(t, b))
	require.Len(t, b.Params.Items, 2)
	resp, err := http.Get(r.url + "/metrics")
	require.NoError(t, err)
	m := readAll(t, resp)
	require.Contains(t, m, `ecm_proxy_media_items_total{outcome="encoded"} 2`)
	require.NotContains(t, m, `ecm_proxy_media_items_total{outcome="fallback"}`)
	require.Contains(t, m, `ecm_proxy_derived_fields_total{field="modality"} 2`)
}

func TestMetricsAndBackendsEndpoints(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1, mut: func(c *Config) { c.MetricsPort = freePort(t); c.RegisterToken = testToken }})
	r.pd[0].Inject(fakevllm.Status503)
	code, _ := r.post("/v1/chat/completions", chat(false, image("http://img/1.png"), image("http://img/1.png")))
	require.Equal(t, 200, code)
	for _, base := range []string{r.url, "http://" + r.p.MetricsAddr()} {
		resp, err := http.Get(base + "/metrics")
		require.NoError(t, err)
		b := readAll(t, resp)
		for _, want := range []string{
			`ecm_proxy_requests_total{outcome="ok",route="chat"} 1`,
			`ecm_proxy_retries_total{reason="status_503"} 1`,
			`ecm_proxy_media_items_total{outcome="duplicate"} 2`,
			`ecm_proxy_media_items_total{outcome="encoded"} 2`,
			`ecm_proxy_phase_seconds_count{phase="encode"} 2`,
			`ecm_proxy_phase_seconds_count{phase="transfer_wait"} 2`,
			`ecm_proxy_phase_seconds_count{phase="pd"} 1`,
			fmt.Sprintf(`ecm_proxy_backend_healthy{role="pd",url="%s"} 1`, r.pd[0].URL()),
			`go_goroutines`,
		} {
			require.Contains(t, b, want, base)
		}
	}
	code, list := adminGet(t, r.url+discovery.BackendsPath, testToken)
	require.Equal(t, http.StatusOK, code, list)
	var backends map[string][]BackendInfo
	require.NoError(t, json.Unmarshal([]byte(list), &backends))
	require.Len(t, backends[discovery.RolePD], 1)
	require.True(t, backends[discovery.RolePD][0].Static)
	resp, err := http.Get(r.url + "/v1/models")
	require.NoError(t, err)
	require.Contains(t, readAll(t, resp), `"fake-model"`)
}

// A transfer id is a grant's name at every shard, so a client must not be
// able to derive one: the request id it gets back (X-Request-Id) and the
// order of its requests tell it nothing about the ids the proxy minted.
func TestTransferIDsCannotBeGuessedFromWhatAClientSees(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1})
	b, err := json.Marshal(chat(false, image("http://img/1.png"), image("http://img/2.png")))
	require.NoError(t, err)
	var visible []string
	for i := 0; i < 2; i++ {
		resp, err := r.httpc.Post(r.url+"/v1/chat/completions", "application/json", bytes.NewReader(b))
		require.NoError(t, err)
		_, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, 200, resp.StatusCode)
		visible = append(visible, resp.Header.Get(headerRequestID))
	}
	var tids []string
	for _, c := range r.pd[0].Calls() {
		for _, it := range decodePD(t, c).Params.Items {
			tids = append(tids, it.TransferID)
		}
	}
	require.Len(t, tids, 4)
	for _, tid := range tids {
		for _, v := range visible {
			require.NotEmpty(t, v)
			require.NotContains(t, tid, v, "transfer id %s contains the request id %s the client was told", tid, v)
		}
	}
	// Whatever the format, at least 128 bits of it come from crypto/rand:
	// two ids of one request share no 32-hex-digit run.
	require.Regexp(t, `[0-9a-f]{32}`, tids[0])
	require.NotEqual(t, regexp.MustCompile(`[0-9a-f]{32}`).FindString(tids[0]), regexp.MustCompile(`[0-9a-f]{32}`).FindString(tids[1]))
}

// A client that has read a streamed answer through its [DONE] event has
// its whole answer: if it then closes the connection while the PD
// instance has not yet ended the response, the request was answered, not
// cancelled, and the proxy's counts must say so (they are what an
// operator compares with the client's).
func TestAStreamReadToItsEndIsAnsweredNotCancelled(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1, mut: func(c *Config) { c.MetricsPort = freePort(t) }, fake: fakevllm.Config{AfterDone: 3 * time.Second}})
	b, err := json.Marshal(chat(true, image("http://img/1.png")))
	require.NoError(t, err)
	resp, err := r.httpc.Post(r.url+"/v1/chat/completions", "application/json", bytes.NewReader(b))
	require.NoError(t, err)
	rd := bufio.NewReader(resp.Body)
	for {
		line, err := rd.ReadString('\n')
		require.NoError(t, err, "the stream ended before its [DONE]")
		if strings.TrimSpace(line) == "data: [DONE]" {
			break
		}
	}
	resp.Body.Close()
	r.httpc.CloseIdleConnections()
	metricsURL := "http://" + r.p.MetricsAddr()
	require.Eventually(t, func() bool {
		return strings.Contains(metricsText(t, metricsURL), `ecm_proxy_requests_total{outcome=`)
	}, 30*time.Second, 10*time.Millisecond, "the request is counted")
	m := metricsText(t, metricsURL)
	require.Contains(t, m, `ecm_proxy_requests_total{outcome="ok",route="chat"} 1`)
	require.NotContains(t, m, `outcome="cancelled"`)
}

// A PD instance of vLLM < 0.30 takes no embeddings-only request (its
// frontend refuses embeds without tensors, and before 0.30 nothing turns
// --enable-mm-embeds on for a consumer) and cannot fail a request whose
// push never comes (no take_unavailable_requests), so it gets the media
// with the transfer parameters: it loads what arrives and encodes what
// does not. The proxy learns the version from the instance's /version.
func TestOlderPDGetsMediaWithTheTransfer(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1, fake: fakevllm.Config{Version: "0.26.0"}})
	code, body := r.post("/v1/chat/completions", chat(false, image("http://img/1.png"), image("http://img/2.png")))
	require.Equal(t, 200, code, string(body))
	b := decodePD(t, r.pd[0].Calls()[0])
	require.Equal(t, []string{"image_url", "image_url"}, partTypes(t, b), "the media, as the client sent it")
	require.Len(t, b.Params.Items, 2, "and every item's transfer")
	// Each under the identifier the encoder reported, so that the consumer
	// names it as the encoder did.
	var parts []struct {
		UUID string `json:"uuid"`
	}
	require.NoError(t, json.Unmarshal(b.Messages[1].Content, &parts))
	require.Equal(t, []string{b.Params.Items[0].MMHash, b.Params.Items[1].MMHash}, []string{parts[0].UUID, parts[1].UUID})
	resp, err := http.Get(r.url + "/metrics")
	require.NoError(t, err)
	m := readAll(t, resp)
	require.Contains(t, m, `ecm_proxy_media_items_total{outcome="encoded"} 2`)
	require.NotContains(t, m, `ecm_proxy_media_items_total{outcome="fallback"}`)
}

// The version decides per instance: 0.30 and newer take embeds; a version
// the proxy could not learn gets the media, which every release takes.
func TestEmbedsOnlyFromVLLM030(t *testing.T) {
	for version, want := range map[string]bool{
		"0.26.0": false, "0.29.9": false, "0.30.0": true, "0.30.0rc1": true, "0.33.0": true,
		"0.11.1.dev12+gabc": false, "1.0.0": true, "": false, "dev": false, "0": false,
	} {
		require.Equal(t, want, takesEmbeds(version), version)
	}
}

func TestNewerPDGetsEmbeds(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1, fake: fakevllm.Config{Version: "0.30.0"}})
	code, body := r.post("/v1/chat/completions", chat(false, image("http://img/1.png")))
	require.Equal(t, 200, code, string(body))
	require.Equal(t, []string{"image_embeds"}, partTypes(t, decodePD(t, r.pd[0].Calls()[0])))
}
