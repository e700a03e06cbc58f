package capi

import (
	"encoding/json"
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/node"
)

func TestProxyAndRegistrarHandles(t *testing.T) {
	_, err := ProxyOpen([]byte(`{"retries": 99, "pd": ["http://h:1"]}`))
	require.Equal(t, StatusInvalid, Classify(err))
	_, err = RegistrarOpen([]byte(`{"role": "pd"}`))
	require.Equal(t, StatusInvalid, Classify(err))

	h, err := ProxyOpen([]byte(`{"host": "127.0.0.1", "port": 0, "pd": ["http://127.0.0.1:1"]}`))
	require.NoError(t, err)
	raw, err := Stats(h)
	require.NoError(t, err)
	var st struct {
		Addr string `json:"addr"`
	}
	require.NoError(t, json.Unmarshal(raw, &st))
	require.NotEmpty(t, st.Addr)

	r, err := RegistrarOpen([]byte(`{"proxies": ["http://` + st.Addr + `"], "role": "encode", "url": "http://127.0.0.1:2"}`))
	require.NoError(t, err)
	require.NoError(t, Close(r))
	require.NoError(t, Close(h))
	require.Equal(t, StatusHandle, Classify(Close(h)))
}

// The process's metrics server is closed at the end, so that the next run
// (go test -count=N) may serve on a port of its own.
func TestConfigureServesMetricsOnOnePort(t *testing.T) {
	t.Cleanup(func() { require.NoError(t, node.ProcessMetrics().Close()) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	cfg := func(p int) []byte {
		b, _ := json.Marshal(map[string]any{"metrics_port": p, "metrics_ip": "127.0.0.1"})
		return b
	}
	require.NoError(t, Configure(cfg(port)))
	require.NoError(t, Configure(cfg(port)), "the same port again is a no-op")
	require.Equal(t, StatusState, Classify(Configure(cfg(port+1))))
	text, err := MetricsText()
	require.NoError(t, err)
	require.Contains(t, string(text), "go_goroutines")
}
