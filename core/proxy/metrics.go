package proxy

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// proxyMetrics are one proxy's series, in a registry of its own so that
// several proxies in one process (tests) do not share counters.
type proxyMetrics struct {
	reg       *prometheus.Registry
	gatherer  prometheus.Gatherer
	requests  *prometheus.CounterVec
	latency   *prometheus.HistogramVec
	phase     *prometheus.HistogramVec
	items     *prometheus.CounterVec
	derived   *prometheus.CounterVec
	retries   *prometheus.CounterVec
	redials   *prometheus.CounterVec
	checks    *prometheus.CounterVec
	encodes   *prometheus.CounterVec
	gone      prometheus.Counter
	registers *prometheus.CounterVec
	refusals  *prometheus.CounterVec
	keys      *prometheus.CounterVec
	routing   *prometheus.CounterVec
}

var latencyBuckets = prometheus.ExponentialBuckets(0.0005, 2, 18) // 0.5 ms .. 65 s

func newProxyMetrics(p *Proxy) *proxyMetrics {
	m := &proxyMetrics{
		reg:      prometheus.NewRegistry(),
		requests: metrics.Counters("ecm_proxy_requests_total", "Requests answered, by route and outcome.", "route", "outcome"),
		latency:  metrics.Histograms("ecm_proxy_request_seconds", "Time from a request's arrival to the last byte of its answer, by route.", latencyBuckets, "route"),
		phase: metrics.Histograms("ecm_proxy_phase_seconds",
			"Request time by phase: encode (all encoder calls of an attempt), transfer_wait (consumer request sent to its first byte: the consumer waits there for pushed items, then prefills), pd (consumer request sent to its last byte).",
			latencyBuckets, "phase"),
		items:   metrics.Counters("ecm_proxy_media_items_total", "Media items, by what became of them: encoded (sent as embeds), fallback (sent as media), duplicate (repeated in one request, encoded once), reused (not encoded: the picked PD holds it, and gets the media under its identifier), store (not encoded: the picked PD gets it from Mooncake Store, with the media under its identifier to fall back on; store_reuse).", "outcome"),
		derived: metrics.Counters("ecm_proxy_derived_fields_total", "Fields an encoder's answer lacked and the proxy filled in from the request it sent, by field (modality: vLLM before 0.33 reports none).", "field"),
		retries: metrics.Counters("ecm_proxy_retries_total", "Consumer attempts retried, by reason.", "reason"),
		redials: metrics.Counters("ecm_proxy_upstream_redials_total",
			"Backend calls that failed on a reused connection before any response byte (the backend had closed it) and were sent again on a fresh one, by role; these never count against the backend's health.", "role"),
		checks:  metrics.Counters("ecm_proxy_health_checks_total", "Backend /health checks, by role and outcome (ok, failed).", "role", "outcome"),
		encodes: metrics.Counters("ecm_proxy_encoder_calls_total", "Encoder calls, by outcome.", "outcome"),
		gone: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ecm_proxy_client_disconnects_total", Help: "Requests whose client went away before the answer ended; their backend calls were cancelled.",
		}),
		registers: metrics.Counters("ecm_proxy_registrations_total", "Discovery calls that changed or kept an entry, by kind (new, heartbeat, deregister, expired).", "kind"),
		refusals: metrics.Counters("ecm_proxy_registration_refusals_total",
			"Register and deregister calls refused, by op and reason: off (no register token, or allow_register false), unauthenticated (no bearer token), bad_token, static (would replace or remove a static backend), invalid (a malformed registration), too_large (a body above 64 KiB).",
			"op", "reason"),
		keys: metrics.Counters("ecm_proxy_client_media_keys_total",
			"Client-chosen media keys (a content part's uuid), by what became of them: namespaced (kept apart per tenant), refused (the request answered 400), trusted (passed unchanged, client_media_keys=trust).",
			"outcome"),
		routing: metrics.Counters("ecm_proxy_routing_total",
			"Consumer picks for requests with media, by the rule that decided: affinity (the PD that served most of the request's items), affinity_overloaded (that PD was more than affinity_slack requests busier than the least loaded, which was picked), least_loaded (no PD known to hold an item).",
			"reason"),
	}
	bodies := []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ecm_proxy_affinity_entries",
			Help: "Media items the proxy remembers the PD of (at most affinity_entries)."},
			func() float64 { n, _ := p.aff.size(); return float64(n) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "ecm_proxy_affinity_evictions_total",
			Help: "Items forgotten to keep the affinity map within affinity_entries (least recently routed first)."},
			func() float64 { _, e := p.aff.size(); return float64(e) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ecm_proxy_body_bytes_in_flight",
			Help: "Request-body bytes the proxy holds now, all requests together; at most max_body_bytes × max_bodies_in_flight."},
			func() float64 { return float64(p.bodies.held()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ecm_proxy_body_bytes_in_flight_peak",
			Help: "The most request-body bytes the proxy has held at once since it started."},
			func() float64 { return float64(p.bodies.peak()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "ecm_proxy_body_refusals_total",
			Help: "Requests refused with 503 because their body would take the proxy over max_body_bytes × max_bodies_in_flight."},
			func() float64 { return float64(p.bodies.refused()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "ecm_proxy_body_client_refusals_total",
			Help: "Requests refused with 503 because their body would take their client (peer address) over max_body_bytes_per_client."},
			func() float64 { return float64(p.bodies.refusedShare()) }),
	}
	m.reg.MustRegister(bodies...)
	m.reg.MustRegister(m.requests, m.latency, m.phase, m.items, m.derived, m.retries, m.redials, m.checks, m.encodes, m.gone, m.registers, m.refusals, m.keys, m.routing, backendCollector{p})
	m.gatherer = prometheus.Gatherers{m.reg, metrics.Registry()}
	return m
}

var (
	descHealthy  = prometheus.NewDesc("ecm_proxy_backend_healthy", "1 while the backend takes requests, 0 while it is dropped.", []string{"role", "url"}, nil)
	descInFlight = prometheus.NewDesc("ecm_proxy_backend_in_flight", "Requests in flight to the backend.", []string{"role", "url"}, nil)
)

// backendCollector reads the pools at scrape time.
type backendCollector struct{ p *Proxy }

func (c backendCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descHealthy
	ch <- descInFlight
}

func (c backendCollector) Collect(ch chan<- prometheus.Metric) {
	for _, pl := range c.p.pools() {
		for _, b := range pl.snapshot() {
			h := 0.0
			if b.isHealthy() {
				h = 1
			}
			ch <- prometheus.MustNewConstMetric(descHealthy, prometheus.GaugeValue, h, pl.role, b.reg.URL)
			ch <- prometheus.MustNewConstMetric(descInFlight, prometheus.GaugeValue, float64(b.inflight.Load()), pl.role, b.reg.URL)
		}
	}
}
