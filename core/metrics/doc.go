// Package metrics is the process-wide Prometheus registry of the library:
// the counters and histograms that runtime objects increment, the probes
// that report their state at scrape time, and a small fasthttp server that
// serves the text format on /metrics.
//
// # What is measured where
//
// Events are counted where they happen, through the functions of this
// package (Moved, WriteBatch, Failed, RoundTrip, TransferWait, Phase): each is a
// few atomic adds, safe on any goroutine, and never blocks.
//
// Phase times the readiness path of a batch (copies, the wait for their
// event, the complete's hand-off and round trip, the readiness event's
// delivery): a histogram for Prometheus, and totals that Phases returns
// for runtime objects' Stats, so that a benchmark can print a per-phase
// breakdown without scraping.
//
// State is read when Prometheus scrapes, not pushed: a runtime object calls
// Watch once with a Probe that reads its own Stats snapshot, and the
// returned function detaches it on Close. Reservations by state, slab bytes
// in use, push and transfer records by state come out this way, so the
// state machines stay free of metric calls.
//
// Every series is declared in one table (series.go), so two objects of the
// same kind always report the same names, help texts and labels.
//
// # Serving
//
// Nothing listens unless asked: Serve starts the fasthttp server (the
// connector processes' opt-in metrics_port, the proxy's --metrics-port).
// Text renders the same exposition for callers that serve it themselves.
package metrics
