package producer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/fsm/push"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/internal/due"
	"github.com/ecmooncake/ecmooncake/core/internal/logqueue"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// ErrClosed is returned by calls on a closed producer.
var ErrClosed = errors.New("producer: closed")

// Options carries what the caller chooses beyond the settings.
type Options struct {
	Transport transport.Transport
	Log       *slog.Logger
	// Links dials the control client of each shard; when nil, ZeroMQ with
	// the security of auth_secret. Its Dial may block (it resolves host
	// names), so the producer never calls it under its lock. The producer
	// closes it.
	Links control.Links
}

// Push is one item to send, as the engine announces it.
type Push struct {
	TransferID string `json:"transfer_id"`
	MMHash     string `json:"mm_hash"`
	NBytes     uint64 `json:"nbytes"`
	// Consumer is the control endpoint of any shard of the consumer.
	Consumer string `json:"consumer"`
	// Meta describes the bytes (dtype, shape); the consumer's engine reads
	// it back when it loads the item.
	Meta string `json:"meta,omitempty"`
}

// Failure is a push that will not arrive, with the reason.
type Failure struct {
	TransferID string `json:"transfer_id"`
	MMHash     string `json:"mm_hash"`
	Dest       string `json:"dest,omitempty"`
	Reason     string `json:"reason"`
}

// Outcomes are what happened since the last Poll.
type Outcomes struct {
	Done     []string        `json:"done"`
	Failed   []Failure       `json:"failed"`
	Released []push.SourceID `json:"released"`
	Pending  bool            `json:"pending"`
}

func (o Outcomes) empty() bool { return len(o.Done)+len(o.Failed)+len(o.Released) == 0 }

// plane is where one shard's data plane listens, and which incarnation of
// the shard said so.
type plane struct {
	addr  string
	epoch string // empty when the shard did not say
}

// dialing is a control client being opened; callers for the same shard
// wait for the one dial instead of starting their own.
type dialing struct {
	c    control.Caller
	err  error
	done chan struct{} // closed once c or err is set
}

// consumerInfo is one consumer as its shards described it.
type consumerInfo struct {
	dests []string // shard control endpoints, by TP rank
	err   error
	ready chan struct{} // closed once dests or err is set
}

// Producer is safe for concurrent use.
type Producer struct {
	cfg config.Producer
	// log never waits on its writer (logqueue): it is written to under mu.
	log  *slog.Logger
	logs *logqueue.Queue
	// requester is this producer's identity on the wire (128 random bits,
	// hex): shards hand a write grant's token only to the requester that
	// made it, and count quotas per requester.
	requester string
	tr        transport.Transport
	writer    transport.Writer
	links     control.Links

	mu        sync.Mutex // guards everything below; never held across I/O, logging included (see log)
	mgr       *push.Manager
	sources   map[push.SourceID]Source
	nextSrc   push.SourceID
	consumers map[string]*consumerInfo
	// admitting counts, per mm_hash, pushes still waiting for their
	// consumer's lookup; parked holds sources that arrived for them, which
	// the manager would otherwise release at once as unwanted.
	admitting map[string]int
	parked    map[string][]parkedSource
	clients   map[string]control.Caller // by shard control endpoint
	dialing   map[string]*dialing       // clients being opened, by shard control endpoint
	planes    map[string]plane          // by shard control endpoint
	// granted and wrote are when the oldest reserve reply (write batch)
	// from each shard whose write (complete) has not left yet arrived
	// (ended), for timing the driver's hand-offs.
	granted, wrote map[string]time.Time
	out            Outcomes
	outReady       chan struct{} // closed and replaced when out gains something
	roundTrip      uint64
	batches        uint64
	// The standing credit (credit.go): each shard's window, the items
	// carved from one and not yet claimed (by their local ids), and the
	// counters.
	credit      map[string]*creditWindow
	carves      map[ids.ResID]carved
	creditRes   ids.ResID
	credSeen    map[string]creditSeen
	creditAgain bool // a step granted from a window: take the manager's Ready again
	creditStats CreditStats

	steps *due.Loop // the driver's (see advance)
	// life ends at Close: it stops the driver, and control calls and
	// writes in flight return at once instead of at their deadlines.
	// Ended and ended under mu.
	life *due.Life
	wg   sync.WaitGroup

	unwatch func() // detaches the metrics probe
}

