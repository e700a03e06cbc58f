package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/discovery"
	"github.com/ecmooncake/ecmooncake/core/proxy/fakevllm"
)

const testToken = "a-register-token-for-tests-only"

// adminCall sends a POST with an optional bearer token to base+path.
func adminCall(t *testing.T, base, path, token string, body any) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, base+path, strings.NewReader(mustJSON(t, body)))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

func metricsText(t *testing.T, base string) string {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	require.NoError(t, err)
	return readAll(t, resp)
}

// refusal is one count of ecm_proxy_registration_refusals_total.
type refusal struct {
	op, reason string
	n          int
}

// requireRefusals requires the proxy at base to report each count.
func requireRefusals(t *testing.T, base string, want ...refusal) {
	t.Helper()
	m := metricsText(t, base)
	for _, w := range want {
		require.Contains(t, m, fmt.Sprintf("ecm_proxy_registration_refusals_total{op=%q,reason=%q} %d", w.op, w.reason, w.n))
	}
}

// tokenRig is a proxy with one encoder that takes registrations carrying
// testToken.
func tokenRig(t *testing.T) *rig {
	return newRig(t, rigOpts{encoders: 1, mut: func(c *Config) { c.RegisterToken = testToken }})
}

// pdAt registers a PD instance at url that takes pushes on the test's
// consumer endpoint.
func pdAt(url string) discovery.Registration {
	return discovery.Registration{Role: discovery.RolePD, URL: url, Consumer: "tcp://127.0.0.1:15000"}
}

func pdURLs(p *Proxy) []string {
	var out []string
	for _, b := range p.Stats().Backends[discovery.RolePD] {
		out = append(out, b.URL)
	}
	return out
}

// The report that opened this work: an unauthenticated POST added a PD
// backend and half the next requests went to it. Without a token the
// proxy has no registration at all.
func TestRegistrationIsOffWithoutAToken(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1})
	rogue := startFake(t, fakevllm.RolePD, fakevllm.Config{})

	code, body := adminCall(t, r.url, discovery.RegisterPath, "", pdAt(rogue.URL()))
	require.Equal(t, http.StatusForbidden, code)
	require.Contains(t, body, "registration is off")
	require.Contains(t, body, "ECMOONCAKE_REGISTER_TOKEN")
	code, _ = adminCall(t, r.url, discovery.RegisterPath, testToken, pdAt(rogue.URL()))
	require.Equal(t, http.StatusForbidden, code, "a token the proxy does not hold opens nothing")
	code, _ = adminCall(t, r.url, discovery.DeregisterPath, "", map[string]string{"url": r.pd[0].URL()})
	require.Equal(t, http.StatusForbidden, code)

	for range 6 {
		code, body := r.post("/v1/chat/completions", chat(false, image("http://img/1.png")))
		require.Equal(t, 200, code, string(body))
	}
	require.Empty(t, rogue.Calls())
	require.Len(t, r.pd[0].Calls(), 6)
	require.Equal(t, []string{r.pd[0].URL()}, pdURLs(r.p))
	requireRefusals(t, r.url, refusal{"register", "off", 2}, refusal{"deregister", "off", 1})
}

func TestRegistrationNeedsTheToken(t *testing.T) {
	r := tokenRig(t)
	pd := startFake(t, fakevllm.RolePD, fakevllm.Config{})
	reg := pdAt(pd.URL())

	for name, tc := range map[string]struct {
		token, reason string
	}{
		"no token":           {"", "unauthenticated"},
		"wrong token":        {"not-the-token", "bad_token"},
		"a prefix of it":     {testToken[:10], "bad_token"},
		"the token and more": {testToken + "x", "bad_token"},
	} {
		code, body := adminCall(t, r.url, discovery.RegisterPath, tc.token, reg)
		require.Equal(t, http.StatusUnauthorized, code, name)
		require.Contains(t, body, "bearer token", name)
		require.Empty(t, pdURLs(r.p), name)
	}
	code, body := adminCall(t, r.url, discovery.RegisterPath, testToken, reg)
	require.Equal(t, http.StatusOK, code, body)
	require.Equal(t, []string{pd.URL()}, pdURLs(r.p))
	code, answer := r.post("/v1/chat/completions", chat(false, image("http://img/1.png")))
	require.Equal(t, 200, code, string(answer))
	require.Len(t, pd.Calls(), 1)

	requireRefusals(t, r.url, refusal{"register", "unauthenticated", 1}, refusal{"register", "bad_token", 3})
	require.Contains(t, metricsText(t, r.url), `ecm_proxy_registrations_total{kind="new"} 1`)
}

