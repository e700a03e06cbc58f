package sched

import (
	"container/heap"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ecmooncake/ecmooncake/core/internal/deadlines"
	"github.com/ecmooncake/ecmooncake/core/internal/defaults"
)

// Defaults for the zero fields of Config.
const (
	DefaultShards         = 1
	DefaultEventWait      = 60 * time.Second // push_wait_timeout_s
	DefaultLoadWait       = 30 * time.Second
	DefaultAvailableTTL   = 300 * time.Second // the consumer's reservation lease
	DefaultMaxTombstones  = 65536
	DefaultMaxEarlyEvents = 65536
)

// Config sizes and times a Table. Zero (or negative) fields take the
// defaults; a zero ResidentTTL means resident copies never expire by time
// and end only when a shard reports them evicted.
type Config struct {
	Shards         int
	EventWait      time.Duration
	LoadWait       time.Duration
	AvailableTTL   time.Duration
	ResidentTTL    time.Duration
	MaxTombstones  int
	MaxEarlyEvents int
}

func (c Config) withDefaults() Config {
	defaults.Positive(&c.Shards, DefaultShards)
	defaults.Positive(&c.EventWait, DefaultEventWait)
	defaults.Positive(&c.LoadWait, DefaultLoadWait)
	defaults.Positive(&c.AvailableTTL, DefaultAvailableTTL)
	if c.ResidentTTL < 0 {
		c.ResidentTTL = 0
	}
	defaults.Positive(&c.MaxTombstones, DefaultMaxTombstones)
	defaults.Positive(&c.MaxEarlyEvents, DefaultMaxEarlyEvents)
	return c
}

// Expected is one item a request will load: the push that carries it and
// the content it must hold.
type Expected struct {
	TransferID string `json:"transfer_id"`
	MMHash     string `json:"mm_hash"`
}

// Event is one shard's word on one transfer: its bytes are ready in the
// shard's slab (Ready), or the shard gave up on it (Reason says why).
//
// With Gone set it is instead the shard's word on content: its copy of
// MMHash ended (evicted, lease expired, cancelled) after it had been
// reported ready. It names no transfer, because the copy may have served
// many (the writer's, cached answers, followers) whose ids the shard no
// longer keeps; TransferID is ignored.
type Event struct {
	Shard      int
	TransferID string
	MMHash     string
	Ready      bool
	NBytes     uint64
	Reason     string
	Gone       bool
}

// Failure tells a request that one of its items will not come. Retryable is
// false only when retrying with the same transfer_id cannot help: the push
// it names ended before the request was registered.
type Failure struct {
	RequestID  string `json:"request_id"`
	TransferID string `json:"transfer_id"`
	MMHash     string `json:"mm_hash"`
	Reason     string `json:"reason"`
	Retryable  bool   `json:"retryable"`
}

// Stats is a snapshot for metrics.
type Stats struct {
	Records        map[State]int    // live records by state
	Ended          map[State]uint64 // records that reached each terminal state, since New
	Requests       int
	EarlyEvents    int    // transfers with events held until their Expect
	EarlyDropped   uint64 // early entries dropped: expired or crowded out
	IgnoredEvents  uint64 // events for a shard out of range, other content, another size or an ended transfer
	IgnoredReports uint64 // Loaded reports for transfers that were not loading
	Collisions     uint64
	Tombstones     int
	// EventSteps counts the steps that applied events (OnEvent, OnEvents):
	// a shard's event message of many records is one.
	EventSteps uint64
}

// Table is the consumer scheduler's transfer table. It is not safe for
// concurrent use: its owner serialises calls.
type Table struct {
	cfg Config

	records  map[string]*record   // live transfers by transfer_id
	byHash   map[string][]*record // live transfers by mm_hash, oldest first
	requests map[string]*request

	early map[string]*early
	// earlyOf indexes early by content (hash → transfer id): a Gone
	// event touches the early events of its content only, without a
	// scan of up to MaxEarlyEvents entries per event.
	earlyOf map[string]map[string]*early
	earlyQ  []queued // arrival order of early; may hold stale entries

	tombs map[string]tombstone
	tombQ []string // eviction order of tombs

	deadlines deadlineHeap
	seq       uint64

	// gen counts the changes that can alter an answer (Generation).
	gen uint64
	// changes logs what each generation since changesFrom touched, for
	// Changes.
	changes     []change
	changesFrom uint64
	// askers names, by mm_hash, the live requests with an item of that
	// content, served or not: whether some live request may still need
	// the content through any transfer. Ensure answers by content, so an
	// available transfer whose own requests finished may be what another
	// request was told is there, also one served before whose copy is
	// gone since (a preempted request asks again); it stays while the
	// content is asked for. Changes also answers their failures when the
	// content moves.
	askers map[string]map[string]struct{}

	// pending holds failures not yet handed out by Ready, in the order
	// they arose, so that failures from events reach the caller as well.
	pending []pendingFailure
	// cancels holds the transfers the table cancelled (Finish, or a load
	// that served their content) until Ready hands them to the caller, who
	// cancels them on the shards.
	cancels []string

	ended          [numStates]uint64
	earlyDropped   uint64
	ignoredEvents  uint64
	ignoredReports uint64
	collisions     uint64
	illegalMoves   uint64
	eventSteps     uint64
}

