package metrics

import (
	"fmt"
	"sort"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// Series names that probes report. Each is declared once in table below.
const (
	Reservations      = "ecm_reservations"
	SlabBytes         = "ecm_slab_bytes"
	SlabBytesInUse    = "ecm_slab_bytes_in_use"
	ResidentBytes     = "ecm_resident_bytes"
	ReceivedBytes     = "ecm_received_bytes_total"
	CompletedItems    = "ecm_completed_items_total"
	CompletedBytes    = "ecm_completed_bytes_total"
	ReceivedFrames    = "ecm_received_frames_total"
	RejectedWrites    = "ecm_rejected_writes_total"
	OverQuota         = "ecm_reserve_over_quota_total"
	OrphanedWrites    = "ecm_orphaned_writes_total"
	DataConnsClosed   = "ecm_data_conns_closed_total"
	Pushes            = "ecm_pushes"
	PushesEnded       = "ecm_pushes_ended_total"
	SourceBytesHeld   = "ecm_source_bytes_held"
	CompletesOut      = "ecm_completes_out"
	CompleteWaits     = "ecm_complete_window_waits_total"
	CompletesFailed   = "ecm_completes_failed_total"
	WaitsExtended     = "ecm_source_waits_extended_total"
	Transfers         = "ecm_sched_transfers"
	TransfersEnded    = "ecm_sched_transfers_ended_total"
	ControlRequests   = "ecm_control_requests_total"
	EventsSent        = "ecm_events_sent_total"
	SchedulerResynced = "ecm_sched_resynced_total"
	MetadataKeys      = "ecm_metadata_keys"
	MetadataBytes     = "ecm_metadata_bytes"
	MetadataRefusals  = "ecm_metadata_refusals_total"
)

type spec struct {
	help   string
	kind   prometheus.ValueType
	labels []string // besides "object", which every probe series carries
}

var table = map[string]spec{
	Reservations:      {"Consumer shard: live reservations by state.", prometheus.GaugeValue, []string{"state"}},
	SlabBytes:         {"Consumer shard: size of the receive slab.", prometheus.GaugeValue, nil},
	SlabBytesInUse:    {"Consumer shard: slab bytes held by reservations and resident copies.", prometheus.GaugeValue, nil},
	ResidentBytes:     {"Consumer shard: bytes kept as resident copies after the engine freed them.", prometheus.GaugeValue, nil},
	ReceivedBytes:     {"Consumer shard: bytes landed by the data plane, by transport.", prometheus.CounterValue, []string{"transport"}},
	CompletedItems:    {"Consumer shard: items whose writer completed them (ready to load), any data plane.", prometheus.CounterValue, nil},
	CompletedBytes:    {"Consumer shard: bytes of the items whose writer completed them, any data plane.", prometheus.CounterValue, nil},
	ReceivedFrames:    {"Consumer shard: frames landed by the data plane, by transport.", prometheus.CounterValue, []string{"transport"}},
	RejectedWrites:    {"Consumer shard: data-plane writes refused, by reason.", prometheus.CounterValue, []string{"reason"}},
	OverQuota:         {"Consumer shard: reservations refused for the quota of their connection, by reason (pending, pending_bytes, followers, peer_followers, requesters_per_peer).", prometheus.CounterValue, []string{"reason"}},
	OrphanedWrites:    {"Consumer shard: writes whose writer's control connection ended (orphaned), and those of them another producer's reserve of the content took over (taken_over).", prometheus.CounterValue, []string{"outcome"}},
	DataConnsClosed:   {"Consumer shard: data-plane connections closed or refused to protect the shard, by reason (limit, evicted, idle, frame_timeout, peer_uid, bad_hello, bad_nonce).", prometheus.CounterValue, []string{"reason"}},
	Pushes:            {"Producer: live pushes by state.", prometheus.GaugeValue, []string{"state"}},
	PushesEnded:       {"Producer: pushes that reached each terminal state.", prometheus.CounterValue, []string{"state"}},
	SourceBytesHeld:   {"Producer: bytes of encoder outputs the library may still read.", prometheus.GaugeValue, nil},
	CompletesOut:      {"Producer: completes sent and not yet answered (each holds no source).", prometheus.GaugeValue, nil},
	CompleteWaits:     {"Producer: completes that waited for a place in their shard's complete_window.", prometheus.CounterValue, nil},
	CompletesFailed:   {"Producer: completes refused by their shard or lost; each failed its push.", prometheus.CounterValue, nil},
	WaitsExtended:     {"Producer: writes that waited for the encoder output past their own deadline, for another push of the same content that follows them (or whose reservation was out when the wait ran out).", prometheus.CounterValue, nil},
	Transfers:         {"Consumer scheduler: live transfer records by state.", prometheus.GaugeValue, []string{"state"}},
	TransfersEnded:    {"Consumer scheduler: transfer records that reached each terminal state.", prometheus.CounterValue, []string{"state"}},
	ControlRequests:   {"Consumer shard: control requests served.", prometheus.CounterValue, nil},
	EventsSent:        {"Consumer shard: readiness events sent to the scheduler.", prometheus.CounterValue, nil},
	SchedulerResynced: {"Consumer scheduler: items learnt by asking a shard after their event was late.", prometheus.CounterValue, nil},
	MetadataKeys:      {"Mooncake metadata store: keys held.", prometheus.GaugeValue, nil},
	MetadataBytes:     {"Mooncake metadata store: bytes of keys and values held (bounded by max_total_bytes).", prometheus.GaugeValue, nil},
	MetadataRefusals:  {"Mooncake metadata store: requests refused, by reason (unauthorized, too_large, store_full, bad_request).", prometheus.CounterValue, []string{"reason"}},
}

var descs = func() map[string]*prometheus.Desc {
	m := make(map[string]*prometheus.Desc, len(table))
	for name, s := range table {
		m[name] = prometheus.NewDesc(name, s.help, append([]string{"object"}, s.labels...), nil)
	}
	return m
}()

// A Probe reports one object's state; it runs on the scrape goroutine and
// must not block (a Stats snapshot under the object's own lock is fine).
type Probe func(e *Emitter)

// Emitter hands a probe's values to the scrape.
type Emitter struct {
	object string
	ch     chan<- prometheus.Metric
	errs   []error
}

// Set reports series name with its label values (in the order table
// declares them, "object" excluded).
func (e *Emitter) Set(name string, v float64, labels ...string) {
	s, ok := table[name]
	if !ok || len(labels) != len(s.labels) {
		e.errs = append(e.errs, fmt.Errorf("metrics: %s: unknown series or %d label values for %v", name, len(labels), s.labels))
		return
	}
	m, err := prometheus.NewConstMetric(descs[name], s.kind, v, append([]string{e.object}, labels...)...)
	if err != nil {
		e.errs = append(e.errs, err)
		return
	}
	e.ch <- m
}

// probeSet is the collector of every watched object.
type probeSet struct {
	mu     sync.Mutex
	next   uint64
	probes map[uint64]watched
}

type watched struct {
	object string
	probe  Probe
}

var probes = &probeSet{probes: map[uint64]watched{}}

// Watch adds a probe for one object (object is its label value, e.g.
// "consumer:14579"); the returned function removes it and is idempotent.
// A name already watched gets a "#N" suffix, since two series with the
// same labels would fail the whole scrape.
func Watch(object string, p Probe) (unwatch func()) {
	probes.mu.Lock()
	probes.next++
	id := probes.next
	name := object
	for n := 2; probes.taken(name); n++ {
		name = fmt.Sprintf("%s#%d", object, n)
	}
	probes.probes[id] = watched{object: name, probe: p}
	probes.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			probes.mu.Lock()
			delete(probes.probes, id)
			probes.mu.Unlock()
		})
	}
}

func (p *probeSet) taken(object string) bool {
	for _, w := range p.probes {
		if w.object == object {
			return true
		}
	}
	return false
}

func (p *probeSet) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range descs {
		ch <- d
	}
}

func (p *probeSet) Collect(ch chan<- prometheus.Metric) {
	p.mu.Lock()
	ids := make([]uint64, 0, len(p.probes))
	for id := range p.probes {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	list := make([]watched, len(ids))
	for i, id := range ids {
		list[i] = p.probes[id]
	}
	p.mu.Unlock()
	for _, w := range list {
		e := &Emitter{object: w.object, ch: ch}
		runProbe(w, e)
		for _, err := range e.errs {
			ch <- prometheus.NewInvalidMetric(descs[Reservations], fmt.Errorf("probe %s: %w", w.object, err))
		}
	}
}

// runProbe keeps a panicking probe from failing the whole scrape (or the
// process that hosts it).
func runProbe(w watched, e *Emitter) {
	defer func() {
		if r := recover(); r != nil {
			e.errs = append(e.errs, fmt.Errorf("panic: %v", r))
		}
	}()
	w.probe(e)
}
