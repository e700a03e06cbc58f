package node

import (
	"fmt"
	"log/slog"
	"sync"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/cuda"
	"github.com/ecmooncake/ecmooncake/core/metrics"
)

var (
	metricsMu  sync.Mutex
	metricsSrv *metrics.Server
	metricsAt  string
)

// ServeMetrics serves /metrics once the process settings name a port. The
// server lives as long as the process (vLLM processes end by exiting), and
// a process serves on one port: asking for another is ErrState.
func ServeMetrics(r config.Runtime, log *slog.Logger) error {
	if r.MetricsPort == 0 {
		return nil
	}
	want := fmt.Sprintf("%s:%d", r.MetricsIP, r.MetricsPort)
	metricsMu.Lock()
	defer metricsMu.Unlock()
	if metricsSrv != nil {
		if want != metricsAt {
			return kindf(ErrState, "metrics already served on %s; a process serves them on one port (asked for %s)", metricsAt, want)
		}
		return nil
	}
	srv, err := metrics.Serve(r.MetricsIP, r.MetricsPort, nil, log)
	if err != nil {
		return err
	}
	metricsSrv, metricsAt = srv, want
	return nil
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