type record struct {
	id, hash string
	state    State
	shards   shardSet
	nbytes   uint64
	requests []string // attached requests, in arrival order
	deadline time.Time
	seq      uint64 // seq of the current deadline entry; 0 when none
}

// request tracks what one request still waits for. Each of its items is in
// exactly one of three places: attached to a live record (still waiting),
// in failed (will not come), or in served (loaded for it; what happens to
// the transfer afterwards no longer concerns the request).
type request struct {
	id     string
	items  []Expected
	index  map[string]struct{}
	failed map[string]Failure // by transfer_id
	served map[string]struct{}
}

type early struct {
	hash    string
	shards  shardSet
	nbytes  uint64
	reason  string // the first failure a shard reported
	events  int
	expires time.Time
	seq     uint64
}

type queued struct {
	id  string
	seq uint64
}

type tombstone struct {
	hash   string
	state  State
	reason string
}

type pendingFailure struct {
	requestID, transferID string
	at                    time.Time
}

// New returns an empty table.
func New(cfg Config) *Table {
	return &Table{
		cfg:      cfg.withDefaults(),
		records:  make(map[string]*record),
		byHash:   make(map[string][]*record),
		requests: make(map[string]*request),
		early:    make(map[string]*early),
		earlyOf:  make(map[string]map[string]*early),
		tombs:    make(map[string]tombstone),
		askers:   make(map[string]map[string]struct{}),
	}
}

// Expect registers the items of a request. All or nothing: when one item's
// transfer_id is already known with another mm_hash the whole request is
// refused with ErrCollision and nothing else changes, so the request that
// registered the id first keeps its record. Repeating a call, or adding
// items to a known request, is harmless.
func (t *Table) Expect(requestID string, items []Expected, now time.Time) error {
	t.advance(now)
	if requestID == "" {
		return fmt.Errorf("expect: %w: empty request id", ErrInvalid)
	}
	seen := make(map[string]string, len(items))
	for i, it := range items {
		if it.TransferID == "" || it.MMHash == "" {
			return fmt.Errorf("expect %s: item %d: %w: empty transfer_id or mm_hash", requestID, i, ErrInvalid)
		}
		known, ok := seen[it.TransferID]
		if !ok {
			known, ok = t.knownHash(it.TransferID)
		}
		if ok && known != it.MMHash {
			t.collisions++
			return fmt.Errorf("expect %s: transfer %s names mm_hash %s, already known as %s: %w",
				requestID, it.TransferID, it.MMHash, known, ErrCollision)
		}
		seen[it.TransferID] = it.MMHash
	}
	if len(items) == 0 {
		return nil
	}
	req := t.requests[requestID]
	if req == nil {
		req = &request{id: requestID, index: make(map[string]struct{}), failed: make(map[string]Failure), served: make(map[string]struct{})}
		t.requests[requestID] = req
		t.bump("", requestID)
	}
	for _, it := range items {
		if _, ok := req.index[it.TransferID]; ok {
			continue
		}
		t.bump(it.MMHash, requestID)
		req.items = append(req.items, it)
		ask := t.askers[it.MMHash]
		if ask == nil {
			ask = make(map[string]struct{}, 1)
			t.askers[it.MMHash] = ask
		}
		ask[requestID] = struct{}{}
		req.index[it.TransferID] = struct{}{}
		if r := t.records[it.TransferID]; r != nil && r.state == Ready {
			req.served[r.id] = struct{}{}
			continue
		}
		if r := t.records[it.TransferID]; r != nil {
			r.requests = append(r.requests, requestID)
			continue
		}
		if ts, ok := t.tombs[it.TransferID]; ok {
			req.failed[it.TransferID] = Failure{
				RequestID: requestID, TransferID: it.TransferID, MMHash: it.MMHash,
				Reason: fmt.Sprintf("transfer %s already ended (%s: %s)", it.TransferID, ts.state, ts.reason),
			}
			t.pending = append(t.pending, pendingFailure{requestID, it.TransferID, now})
			continue
		}
		r := &record{id: it.TransferID, hash: it.MMHash, shards: newShardSet(t.cfg.Shards), requests: []string{requestID}}
		t.records[r.id] = r
		t.byHash[r.hash] = append(t.byHash[r.hash], r)
		t.setDeadline(r, now.Add(t.cfg.EventWait))
		t.applyEarly(r, now)
	}
	return nil
}

