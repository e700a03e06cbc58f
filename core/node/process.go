package node

import (
	"fmt"
	"log/slog"
	"sync"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/cuda"
	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// Metrics is the one /metrics server of a process: the first Serve that
// names a port starts it, a later Serve for the same address is a no-op and
// one for another address is ErrState, so two objects of one process never
// split their metrics over two ports. The zero value serves nothing yet.
// Production has one, behind ServeMetrics; a test makes its own so that it
// can run again (go test -count=N) without meeting an earlier run's port.
type Metrics struct {
	mu  sync.Mutex
	srv *metrics.Server
	at  string
}

// Serve serves this process's registry on r.MetricsIP:r.MetricsPort, once;
// a zero port serves nothing.
func (m *Metrics) Serve(r config.Runtime, log *slog.Logger) error {
	if r.MetricsPort == 0 {
		return nil
	}
	want := fmt.Sprintf("%s:%d", r.MetricsIP, r.MetricsPort)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.srv != nil {
		if want != m.at {
			return kindf(ErrState, "metrics already served on %s; a process serves them on one port (asked for %s)", m.at, want)
		}
		return nil
	}
	srv, err := metrics.Serve(r.MetricsIP, r.MetricsPort, nil, log)
	if err != nil {
		return err
	}
	m.srv, m.at = srv, want
	return nil
}

// Addr is where the server listens, "" before a Serve started it.
func (m *Metrics) Addr() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.srv == nil {
		return ""
	}
	return m.srv.Addr()
}

// Close stops the server; a later Serve may start one on any address.
func (m *Metrics) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.srv == nil {
		return nil
	}
	err := m.srv.Close()
	m.srv, m.at = nil, ""
	return err
}

// processMetrics lives as long as the process: vLLM processes end by
// exiting, so nothing but a test closes it.
var processMetrics Metrics

// ProcessMetrics is the server ServeMetrics starts, for a test of the
// process settings to close once it is done.
func ProcessMetrics() *Metrics { return &processMetrics }

// ServeMetrics serves /metrics once the process settings name a port. The
// server lives as long as the process, and a process serves on one port:
// asking for another is ErrState.
func ServeMetrics(r config.Runtime, log *slog.Logger) error {
	return processMetrics.Serve(r, log)
}

// GPUReport says whether this process can use GPU memory, and if not why.
type GPUReport struct {
	Available     bool   `json:"available"`
	Reason        string `json:"reason,omitempty"`
	DriverVersion int    `json:"driver_version,omitempty"`
	Devices       int    `json:"devices"`
}

// GPUs reports this process's GPUs as the CUDA driver sees them.
func GPUs() GPUReport {
	var out GPUReport
	drv, err := cuda.Default()
	if err != nil {
		out.Reason = err.Error()
	} else {
		out.Available, out.DriverVersion, out.Devices = true, drv.Version(), drv.Count()
	}
	return out
}
