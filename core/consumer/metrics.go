package consumer

import (
	"fmt"

	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// metricsName labels this shard's series: its control port is unique on
// the host.
func (s *Shard) metricsName() string { return fmt.Sprintf("consumer:%d", s.cfg.ControlPort()) }

// probe reports the shard's state at scrape time.
func (s *Shard) probe(e *metrics.Emitter) {
	st := s.Stats()
	for state, n := range st.Table.Regions {
		e.Set(metrics.Reservations, float64(n), state.String())
	}
	e.Set(metrics.SlabBytes, float64(st.Size))
	e.Set(metrics.SlabBytesInUse, float64(st.InUse))
	e.Set(metrics.ResidentBytes, float64(st.Table.ResidentBytes))
	e.Set(metrics.ReceivedBytes, float64(st.Data.Bytes), s.cfg.Transport)
	e.Set(metrics.ReceivedFrames, float64(st.Data.Frames), s.cfg.Transport)
	e.Set(metrics.CompletedItems, float64(st.Table.Completed))
	e.Set(metrics.CompletedBytes, float64(st.Table.CompletedBytes))
	for reason, n := range st.Data.Rejected {
		e.Set(metrics.RejectedWrites, float64(n), reason)
	}
	for reason, n := range st.Table.OverQuota {
		e.Set(metrics.OverQuota, float64(n), reason)
	}
	e.Set(metrics.OrphanedWrites, float64(st.Table.Orphaned), "orphaned")
	e.Set(metrics.OrphanedWrites, float64(st.Table.TakenOver), "taken_over")
	for reason, n := range st.Data.Closed {
		e.Set(metrics.DataConnsClosed, float64(n), reason)
	}
	e.Set(metrics.ControlRequests, float64(st.Server.Served))
	e.Set(metrics.EventsSent, float64(st.Events.Sent))
}