func (t *Table) knownHash(transferID string) (string, bool) {
	if r := t.records[transferID]; r != nil {
		return r.hash, true
	}
	if ts, ok := t.tombs[transferID]; ok {
		return ts.hash, true
	}
	return "", false
}

// OnEvent applies one shard's event. Events are facts from other processes,
// so nothing here fails: an event that does not fit is counted and dropped.
func (t *Table) OnEvent(ev Event, now time.Time) { t.OnEvents([]Event{ev}, now) }

// OnEvents applies the events of one message (a shard's flush), in order,
// in one step: deadlines due at now are applied once, before the first,
// and each event then as OnEvent would. What they cause waits for Ready,
// as for every input.
func (t *Table) OnEvents(evs []Event, now time.Time) {
	t.advance(now)
	t.eventSteps++
	for _, ev := range evs {
		t.applyOne(ev, now)
	}
}

func (t *Table) applyOne(ev Event, now time.Time) {
	if ev.Gone {
		t.onGone(ev, now)
		return
	}
	if ev.Shard < 0 || ev.Shard >= t.cfg.Shards || ev.TransferID == "" || ev.MMHash == "" {
		t.ignoredEvents++
		return
	}
	if r := t.records[ev.TransferID]; r != nil {
		t.applyEvent(r, ev, now)
		return
	}
	if _, ok := t.tombs[ev.TransferID]; ok {
		t.ignoredEvents++
		return
	}
	t.keepEarly(ev, now)
}

func (t *Table) applyEvent(r *record, ev Event, now time.Time) {
	if ev.MMHash != r.hash {
		t.ignoredEvents++
		return
	}
	if !ev.Ready {
		t.fail(r, shardReason(ev), now)
		return
	}
	if !sameSize(&r.nbytes, ev.NBytes) {
		t.ignoredEvents++
		return
	}
	r.shards.add(ev.Shard)
	if r.state == WaitingEvent && r.shards.count() == t.cfg.Shards {
		t.move(r, Available, now, "")
	}
}

// onGone ends every record of the content that relied on the shard's
// copy: those the shard had reported ready. A shard's events arrive in
// order and it holds at most one ready copy of a hash at a time, so every
// such report came from the copy that just ended, and reports of a later
// copy come after this event. Records not yet reported ready by the shard
// wait for a push that will land in a new copy, so they stay.
//
// An item is available only when every shard holds it, so one shard's
// loss is enough: the content stops being offered (Has), a request still
// waiting fails now (retryable) instead of at its deadline, and a load
// cannot be started against bytes a shard no longer has.
func (t *Table) onGone(ev Event, now time.Time) {
	if ev.Shard < 0 || ev.Shard >= t.cfg.Shards || ev.MMHash == "" {
		t.ignoredEvents++
		return
	}
	reason := fmt.Sprintf("shard %d no longer holds %s", ev.Shard, ev.MMHash)
	if ev.Reason != "" {
		reason += ": " + ev.Reason
	}
	// fail edits byHash[ev.MMHash], so pick the records first.
	var doomed []*record
	for _, r := range t.byHash[ev.MMHash] {
		if r.shards.has(ev.Shard) {
			doomed = append(doomed, r)
		}
	}
	for _, r := range doomed {
		t.fail(r, reason, now)
	}
	// Early events of the content that this shard reported ready came
	// from the same copy: their transfer, once expected, would otherwise
	// look available.
	for _, e := range t.earlyOf[ev.MMHash] {
		if e.shards.has(ev.Shard) {
			e.shards.remove(ev.Shard)
			if e.reason == "" {
				e.reason = reason
			}
		}
	}
}

