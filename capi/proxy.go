package capi

import (
	"log/slog"

	"github.com/ecmooncake/ecmooncake/core/discovery"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/proxy"
)

// proxy ---------------------------------------------------------------------

type proxyObj struct{ *proxy.Proxy }

func (o *proxyObj) stats() any { return o.Stats() }

// ProxyOpen starts an EPD proxy.
func ProxyOpen(raw []byte) (uint64, error) {
	return open(raw, invalidIfRefused(proxy.DecodeConfig), func(cfg proxy.Config) (*proxyObj, error) {
		p, err := proxy.Open(cfg, slog.Default())
		return &proxyObj{p}, err
	})
}

// registrar -----------------------------------------------------------------

type registrarObj struct{ *discovery.Registrar }

func (o *registrarObj) stats() any { return o.Stats() }

// RegistrarOpen starts keeping a registration alive at the proxies.
func RegistrarOpen(raw []byte) (uint64, error) {
	return open(raw, invalidIfRefused(discovery.DecodeRegistrarConfig), func(cfg discovery.RegistrarConfig) (*registrarObj, error) {
		r, err := discovery.Start(cfg, slog.Default())
		return &registrarObj{r}, err
	})
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
