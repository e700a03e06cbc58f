package producer

import (
	"strings"
	"time"

	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// probe reports the producer's state at scrape time.
func (p *Producer) probe(e *metrics.Emitter) {
	st := p.Stats()
	for state, n := range st.Push.Records {
		e.Set(metrics.Pushes, float64(n), state.String())
	}
	for state, n := range st.Push.Ended {
		e.Set(metrics.PushesEnded, float64(n), state.String())
	}
	e.Set(metrics.SourceBytesHeld, float64(st.SourceBytes))
	e.Set(metrics.CompletesOut, float64(st.Push.CompletesOut))
	e.Set(metrics.CompleteWaits, float64(st.Push.WindowWaits))
	e.Set(metrics.CompletesFailed, float64(st.Push.CompletesFailed))
	e.Set(metrics.WaitsExtended, float64(st.Push.WaitsExtended))
}

// planeName is the transport a write address goes to: its scheme when it
// has one (a route's "cuda_ipc://...", "mooncake://..."), else the
// producer's transport.
func planeName(addr, fallback string) string {
	if name, _, ok := strings.Cut(addr, "://"); ok && name != "" {
		return name
	}
	return fallback
}

// observeWrite counts one write batch: its duration, and each item that
// landed.
func (p *Producer) observeWrite(name string, start time.Time, items []transport.WriteItem, errs []error) {
	var first error
	for i, it := range items {
		if i < len(errs) && errs[i] != nil {
			if first == nil {
				first = errs[i]
			}
			continue
		}
		metrics.Moved(name, it.Len())
	}
	metrics.WriteBatch(name, time.Since(start), first)
}