// sameSize records the first size a shard reports and checks later ones
// against it: every shard holds the whole item.
func sameSize(have *uint64, got uint64) bool {
	switch {
	case got == 0 || *have == got:
		return true
	case *have == 0:
		*have = got
		return true
	}
	return false
}

func shardReason(ev Event) string {
	if ev.Reason == "" {
		return fmt.Sprintf("shard %d reported failure", ev.Shard)
	}
	return fmt.Sprintf("shard %d: %s", ev.Shard, ev.Reason)
}

// fail ends a live record after a shard reported it gone; the target state
// depends on how far the transfer got.
func (t *Table) fail(r *record, reason string, now time.Time) {
	switch r.state {
	case WaitingEvent, Loading:
		t.move(r, Unavailable, now, reason)
	default:
		t.move(r, Expired, now, reason)
	}
}

// ShardLost ends every live transfer because the shard stopped answering:
// every item lies (or was to land) on every shard, so none can be loaded
// or arrive now. Those that were available expire, the others become
// unavailable, and the requests waiting for them fail (retryable). Early
// events the shard sent are forgotten with it.
func (t *Table) ShardLost(shard int, reason string, now time.Time) {
	t.dropShard(shard, reason, now, func(*record) bool { return true })
}

// ShardRestarted ends the live transfers whose bytes the shard had
// reported ready: its new incarnation does not hold them. Transfers still
// waiting for the shard's word stay, since their push may reach the new
// incarnation.
func (t *Table) ShardRestarted(shard int, reason string, now time.Time) {
	t.dropShard(shard, reason, now, func(r *record) bool { return r.shards.has(shard) })
}

func (t *Table) dropShard(shard int, reason string, now time.Time, gone func(*record) bool) {
	t.advance(now)
	if shard < 0 || shard >= t.cfg.Shards {
		return
	}
	var doomed []*record
	for _, r := range t.records {
		if gone(r) {
			doomed = append(doomed, r)
		}
	}
	// In id order, so that the failures come out in a stable order.
	slices.SortFunc(doomed, func(a, b *record) int { return strings.Compare(a.id, b.id) })
	for _, r := range doomed {
		t.fail(r, reason, now)
	}
	for _, e := range t.early {
		e.shards.remove(shard)
	}
}

// keepEarly holds an event for a transfer no request expects yet: the
// producer can finish a push before the proxy's rewritten request reaches
// this engine.
func (t *Table) keepEarly(ev Event, now time.Time) {
	e := t.early[ev.TransferID]
	if e == nil {
		for len(t.early) >= t.cfg.MaxEarlyEvents {
			t.dropOldestEarly()
		}
		t.seq++
		e = &early{hash: ev.MMHash, shards: newShardSet(t.cfg.Shards), expires: now.Add(t.cfg.EventWait), seq: t.seq}
		t.putEarly(ev.TransferID, e)
		t.earlyQ = append(t.earlyQ, queued{ev.TransferID, e.seq})
		t.compactEarlyQ()
	}
	if e.hash != ev.MMHash {
		t.ignoredEvents++
		return
	}
	if !ev.Ready {
		if e.reason == "" {
			e.reason = shardReason(ev)
		}
		e.events++
		return
	}
	if !sameSize(&e.nbytes, ev.NBytes) {
		t.ignoredEvents++
		return
	}
	e.shards.add(ev.Shard)
	e.events++
}

// putEarly files e, the early events of transfer id.
func (t *Table) putEarly(id string, e *early) {
	t.early[id] = e
	of := t.earlyOf[e.hash]
	if of == nil {
		of = make(map[string]*early)
		t.earlyOf[e.hash] = of
	}
	of[id] = e
}

// dropEarly forgets e, the early events of transfer id.
func (t *Table) dropEarly(id string, e *early) {
	delete(t.early, id)
	if of := t.earlyOf[e.hash]; of != nil {
		delete(of, id)
		if len(of) == 0 {
			delete(t.earlyOf, e.hash)
		}
	}
}

func (t *Table) dropOldestEarly() {
	for len(t.earlyQ) > 0 {
		q := t.earlyQ[0]
		t.earlyQ = t.earlyQ[1:]
		if e := t.early[q.id]; e != nil && e.seq == q.seq {
			t.dropEarly(q.id, e)
			t.earlyDropped++
			return
		}
	}
}

