package capi

import (
	"fmt"
	"log/slog"
	"sync"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/discovery"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/proxy"
)

// proxy ---------------------------------------------------------------------

type proxyObj struct{ *proxy.Proxy }

func (o *proxyObj) stats() any { return o.Stats() }

// ProxyOpen starts an EPD proxy.
func ProxyOpen(raw []byte) (uint64, error) {
	setup()
	cfg, err := proxy.DecodeConfig(raw)
	if err != nil {
		return 0, statusErr(StatusInvalid, "%v", err)
	}
	p, err := proxy.Open(cfg, slog.Default())
	if err != nil {
		return 0, err
	}
	return handles.add(&proxyObj{p}), nil
}

// registrar -----------------------------------------------------------------

type registrarObj struct{ *discovery.Registrar }

func (o *registrarObj) stats() any { return o.Stats() }

// RegistrarOpen starts keeping a registration alive at the proxies.
func RegistrarOpen(raw []byte) (uint64, error) {
	setup()
	cfg, err := discovery.DecodeRegistrarConfig(raw)
	if err != nil {
		return 0, statusErr(StatusInvalid, "%v", err)
	}
	r, err := discovery.Start(cfg, slog.Default())
	if err != nil {
		return 0, err
	}
	return handles.add(&registrarObj{r}), nil
}

// metrics -------------------------------------------------------------------

// MetricsText renders this process's metrics.
func MetricsText() ([]byte, error) {
	b, err := metrics.Text(nil)
	if err != nil && len(b) == 0 {
		return nil, statusErr(StatusInternal, "%v", err)
	}
	return b, nil
}

var (
	metricsMu  sync.Mutex
	metricsSrv *metrics.Server
	metricsAt  string
)

// startMetrics serves /metrics once a configure call names a port. The
// server lives as long as the process: vLLM processes end by exiting.
func startMetrics(r config.Runtime) error {
	if r.MetricsPort == 0 {
		return nil
	}
	want := fmt.Sprintf("%s:%d", r.MetricsIP, r.MetricsPort)
	metricsMu.Lock()
	defer metricsMu.Unlock()
	if metricsSrv != nil {
		if want != metricsAt {
			return statusErr(StatusState, "metrics already served on %s; a process serves them on one port (asked for %s)", metricsAt, want)
		}
		return nil
	}
	srv, err := metrics.Serve(r.MetricsIP, r.MetricsPort, nil, slog.Default())
	if err != nil {
		return statusErr(StatusIO, "%v", err)
	}
	metricsSrv, metricsAt = srv, want
	return nil
}