// A registration, even an authenticated one, never replaces or removes a
// backend the operator listed.
func TestStaticBackendsAreNotReplaceable(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1, mut: func(c *Config) { c.RegisterToken = testToken }})
	static := r.pd[0].URL()
	code, body := adminCall(t, r.url, discovery.RegisterPath, testToken, discovery.Registration{Role: discovery.RolePD, URL: static, Consumer: "tcp://10.9.9.9:15000", TPSize: 4})
	require.Equal(t, http.StatusConflict, code, body)
	require.Contains(t, body, "static")
	code, body = adminCall(t, r.url, discovery.DeregisterPath, testToken, map[string]string{"role": "pd", "url": static})
	require.Equal(t, http.StatusConflict, code, body)
	require.Contains(t, body, "static")

	bs := r.p.Stats().Backends[discovery.RolePD]
	require.Len(t, bs, 1)
	require.True(t, bs[0].Static)
	require.Equal(t, "tcp://127.0.0.1:14579", bs[0].Consumer, "the consumer endpoint the operator gave")
	require.Equal(t, 1, bs[0].TPSize)

	code, answer := r.post("/v1/chat/completions", chat(false, image("http://img/1.png")))
	require.Equal(t, 200, code, string(answer))
	var sent struct {
		P struct {
			Consumer string `json:"consumer"`
		} `json:"ec_transfer_params"`
	}
	require.NoError(t, json.Unmarshal(r.enc[0].Calls()[0].Body, &sent))
	require.Equal(t, "tcp://127.0.0.1:14579", sent.P.Consumer, "encoders still push to the static consumer")
	requireRefusals(t, r.url, refusal{"register", "static", 1}, refusal{"deregister", "static", 1})
}

func TestDeregistrationNeedsTheToken(t *testing.T) {
	r := tokenRig(t)
	pd := startFake(t, fakevllm.RolePD, fakevllm.Config{})
	code, body := adminCall(t, r.url, discovery.RegisterPath, testToken, pdAt(pd.URL()))
	require.Equal(t, http.StatusOK, code, body)

	for _, tok := range []string{"", "guess"} {
		code, body = adminCall(t, r.url, discovery.DeregisterPath, tok, map[string]string{"role": "pd", "url": pd.URL()})
		require.Equal(t, http.StatusUnauthorized, code, body)
		require.Equal(t, []string{pd.URL()}, pdURLs(r.p), "someone else's registration stays")
	}
	code, body = adminCall(t, r.url, discovery.DeregisterPath, testToken, map[string]string{"role": "pd", "url": pd.URL()})
	require.Equal(t, http.StatusOK, code, body)
	require.JSONEq(t, `{"ok": true, "removed": true}`, body)
	require.Empty(t, pdURLs(r.p))
	requireRefusals(t, r.url, refusal{"deregister", "unauthenticated", 1}, refusal{"deregister", "bad_token", 1})
}

// With an admin port, discovery lives there alone and the user-facing port
// can be exposed by itself.
func TestAdminPortTakesDiscoveryOffTheUserPort(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, mut: func(c *Config) {
		c.RegisterToken = testToken
		c.AdminPort = freePort(t)
	}})
	admin := "http://" + r.p.AdminAddr()
	require.NotEqual(t, r.url, admin)
	pd := startFake(t, fakevllm.RolePD, fakevllm.Config{})
	reg := pdAt(pd.URL())

	code, _ := adminCall(t, r.url, discovery.RegisterPath, testToken, reg)
	require.Equal(t, http.StatusNotFound, code, "not on the user port, token or not")
	resp, err := http.Get(r.url + discovery.BackendsPath)
	require.NoError(t, err)
	readAll(t, resp)
	require.Equal(t, http.StatusNotFound, resp.StatusCode)

	code, _ = adminCall(t, admin, discovery.RegisterPath, "", reg)
	require.Equal(t, http.StatusUnauthorized, code, "the admin port checks the token too")
	code, body := adminCall(t, admin, discovery.RegisterPath, testToken, reg)
	require.Equal(t, http.StatusOK, code, body)
	code, body = adminGet(t, admin+discovery.BackendsPath, testToken)
	require.Contains(t, body, pd.URL())
	require.Equal(t, http.StatusOK, code)

	code, answer := r.post("/v1/chat/completions", chat(false, text("hi")))
	require.Equal(t, 200, code, string(answer))
	resp, err = http.Get(admin + "/v1/chat/completions")
	require.NoError(t, err)
	readAll(t, resp)
	require.Equal(t, http.StatusNotFound, resp.StatusCode, "the admin port serves no requests")
	code, _ = adminCall(t, admin, discovery.DeregisterPath, testToken, map[string]string{"url": pd.URL()})
	require.Equal(t, http.StatusOK, code)
}