func (t *Table) compactEarlyQ() {
	if len(t.earlyQ) <= 2*len(t.early)+64 {
		return
	}
	kept := make([]queued, 0, len(t.early))
	for _, q := range t.earlyQ {
		if e := t.early[q.id]; e != nil && e.seq == q.seq {
			kept = append(kept, q)
		}
	}
	t.earlyQ = kept
}

func (t *Table) applyEarly(r *record, now time.Time) {
	e := t.early[r.id]
	if e == nil {
		return
	}
	t.dropEarly(r.id, e)
	if e.hash != r.hash {
		t.ignoredEvents += uint64(e.events)
		return
	}
	r.nbytes = e.nbytes
	r.shards = e.shards
	switch {
	case e.reason != "":
		t.move(r, Unavailable, now, e.reason)
	case r.shards.count() == t.cfg.Shards:
		t.move(r, Available, now, "")
	}
}

// Has reports whether the content is on every shard through some transfer:
// vLLM's has_cache_item. It reads only; a deadline that passed since the
// last call is applied by the next call that takes a time.
func (t *Table) Has(mmHash string) bool {
	return t.covered(mmHash)
}

func (t *Table) covered(mmHash string) bool {
	for _, r := range t.byHash[mmHash] {
		if r.state.usable() {
			return true
		}
	}
	return false
}

// Ensure reports whether every item of the request can be loaded now, and
// which items will not come. An item counts as there when any transfer of
// its content is, because vLLM's encoder cache is keyed by content. A
// request the table does not know expects nothing and is ready.
func (t *Table) Ensure(requestID string, now time.Time) (ready bool, failed []Failure) {
	t.advance(now)
	req := t.requests[requestID]
	if req == nil {
		return true, nil
	}
	failed = t.failuresOf(req)
	ready = len(failed) == 0
	for _, it := range req.items {
		if !ready {
			break
		}
		ready = t.covered(it.MMHash)
	}
	return ready, failed
}

// Snapshot answers Ensure for every request at once, without the clock of
// a call per request: the contents of their items that are on every shard
// (what Has says of each), and the failures of each request that has any
// (what Failures says). Contents appear once, in no particular order.
func (t *Table) Snapshot(now time.Time) (covered []string, failed map[string][]Failure) {
	t.advance(now)
	seen := make(map[string]struct{})
	for id, req := range t.requests {
		for _, it := range req.items {
			if _, ok := seen[it.MMHash]; ok {
				continue
			}
			seen[it.MMHash] = struct{}{}
			if t.covered(it.MMHash) {
				covered = append(covered, it.MMHash)
			}
		}
		if fs := t.failuresOf(req); len(fs) > 0 {
			if failed == nil {
				failed = make(map[string][]Failure)
			}
			failed[id] = fs
		}
	}
	return covered, failed
}

// failuresOf lists the items that cannot come any more. An item served
// earlier whose content is gone since counts: a preempted request that asks
// again would otherwise wait for a push that already happened.
func (t *Table) failuresOf(req *request) []Failure {
	var out []Failure
	for _, it := range req.items {
		if t.covered(it.MMHash) {
			continue
		}
		if f, ok := req.failed[it.TransferID]; ok {
			out = append(out, f)
			continue
		}
		if _, ok := req.served[it.TransferID]; ok {
			reason := "loaded earlier, no longer on every shard"
			if ts, ok := t.tombs[it.TransferID]; ok {
				reason += fmt.Sprintf(" (%s: %s)", ts.state, ts.reason)
			}
			out = append(out, Failure{RequestID: req.id, TransferID: it.TransferID, MMHash: it.MMHash, Reason: reason, Retryable: true})
		}
	}
	return out
}

// Failures lists the request's items that will not come, in item order.
func (t *Table) Failures(requestID string) []Failure {
	req := t.requests[requestID]
	if req == nil {
		return nil
	}
	return t.failuresOf(req)
}

// StartLoad hands out the transfer this step's worker loads for the
// content. A transfer already loading or loaded is returned again, so vLLM
// asking twice in one step is harmless. Otherwise a fresh Available
// transfer is preferred over a Resident one: it would expire unused, while
// the resident copy stays for later.
func (t *Table) StartLoad(mmHash string, now time.Time) (transferID string, err error) {
	t.advance(now)
	recs := t.byHash[mmHash]
	for _, r := range recs {
		if r.state == Loading || r.state == Ready {
			return r.id, nil
		}
	}
	for _, from := range []State{Available, Resident} {
		for _, r := range recs {
			if r.state == from {
				t.move(r, Loading, now, "")
				return r.id, nil
			}
		}
	}
	states := make([]string, 0, len(recs))
	for _, r := range recs {
		states = append(states, r.id+"="+r.state.String())
	}
	return "", fmt.Errorf("start load %s: %w (transfers: [%s])", mmHash, ErrNotAvailable, strings.Join(states, " "))
}

