package capi

import (
	"log/slog"

	"github.com/ecmooncake/ecmooncake/core/discovery"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/proxy"
)

// proxy ---------------------------------------------------------------------

var proxies = &kind[*proxy.Proxy]{"proxy", func(p *proxy.Proxy) any { return p.Stats() }}

// ProxyOpen starts an EPD proxy.
func ProxyOpen(raw []byte) (uint64, error) {
	return open(proxies, raw, invalidIfRefused(proxy.DecodeConfig), func(cfg proxy.Config) (*proxy.Proxy, error) {
		return proxy.Open(cfg, slog.Default())
	})
}

// registrar -----------------------------------------------------------------

var registrars = &kind[*discovery.Registrar]{"registrar", func(r *discovery.Registrar) any { return r.Stats() }}

// RegistrarOpen starts keeping a registration alive at the proxies.
func RegistrarOpen(raw []byte) (uint64, error) {
	return open(registrars, raw, invalidIfRefused(discovery.DecodeRegistrarConfig), func(cfg discovery.RegistrarConfig) (*discovery.Registrar, error) {
		return discovery.Start(cfg, slog.Default())
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