// The registrar sends the token it was given; without it the proxy
// refuses and the registrar says why.
func TestRegistrarSendsItsToken(t *testing.T) {
	r := tokenRig(t)
	pd := startFake(t, fakevllm.RolePD, fakevllm.Config{})
	cfg := discovery.RegistrarConfig{
		Proxies:      []string{r.url},
		Registration: discovery.Registration{Role: discovery.RolePD, URL: pd.URL(), Consumer: "tcp://127.0.0.1:15000", TTLS: 5},
		IntervalS:    0.05,
	}
	anon, err := discovery.Start(cfg, nil)
	require.NoError(t, err)
	eventually(t, "the anonymous registrar fails", func() bool { return anon.Stats().Failures > 0 })
	require.Contains(t, anon.Stats().LastErr[r.url], "401")
	require.NoError(t, anon.Close())
	require.Empty(t, pdURLs(r.p))

	cfg.Token = testToken
	reg, err := discovery.Start(cfg, nil)
	require.NoError(t, err)
	eventually(t, "the registrar with the token registers", func() bool { return len(pdURLs(r.p)) == 1 })
	require.NoError(t, reg.Close())
	require.Empty(t, pdURLs(r.p), "its deregistration carries the token too")
}

func TestAdminConfigValidation(t *testing.T) {
	decodeCases{
		"no backend and no token":  {`{}`, "nothing could serve"},
		"token enables discovery":  {`{"register_token": "` + testToken + `"}`, ""},
		"token with a space":       {`{"pd": ["http://a:1"], "register_token": "two words"}`, "register_token"},
		"token with a newline":     {`{"pd": ["http://a:1"], "register_token": "tok\n"}`, "register_token"},
		"admin port is the port":   {`{"pd": ["http://a:1"], "port": 8000, "admin_port": 8000}`, "admin_port"},
		"admin port out of range":  {`{"pd": ["http://a:1"], "admin_port": 70000}`, "admin_port"},
		"admin port without token": {`{"pd": ["http://a:1"], "admin_port": 8001}`, ""},
	}.check(t)
}

func TestTokenMatches(t *testing.T) {
	a := newAdminAuth(testToken)
	for hdr, want := range map[string]authResult{
		"":                          authMissing,
		"Bearer " + testToken:       authOK,
		"bearer " + testToken:       authOK,
		"Bearer  " + testToken:      authBad,
		"Basic " + testToken:        authMissing,
		"Bearer":                    authMissing,
		"Bearer " + testToken + " ": authBad,
		testToken:                   authMissing,
	} {
		require.Equal(t, want, a.check([]byte(hdr)), fmt.Sprintf("%q", hdr))
	}
	require.Equal(t, authOff, newAdminAuth("").check([]byte("Bearer "+testToken)))
}

// A discovery body is bounded before it is read, far below the limit the
// user port has for requests carrying images.
func TestDiscoveryBodiesAreBounded(t *testing.T) {
	r := newRig(t, rigOpts{pds: 1, mut: func(c *Config) { c.RegisterToken = testToken }})
	big := discovery.Registration{Role: discovery.RolePD, URL: "http://127.0.0.1:1", Consumer: "tcp://127.0.0.1:2", Host: strings.Repeat("h", maxDiscoveryBody)}
	code, msg := adminCall(t, r.url, discovery.RegisterPath, testToken, big)
	require.Equal(t, http.StatusRequestEntityTooLarge, code, msg)
	require.Contains(t, msg, "at most 65536 bytes")
	require.Equal(t, []string{r.pd[0].URL()}, pdURLs(r.p))
	code, body := r.post("/v1/chat/completions", chat(false, text(strings.Repeat("x", 2*maxDiscoveryBody))))
	require.Equal(t, 200, code, string(body))
	requireRefusals(t, r.url, refusal{"register", "too_large", 1})
}

// adminGet is a GET on the proxy with an optional bearer token.
func adminGet(t *testing.T, url, token string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	return resp.StatusCode, readAll(t, resp)
}

// The backend list names every consumer's control endpoint: a map of what
// to attack. It is answered only to a holder of the register token, and to
// nobody on a proxy that has none.
func TestBackendListNeedsTheRegisterToken(t *testing.T) {
	r := newRig(t, rigOpts{encoders: 1, pds: 1, mut: func(c *Config) { c.RegisterToken = testToken }})
	code, body := adminGet(t, r.url+discovery.BackendsPath, "")
	require.Equal(t, http.StatusUnauthorized, code, body)
	require.NotContains(t, body, r.pd[0].URL())
	code, body = adminGet(t, r.url+discovery.BackendsPath, "not-the-token-at-all-0123456789")
	require.Equal(t, http.StatusUnauthorized, code, body)
	code, body = adminGet(t, r.url+discovery.BackendsPath, testToken)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, r.pd[0].URL())

	open := newRig(t, rigOpts{encoders: 1, pds: 1})
	code, body = adminGet(t, open.url+discovery.BackendsPath, "")
	require.Equal(t, http.StatusForbidden, code, body)
	require.NotContains(t, body, open.pd[0].URL())
	require.Contains(t, body, "register token")
}