// Loaded records the outcome of a worker load. A report for a transfer that
// is not loading (late, duplicate, or its deadline passed) is counted and
// dropped.
func (t *Table) Loaded(transferID string, ok bool, reason string, now time.Time) {
	t.advance(now)
	r := t.records[transferID]
	if r == nil || r.state != Loading {
		t.ignoredReports++
		return
	}
	if ok {
		t.move(r, Ready, now, "")
		return
	}
	if reason == "" {
		reason = "worker reported no reason"
	}
	t.move(r, Failed, now, "load failed: "+reason)
}

// Freed records that the engine dropped its encoder-cache entry for the
// content: loaded transfers become resident copies. vLLM also frees
// entries its own encoder computed, so an unknown hash is not an error.
func (t *Table) Freed(mmHash string, now time.Time) {
	t.advance(now)
	for _, r := range t.byHash[mmHash] {
		if r.state == Ready {
			t.move(r, Resident, now, "")
		}
	}
}

// Finish detaches a finished or aborted request. Transfers it alone was
// waiting for are cancelled and handed out by the next Ready, so the
// caller can cancel them on the shards. Loading and loaded transfers stay: a worker may already hold
// a view of their bytes. An available transfer also stays while another
// live request waits for its content: Ensure may have answered that
// request ready from it, and vLLM then loads it in this very step. It is
// cancelled (and handed out) by the Finish of the last request that waits
// for the content, unless a load or its lease ends it first.
func (t *Table) Finish(requestID string, now time.Time) {
	t.advance(now)
	req := t.requests[requestID]
	if req == nil {
		return
	}
	delete(t.requests, requestID)
	t.bump("", requestID)
	var hashes []string
	for _, it := range req.items {
		if ask := t.askers[it.MMHash]; ask != nil {
			delete(ask, requestID)
			if len(ask) == 0 {
				delete(t.askers, it.MMHash)
			}
		}
		if !slices.Contains(hashes, it.MMHash) {
			hashes = append(hashes, it.MMHash)
		}
		if r := t.records[it.TransferID]; r != nil {
			r.detach(requestID)
		}
	}
	// Oldest first, over a copy: cancelling edits byHash.
	for _, h := range hashes {
		for _, r := range slices.Clone(t.byHash[h]) {
			if t.idle(r) {
				t.move(r, Cancelled, now, "request "+requestID+" finished")
				t.cancels = append(t.cancels, r.id)
			}
		}
	}
}

// idle reports whether a record is left for nobody: no request is attached
// and, for an available one, no live request waits for its content either.
// Loading and later records are never idle (see Finish).
func (t *Table) idle(r *record) bool {
	if len(r.requests) > 0 {
		return false
	}
	switch r.state {
	case WaitingEvent:
		return true
	case Available:
		return len(t.askers[r.hash]) == 0
	}
	return false
}

// Effects holds what Ready hands out: the transfers to cancel on the
// shards, in the order the table cancelled them, and the failures of
// requests' items, each once.
type Effects struct {
	// Cancels are the transfers the table cancelled: those a finished
	// request alone waited for, and the other pushes of content that a
	// load served. The caller cancels them on the shards.
	Cancels []string
	// Failures are items that will not come, from deadlines and shard
	// events alike, for requests that still wait for them.
	Failures []Failure
}

// Empty reports whether there is nothing to perform.
func (e Effects) Empty() bool { return len(e.Cancels) == 0 && len(e.Failures) == 0 }

func (r *record) detach(requestID string) bool {
	for i, v := range r.requests {
		if v == requestID {
			r.requests = append(r.requests[:i:i], r.requests[i+1:]...)
			return true
		}
	}
	return false
}

// Tick applies every deadline due at now; what they caused waits for the
// next Ready.
func (t *Table) Tick(now time.Time) { t.advance(now) }