// Open starts a producer.
func Open(cfg config.Producer, opt Options) (_ *Producer, err error) {
	defer control.CloseIfFailed(&err, opt.Links)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if opt.Transport == nil {
		return nil, fmt.Errorf("producer: no transport given for %q", cfg.Transport)
	}
	if opt.Log == nil {
		opt.Log = slog.Default()
	}
	links, _, err := control.OpenLinks("producer", cfg.LoadSecret, false, opt.Links, control.WithUnixPath(cfg.ControlUnix))
	if err != nil {
		return nil, err
	}
	requester, err := newRequester()
	if err != nil {
		return nil, err
	}
	wait := cfg.PushWait()
	logs := logqueue.New("producer")
	p := &Producer{
		cfg: cfg, log: slog.New(logs.Handler(opt.Log.Handler())).With("role", "producer"), logs: logs,
		tr: opt.Transport, writer: opt.Transport.NewWriter(), links: links,
		requester: requester,
		mgr: push.New(push.Config{
			ReserveWait: cfg.ControlTimeout() + wait, SourceWait: wait, WriteWait: wait, NotifyWait: cfg.ControlTimeout(),
			CompleteWindow: cfg.CompleteWindow,
		}),
		sources:   map[push.SourceID]Source{},
		consumers: map[string]*consumerInfo{},
		admitting: map[string]int{},
		parked:    map[string][]parkedSource{},
		clients:   map[string]control.Caller{},
		dialing:   map[string]*dialing{},
		planes:    map[string]plane{},
		credit:    map[string]*creditWindow{},
		carves:    map[ids.ResID]carved{},
		credSeen:  map[string]creditSeen{},
		granted:   map[string]time.Time{},
		wrote:     map[string]time.Time{},
		outReady:  make(chan struct{}),
		steps:     due.NewLoop(),
		life:      due.NewLife(),
	}
	p.wg.Add(1)
	go p.driver()
	p.unwatch = metrics.Watch("producer", p.probe)
	return p, nil
}

// Submit announces pushes before their sources exist. It never blocks on
// the network: pushes to a consumer seen for the first time wait, as one
// group, for a background lookup of its shards, so that they still reach
// the manager together and leave as one reserve batch per shard.
func (p *Producer) Submit(pushes []Push) []error {
	errs := make([]error, len(pushes))
	p.mu.Lock()
	defer p.mu.Unlock()
	// Made on first need: a consumer seen before is the common case, and
	// this call runs once a batch.
	var waiting map[*consumerInfo][]Push
	// A batch's pushes mostly name one consumer: its lookup is found once.
	var lastEndpoint string
	var last *consumerInfo
	now := time.Now()
	for i, ps := range pushes {
		switch {
		case p.life.Ended():
			errs[i] = ErrClosed
		case ps.TransferID == "" || ps.MMHash == "":
			errs[i] = fmt.Errorf("producer: push needs transfer_id and mm_hash (got %q, %q)", ps.TransferID, ps.MMHash)
		case ps.NBytes == 0:
			errs[i] = fmt.Errorf("producer: push %s: nbytes is 0", ps.TransferID)
		case ps.Consumer == "":
			errs[i] = fmt.Errorf("producer: push %s: no consumer endpoint", ps.TransferID)
		default:
			ci := last
			if ci == nil || ps.Consumer != lastEndpoint {
				ci = p.consumerLocked(ps.Consumer)
				last, lastEndpoint = ci, ps.Consumer
			}
			select {
			case <-ci.ready:
				errs[i] = p.addLocked(ps, ci, now)
			default:
				if waiting == nil {
					waiting = map[*consumerInfo][]Push{}
				}
				waiting[ci] = append(waiting[ci], ps)
				p.admitting[ps.MMHash]++
			}
		}
	}
	for ci, group := range waiting {
		p.wg.Add(1)
		go p.admit(group, ci)
	}
	p.advanceLocked()
	return errs
}