// Ready applies every deadline due at now, then returns the effects that
// arose since the last Ready and forgets them: taking them acknowledges
// them (the protocol of core/fsm). A failure is handed out only if its
// request still waits for the item and no transfer of its content is
// loaded by now.
func (t *Table) Ready(now time.Time) Effects {
	t.advance(now)
	var out []Failure
	for _, p := range t.pending {
		req := t.requests[p.requestID]
		if req == nil {
			continue
		}
		f, ok := req.failed[p.transferID]
		if !ok || t.covered(f.MMHash) {
			continue
		}
		out = append(out, f)
	}
	t.pending = nil
	rd := Effects{Cancels: t.cancels, Failures: out}
	t.cancels = nil
	return rd
}

// NextDeadline returns when Tick or Ready next has work: the earliest
// deadline, or a past time when failures wait to be handed out. Cancels
// arise only from calls (Finish, Loaded), after which the owner takes a
// Ready anyway, so they do not count here.
func (t *Table) NextDeadline() (time.Time, bool) {
	t.pruneDeadlines()
	var best time.Time
	found := false
	consider := func(at time.Time) {
		if !found || at.Before(best) {
			best, found = at, true
		}
	}
	if len(t.deadlines) > 0 {
		consider(t.deadlines[0].at)
	}
	for len(t.earlyQ) > 0 {
		q := t.earlyQ[0]
		if e := t.early[q.id]; e != nil && e.seq == q.seq {
			consider(e.expires)
			break
		}
		t.earlyQ = t.earlyQ[1:]
	}
	if len(t.pending) > 0 {
		consider(t.pending[0].at)
	}
	return best, found
}

// Generation counts the changes that can alter an answer of Has, Ensure,
// Failures or StartLoad: every state change, every request or item that
// Expect adds and every request Finish removes. Events that change no
// state (a shard of several, an early event) leave it alone. It only
// grows, so an owner that remembers answers together with the generation
// they were given at may reuse them for as long as it has not moved: they
// are what the table would answer again, up to deadlines that fall due
// without a call, which the next call that takes a time applies (and
// counts).
func (t *Table) Generation() uint64 { return t.gen }

// Status answers for live transfers and for tombstones.
func (t *Table) Status(transferID string) (State, bool) {
	if r := t.records[transferID]; r != nil {
		return r.state, true
	}
	if ts, ok := t.tombs[transferID]; ok {
		return ts.state, true
	}
	return 0, false
}

// Stats returns a snapshot.
func (t *Table) Stats() Stats {
	s := Stats{
		Records:        make(map[State]int),
		Ended:          make(map[State]uint64),
		Requests:       len(t.requests),
		EarlyEvents:    len(t.early),
		EarlyDropped:   t.earlyDropped,
		IgnoredEvents:  t.ignoredEvents,
		IgnoredReports: t.ignoredReports,
		Collisions:     t.collisions,
		Tombstones:     len(t.tombs),
		EventSteps:     t.eventSteps,
	}
	for _, r := range t.records {
		s.Records[r.state]++
	}
	for st, n := range t.ended {
		if n > 0 {
			s.Ended[State(st)] = n
		}
	}
	return s
}

// advance fires every deadline due at now. Methods that take a time call it
// first, so no answer rests on a deadline that has passed. Early events
// expire in arrival order, which is expiry order as long as time does not
// run backwards.
func (t *Table) advance(now time.Time) {
	for len(t.deadlines) > 0 && !t.deadlines[0].at.After(now) {
		d := t.deadlines.Take()
		if r := t.records[d.id]; r != nil && r.seq == d.seq {
			t.expire(r, now)
		}
	}
	for len(t.earlyQ) > 0 {
		q := t.earlyQ[0]
		e := t.early[q.id]
		if e != nil && e.seq == q.seq {
			if e.expires.After(now) {
				break
			}
			t.dropEarly(q.id, e)
			t.earlyDropped++
		}
		t.earlyQ = t.earlyQ[1:]
	}
}

func (t *Table) expire(r *record, now time.Time) {
	switch r.state {
	case WaitingEvent:
		t.move(r, Unavailable, now, fmt.Sprintf("push did not arrive within %s (%d of %d shards ready)",
			deadlines.Secs(t.cfg.EventWait), r.shards.count(), t.cfg.Shards))
	case Available:
		t.move(r, Expired, now, fmt.Sprintf("not loaded within %s of arriving", deadlines.Secs(t.cfg.AvailableTTL)))
	case Loading:
		t.move(r, Unavailable, now, fmt.Sprintf("load did not finish within %s", deadlines.Secs(t.cfg.LoadWait)))
	case Resident:
		t.move(r, Expired, now, fmt.Sprintf("resident copy expired after %s", deadlines.Secs(t.cfg.ResidentTTL)))
	}
}

// move is the only writer of record.state. Every caller picks the target
// from the current state, so a refused move is a bug in this package: it
// is counted, never panicked on, and CheckInvariants reports it.
func (t *Table) move(r *record, to State, now time.Time, reason string) {
	if err := transition(r.state, to); err != nil {
		t.illegalMoves++
		return
	}
	r.state = to
	t.bump(r.hash, "")
	switch to {
	case Available:
		t.setDeadline(r, now.Add(t.cfg.AvailableTTL))
	case Loading:
		t.setDeadline(r, now.Add(t.cfg.LoadWait))
	case Ready:
		t.clearDeadline(r)
		t.serve(r, now)
	case Resident:
		if t.cfg.ResidentTTL > 0 {
			t.setDeadline(r, now.Add(t.cfg.ResidentTTL))
		} else {
			t.clearDeadline(r)
		}
	default:
		t.retire(r, reason, now)
	}
}

// serve marks the content loaded for every request waiting for it, through
// loaded or another transfer of the same mm_hash: vLLM's encoder cache now
// holds it, and requests no longer depend on what becomes of the transfers.
// The other transfers that were still waiting or available lose their last
// request here, so they are cancelled now (and handed out by Ready):
// Finish would never see them again, and no record outlives its requests.
func (t *Table) serve(loaded *record, now time.Time) {
	var idle []*record
	for _, r := range t.byHash[loaded.hash] {
		for _, rid := range r.requests {
			t.requests[rid].served[r.id] = struct{}{}
		}
		r.requests = nil
		if r != loaded && (r.state == WaitingEvent || r.state == Available) {
			idle = append(idle, r)
		}
	}
	for _, r := range idle {
		t.move(r, Cancelled, now, "another transfer of "+r.hash+" ("+loaded.id+") was loaded")
		t.cancels = append(t.cancels, r.id)
	}
}

// retire turns a terminal record into a tombstone and tells every request
// still attached that its item will not come.
func (t *Table) retire(r *record, reason string, now time.Time) {
	t.clearDeadline(r)
	delete(t.records, r.id)
	list := t.byHash[r.hash]
	for i, x := range list {
		if x == r {
			list = append(list[:i:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(t.byHash, r.hash)
	} else {
		t.byHash[r.hash] = list
	}
	for _, rid := range r.requests {
		req := t.requests[rid]
		req.failed[r.id] = Failure{RequestID: rid, TransferID: r.id, MMHash: r.hash, Reason: reason, Retryable: true}
		t.pending = append(t.pending, pendingFailure{rid, r.id, now})
	}
	r.requests = nil
	t.ended[r.state]++
	t.tombs[r.id] = tombstone{hash: r.hash, state: r.state, reason: reason}
	t.tombQ = append(t.tombQ, r.id)
	for len(t.tombQ) > t.cfg.MaxTombstones {
		delete(t.tombs, t.tombQ[0])
		t.tombQ = t.tombQ[1:]
	}
}

func (t *Table) setDeadline(r *record, at time.Time) {
	t.seq++
	r.seq, r.deadline = t.seq, at
	t.deadlines.Add(deadline{at: at, id: r.id, seq: r.seq})
	if len(t.deadlines) > 2*len(t.records)+64 {
		kept := t.deadlines[:0]
		for _, d := range t.deadlines {
			if t.current(d) {
				kept = append(kept, d)
			}
		}
		t.deadlines = kept
		heap.Init(&t.deadlines)
	}
}

func (t *Table) clearDeadline(r *record) { r.seq, r.deadline = 0, time.Time{} }

func (t *Table) current(d deadline) bool {
	r := t.records[d.id]
	return r != nil && r.seq == d.seq
}

func (t *Table) pruneDeadlines() {
	for len(t.deadlines) > 0 && !t.current(t.deadlines[0]) {
		t.deadlines.Take()
	}
}

// Waiting lists the transfers that have waited in WaitingEvent for at least
// minAge: the runtime asks the shards for their status directly, so that
// an event lost while a socket reconnected costs latency, not a request.
// The order is unspecified.
func (t *Table) Waiting(now time.Time, minAge time.Duration) []string {
	var out []string
	for id, r := range t.records {
		if r.state == WaitingEvent && !r.deadline.IsZero() && !now.Before(r.deadline.Add(-t.cfg.EventWait).Add(minAge)) {
			out = append(out, id)
		}
	}
	return out
}