// addLocked hands one push to the manager once its consumer is known.
func (p *Producer) addLocked(ps Push, ci *consumerInfo, now time.Time) error {
	if ci.err != nil {
		return fmt.Errorf("producer: push %s: %w", ps.TransferID, ci.err)
	}
	return p.mgr.Add(push.Push{TransferID: ps.TransferID, MMHash: ps.MMHash, NBytes: ps.NBytes, Dests: ci.dests, Meta: ps.Meta}, now)
}

// admit waits for the consumer's shards to be known and adds the group.
// Errors surface through Poll, since Submit has already returned.
func (p *Producer) admit(group []Push, ci *consumerInfo) {
	defer p.wg.Done()
	defer p.recover("admit")
	select {
	case <-ci.ready:
	case <-p.life.Done():
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	for _, ps := range group {
		if err := p.addLocked(ps, ci, now); err != nil {
			p.failLocked(Failure{TransferID: ps.TransferID, MMHash: ps.MMHash, Dest: ps.Consumer, Reason: err.Error()})
		}
		if p.admitting[ps.MMHash]--; p.admitting[ps.MMHash] <= 0 {
			delete(p.admitting, ps.MMHash)
			p.unparkLocked(ps.MMHash, now)
		}
	}
	p.kick()
}

// parkedSource is a source that arrived before its push was admitted.
type parkedSource struct {
	id push.SourceID
	n  uint64
}

// unparkLocked hands parked sources of mmHash to the manager now that
// every push for it has been admitted.
func (p *Producer) unparkLocked(mmHash string, now time.Time) {
	for _, ps := range p.parked[mmHash] {
		if err := p.mgr.SourceReady(mmHash, ps.id, ps.n, now); err != nil {
			// The manager refused it (a size mismatch, say): nothing will
			// read it, so hand it back at once.
			p.log.Warn("source refused", "mm_hash", mmHash, "cause", err)
			p.releaseSourceLocked(ps.id)
			p.out.Released = append(p.out.Released, ps.id)
			p.signalLocked()
		}
	}
	delete(p.parked, mmHash)
}

// consumerLocked returns the consumer's lookup, starting it on first sight.
func (p *Producer) consumerLocked(endpoint string) *consumerInfo {
	if ci, ok := p.consumers[endpoint]; ok {
		return ci
	}
	ci := &consumerInfo{ready: make(chan struct{})}
	p.consumers[endpoint] = ci
	p.wg.Add(1)
	go p.lookup(endpoint, ci)
	return ci
}

// lookup asks one shard for the consumer's layout, then every shard for
// its data-plane address. A failed lookup is forgotten so that the next
// push to that consumer tries again. ci.ready closes on every path, a
// panic included, since admit goroutines wait for it.
func (p *Producer) lookup(endpoint string, ci *consumerInfo) {
	defer p.wg.Done()
	var dests []string
	err := errors.New("lookup ended without an answer")
	defer func() {
		if r := recover(); r != nil {
			err = p.panicked("lookup of "+endpoint, r)
			dests = nil
		}
		p.mu.Lock()
		ci.dests, ci.err = dests, err
		if err != nil {
			if p.consumers[endpoint] == ci {
				delete(p.consumers, endpoint)
			}
			p.log.Warn("consumer lookup failed", "consumer", endpoint, "cause", err)
		}
		p.mu.Unlock()
		close(ci.ready)
	}()
	dests, err = p.describe(endpoint)
}

func (p *Producer) describe(endpoint string) ([]string, error) {
	var first wire.PeersReply
	if err := p.call(endpoint, wire.OpPeers, struct{}{}, &first); err != nil {
		return nil, fmt.Errorf("peers from consumer %s: %w", endpoint, err)
	}
	if len(first.Shards) == 0 || first.TPSize != len(first.Shards) {
		return nil, fmt.Errorf("peers from consumer %s: %d shards for tp_size %d", endpoint, len(first.Shards), first.TPSize)
	}
	dests := make([]string, len(first.Shards))
	planes := make([]plane, len(first.Shards))
	errs := make([]error, len(first.Shards))
	var wg sync.WaitGroup
	for i, sh := range first.Shards {
		dests[i] = sh.Control
		if len(sh.Data) > 0 {
			planes[i].epoch = sh.Epoch
			planes[i].addr, errs[i] = p.pick(fmt.Sprintf("shard %d", i), sh.Control, first.Host, sh.Data)
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() {
				if r := recover(); r != nil {
					errs[i] = p.panicked(fmt.Sprintf("peers of shard %d at %s", i, sh.Control), r)
				}
			}()
			planes[i], errs[i] = p.askPlane(i, sh.Control)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	p.mu.Lock()
	for i, d := range dests {
		p.planes[d] = planes[i]
	}
	p.mu.Unlock()
	return dests, nil
}

// askPlane asks the shard at control for its own data plane: the one entry
// of its peers reply that carries one, which must be TP rank rank unless
// rank is negative (any).
func (p *Producer) askPlane(rank int, control string) (plane, error) {
	var r wire.PeersReply
	if err := p.call(control, wire.OpPeers, struct{}{}, &r); err != nil {
		return plane{}, fmt.Errorf("peers from shard %d at %s: %w", rank, control, err)
	}
	for _, x := range r.Shards {
		if len(x.Data) > 0 && (rank < 0 || x.Rank == rank) {
			addr, err := p.pick(fmt.Sprintf("shard %d", x.Rank), control, r.Host, x.Data)
			return plane{addr: addr, epoch: x.Epoch}, err
		}
	}
	return plane{}, fmt.Errorf("shard %d at %s offers no data plane (it lists %v)", rank, control, r.Transports)
}

// Source is one encoder output: host memory in Mem, or GPU memory in Dev
// (whose Ready event the producer closes when it releases the source).
type Source struct {
	MMHash string
	Mem    []byte
	Dev    *transport.DeviceSrc
}

// Sources hands over encoder outputs under one lock, so that the writes
// they unblock leave as one batch per destination, launched by this call. Each mem must stay
// valid until Poll reports its id released; ids[i] is 0 where errs[i] is
// set.
func (p *Producer) Sources(srcs []Source) (ids []push.SourceID, errs []error) {
	ids = make([]push.SourceID, len(srcs))
	errs = make([]error, len(srcs))
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	for i, s := range srcs {
		if p.life.Ended() {
			errs[i] = ErrClosed
			continue
		}
		if s.size() == 0 {
			errs[i] = fmt.Errorf("producer: source for %s is empty", s.MMHash)
			continue
		}
		p.nextSrc++
		id := p.nextSrc
		p.sources[id] = s
		if p.admitting[s.MMHash] > 0 {
			p.parked[s.MMHash] = append(p.parked[s.MMHash], parkedSource{id: id, n: s.size()})
			ids[i] = id
			continue
		}
		if err := p.mgr.SourceReady(s.MMHash, id, s.size(), now); err != nil {
			delete(p.sources, id)
			errs[i] = fmt.Errorf("producer: source for %s: %w", s.MMHash, err)
			continue
		}
		ids[i] = id
	}
	// The step runs here, as Submit's does: the writes these sources
	// unblock start on their batch goroutines now, without a hand-off to
	// the driver goroutine first (a thread wake-up more per batch).
	p.advanceLocked()
	return ids, errs
}

// Cancel gives up pushes; writes in flight finish first.
func (p *Producer) Cancel(transferIDs []string) {
	p.mu.Lock()
	now := time.Now()
	for _, id := range transferIDs {
		p.mgr.Cancel(id, now)
	}
	p.kick()
	p.mu.Unlock()
}

// Poll returns the outcomes since the last call, waiting up to timeout for
// at least one.
func (p *Producer) Poll(timeout time.Duration) Outcomes {
	deadline := time.Now().Add(timeout)
	for {
		p.mu.Lock()
		if !p.out.empty() || timeout <= 0 || p.life.Ended() || !time.Now().Before(deadline) {
			o := p.out
			o.Pending = p.mgr.Pending()
			p.out = Outcomes{}
			p.mu.Unlock()
			return o
		}
		ch := p.outReady
		p.mu.Unlock()
		t := time.NewTimer(time.Until(deadline))
		select {
		case <-ch:
		case <-t.C:
		}
		t.Stop()
	}
}

// Stats are the producer's counters.
type Stats struct {
	Push          push.Stats `json:"push"`
	Sources       int        `json:"sources_held"`
	RoundTrips    uint64     `json:"control_round_trips"`
	Batches       uint64     `json:"write_batches"`
	Consumers     int        `json:"consumers"`
	Pending       bool       `json:"pending"`
	SourceBytes   uint64     `json:"source_bytes_held"`
	ClientsOpened int        `json:"control_clients"`
	// ControlRefused counts the shards' refusals of this producer's
	// security handshakes, by reason; a producer without the deployment's
	// auth_secret sees them grow.
	ControlRefused map[string]uint64 `json:"control_refused,omitempty"`
	// Credit counts batches that took their regions from a credit window
	// and those that reserved, and refused or wasted claims.
	Credit CreditStats `json:"credit"`
	// Phases are this process's timings of the readiness path (package
	// metrics): the copies and their event wait, write batches, and each
	// complete's hand-off and round trip.
	Phases map[string]metrics.PhaseStat `json:"phases,omitempty"`
}

// Stats returns a snapshot.
func (p *Producer) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := Stats{Push: p.mgr.Stats(), Sources: len(p.sources), RoundTrips: p.roundTrip, Batches: p.batches,
		Consumers: len(p.consumers), Pending: p.mgr.Pending(), ClientsOpened: len(p.clients), Phases: metrics.Phases(),
		Credit: p.creditStats}
	for _, m := range p.sources {
		st.SourceBytes += m.size()
	}
	if rc, ok := p.links.(control.RefusalCounter); ok {
		st.ControlRefused = rc.Refused()
	}
	return st
}

// Status reports the state of a push on each of its destinations, live or
// remembered in the push manager's tombstones.
func (p *Producer) Status(transferID string) (map[string]push.State, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mgr.Status(transferID)
}

// Close fails what is pending, stops every goroutine and closes sockets.
// After Close returns no source is read again.
func (p *Producer) Close() error {
	p.mu.Lock()
	ended := p.life.End()
	p.mu.Unlock()
	if !ended {
		return nil
	}
	p.unwatch()
	// Writes in flight read sources: close the writer first so they fail
	// now instead of at their deadline, then wait for every goroutine.
	errs := []error{p.writer.Close()}
	p.mu.Lock()
	for _, c := range p.clients {
		errs = append(errs, c.Close())
	}
	p.mu.Unlock()
	p.wg.Wait()
	p.mu.Lock()
	p.clients = map[string]control.Caller{}
	for id := range p.sources {
		p.releaseSourceLocked(id)
	}
	p.mu.Unlock()
	errs = append(errs, p.links.Close())
	p.logs.Close()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("producer: close: %w", err)
	}
	return nil
}

func (p *Producer) kick() { p.steps.Wake() }

func (p *Producer) recover(what string) {
	if r := recover(); r != nil {
		_ = p.panicked(what, r)
	}
}

// panicked logs a recovered panic and turns it into the error that the
// work it interrupted reports.
func (p *Producer) panicked(what string, r any) error {
	p.log.Error("producer: recovered panic", "in", what, "panic", r)
	return fmt.Errorf("producer: internal error in %s: %v", what, r)
}

// failLocked records a failure for Poll.
func (p *Producer) failLocked(f Failure) {
	p.log.Warn("push failed", "transfer_id", f.TransferID, "mm_hash", f.MMHash, "peer", f.Dest, "cause", f.Reason)
	p.out.Failed = append(p.out.Failed, f)
	metrics.Failed("producer", metrics.Reason(f.Reason))
	p.signalLocked()
}

func (p *Producer) signalLocked() {
	close(p.outReady)
	p.outReady = make(chan struct{})
}

// client returns the DEALER for a shard, dialling it once. The dial runs
// outside the lock (it may resolve a host name for seconds), so a slow
// shard never holds up calls that concern other consumers; callers for the
// same shard wait for that one dial, or for ctx.
func (p *Producer) client(ctx context.Context, endpoint string) (control.Caller, error) {
	p.mu.Lock()
	if p.life.Ended() {
		p.mu.Unlock()
		return nil, ErrClosed
	}
	if c, ok := p.clients[endpoint]; ok {
		p.mu.Unlock()
		return c, nil
	}
	d, waiting := p.dialing[endpoint]
	if !waiting {
		d = &dialing{done: make(chan struct{})}
		p.dialing[endpoint] = d
		p.wg.Add(1)
		go p.dialShard(endpoint, d)
	}
	p.mu.Unlock()
	select {
	case <-d.done:
		return d.c, d.err
	case <-ctx.Done():
		return nil, fmt.Errorf("dial %s: %w", endpoint, ctx.Err())
	}
}

// dialShard opens one shard's client for every caller waiting in client;
// d.done closes on every path.
func (p *Producer) dialShard(endpoint string, d *dialing) {
	defer p.wg.Done()
	var c control.Caller
	err := errors.New("dial ended without an answer")
	defer func() {
		if r := recover(); r != nil {
			c, err = nil, p.panicked("dial "+endpoint, r)
		}
		p.mu.Lock()
		delete(p.dialing, endpoint)
		switch {
		case err != nil:
			err = fmt.Errorf("dial %s: %w", endpoint, err)
		case p.life.Ended():
			// Close has already closed the clients it knew of.
			_ = c.Close()
			c, err = nil, ErrClosed
		default:
			p.clients[endpoint] = c
		}
		d.c, d.err = c, err
		p.mu.Unlock()
		close(d.done)
	}()
	c, err = p.links.Dial(endpoint, p.log)
}

// call makes one control round trip. A call that got no answer (timeout,
// closed socket) drops what the producer knew about the shard's consumer:
// the shard may have restarted on a new data plane. A refusal in the
// reply does not: the shard answered, so it is alive.
func (p *Producer) call(endpoint string, op wire.Op, body, out any) error {
	ctx, cancel := context.WithTimeout(p.life, p.cfg.ControlTimeout())
	defer cancel()
	c, err := p.client(ctx, endpoint)
	if err != nil {
		return err
	}
	start := time.Now()
	err = c.Call(ctx, op, body, out)
	metrics.RoundTrip(string(op), time.Since(start), err)
	var refused *wire.Error
	p.mu.Lock()
	p.roundTrip++
	if err != nil && !errors.As(err, &refused) && !p.life.Ended() {
		p.forgetLocked(endpoint)
	}
	p.mu.Unlock()
	return err
}

// newRequester draws a producer's identity. Unguessable, so that nobody
// can ask for another producer's grant in its name.
func newRequester() (string, error) {
	var b [wire.RequesterLen / 2]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("producer: requester identity: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}
