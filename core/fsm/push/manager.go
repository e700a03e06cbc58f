package push

import (
	"container/heap"
	"fmt"
	"hash/maphash"
	"slices"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/internal/deadlines"
	"github.com/ecmooncake/ecmooncake/core/internal/defaults"
)

// Defaults for the zero fields of Config.
const (
	DefaultReserveWait   = 30 * time.Second // control_timeout_s
	DefaultSourceWait    = 60 * time.Second
	DefaultWriteWait     = 60 * time.Second
	DefaultNotifyWait    = 30 * time.Second
	DefaultMaxTombstones = 65536
	// DefaultCompleteWindow is above the largest batch an engine step
	// hands over, so that one batch's completes always go out together,
	// and small enough that a shard that stopped answering holds few.
	DefaultCompleteWindow = 1024
)

// Config times and sizes a Manager; zero (or negative) fields take the
// defaults.
type Config struct {
	ReserveWait   time.Duration // Reserving: until the grant
	SourceWait    time.Duration // WaitingInputs: until the encoder output
	WriteWait     time.Duration // Writing and CancelPending: until the write finishes
	NotifyWait    time.Duration // Notifying: until the complete is acknowledged
	MaxTombstones int
	// CompleteWindow bounds, per destination, the completes handed out
	// and not yet acknowledged; the rest wait in Notifying for a place.
	CompleteWindow int
}

func (c Config) withDefaults() Config {
	defaults.Positive(&c.ReserveWait, DefaultReserveWait)
	defaults.Positive(&c.SourceWait, DefaultSourceWait)
	defaults.Positive(&c.WriteWait, DefaultWriteWait)
	defaults.Positive(&c.NotifyWait, DefaultNotifyWait)
	defaults.Positive(&c.MaxTombstones, DefaultMaxTombstones)
	defaults.Positive(&c.CompleteWindow, DefaultCompleteWindow)
	return c
}

// Push announces one transfer: NBytes of content MMHash go to every one of
// Dests, each an opaque key for one consumer shard.
type Push struct {
	TransferID string
	MMHash     string
	NBytes     uint64
	Dests      []string
	Meta       string // opaque description of the bytes, carried to the consumer
}

// Grant kinds, as a consumer shard answers a reservation.
const (
	KindWrite  = "write"  // a region was reserved: write into it, then complete
	KindFollow = "follow" // another writer is filling the same content: nothing to do
	KindCached = "cached" // the shard already holds the content: nothing to do
)

// Grant is a shard's answer to one reservation. Err set means refused.
type Grant struct {
	Kind   string
	Res    ids.ResID
	Token  ids.Token
	NBytes uint64
	// Addr is the region's remote address on a one-sided data plane.
	Addr uint64
	// Plane is opaque to the manager: the data-plane address of the shard
	// incarnation that issued the grant, carried to its Write so that the
	// bytes go to that process and no other.
	Plane string
	Err   string
	// Provisional: the runtime granted the region itself, from a shard's
	// standing credit, and the shard rules on it only when the bytes are
	// claimed: until this record's write ends the shard may yet make it
	// follow another push's write, so that write is not given up.
	Provisional bool
}

// SourceID names one encoder output buffer held by the runtime. Zero is
// never valid.
type SourceID uint64

// ReserveItem asks a shard for a region.
type ReserveItem struct {
	TransferID string
	MMHash     string
	NBytes     uint64
	Meta       string
}

// Write copies a source into a granted region.
type Write struct {
	TransferID string
	MMHash     string
	Res        ids.ResID
	Token      ids.Token
	Src        SourceID
	NBytes     uint64
	Addr       uint64 // the grant's remote address, for one-sided data planes
	Plane      string // the grant's Plane: where the issuing shard's data plane listens
}

// Complete tells a shard that a region holds its bytes.
type Complete struct {
	TransferID string
	Res        ids.ResID
	Token      ids.Token
	MMHash     string // the content, for the trace of its path (core/trace)
}

// Cancel tells a shard to free a region.
type Cancel struct {
	TransferID string
	Res        ids.ResID
	Token      ids.Token
}

// Failure reports that the push of a transfer to one destination failed.
type Failure struct {
	TransferID string
	MMHash     string
	Dest       string
	Reason     string
}

// Effects holds what Ready hands out to perform now. Maps are keyed by
// destination and each slice is one batch for that destination; every
// effect appears in exactly one Effects. Fields are nil when empty.
type Effects struct {
	Reserves  map[string][]ReserveItem
	Writes    map[string][]Write
	Completes map[string][]Complete
	Cancels   map[string][]Cancel
	Releases  []SourceID // sources no push needs any more: free them
	Failures  []Failure
	Done      []string // transfer_ids done on every destination
}

// Empty reports whether there is nothing to perform.
func (r Effects) Empty() bool {
	return len(r.Reserves) == 0 && len(r.Writes) == 0 && len(r.Completes) == 0 &&
		len(r.Cancels) == 0 && len(r.Releases) == 0 && len(r.Failures) == 0 && len(r.Done) == 0
}

// Stats is a snapshot for metrics.
type Stats struct {
	Records    map[State]int    // records of live transfers by state
	Ended      map[State]uint64 // records that reached each terminal state, since New
	Transfers  int              // live transfers
	Sources    int              // sources held
	InFlight   int              // writes handed out and not yet reported
	Ignored    uint64           // grants and reports that matched no record in a state to take them
	CancelsOut int              // cancels not yet answered: their content's reservations to that shard wait
	Unanswered int              // ended records whose reservation is still out: their content's reservations to that shard wait
	Collisions uint64
	Tombstones int
	// CompletesOut are completes handed out and not yet acknowledged (nor
	// ended by their record's deadline); each holds a place in its
	// destination's window, and none holds a source.
	CompletesOut int
	// CompletesFailed counts completes that came back refused or whose
	// call failed: each failed its push, after its source was released.
	CompletesFailed uint64
	// WindowWaits counts completes that had to wait for a place in their
	// destination's window, once each.
	WindowWaits uint64
	// WaitsExtended counts the writes that went on waiting for their
	// source past their own SourceWait, for another push of their content:
	// one that joined them as a follower later, or one whose reservation
	// was out when the wait ran out (see noteFollower and overdueAt).
	// Each is counted once, when its wait ends (source, cancel or
	// failure); without the extension each would have failed at its own
	// deadline and taken the shard's followers of its region with it.
	WaitsExtended uint64
}

// Manager is the producer's push manager. It is not safe for concurrent
// use: its owner serialises calls.
type Manager struct {
	cfg Config

	transfers map[string]*transfer // live, by transfer_id
	contents  map[string]*content  // by mm_hash
	tombs     tombstones
	seed      maphash.Seed // of tomb keys and digests

	deadlines deadlineHeap
	seq       uint64

	// effects waiting for the next Ready, in the order they arose
	reserveQ  []*rec
	writeQ    []*rec
	completeQ []*rec
	cancels   []destCancel
	// cancelsOut are the Cancels queued or handed out and not yet
	// answered (CancelDone), each naming its content; abandoning counts
	// them by shard and content, and holds back the reservations of that
	// content to that shard.
	cancelsOut map[destTID]string
	abandoning map[destHash]int
	// unanswered counts, by shard and content, the records that ended
	// while their reservation was out and unanswered (rec.unanswered):
	// the shard may have given them a region that their late grant's
	// Cancel gives up, so those reservations wait for that answer too.
	unanswered map[destHash]int
	// completesOut counts, by destination, the records whose complete is
	// out and unacknowledged (rec.completeOut); at CompleteWindow the
	// destination's next completes wait in completeQ.
	completesOut map[string]int
	failures     []Failure
	done         []string
	releases     []SourceID
	check        []string // mm_hashes whose source may have become unneeded
	checkSet     map[string]struct{}

	liveRecs     int // records not terminal, to size the deadline heap
	held         int // contents holding a source
	ended        [numStates]uint64
	ignored      uint64
	collisions   uint64
	illegalMoves uint64
	windowWaits  uint64
	completesBad uint64
	extended     uint64
}

type transfer struct {
	push     Push
	recs     []*rec // one per destination, in Dests order
	live     int    // records not terminal
	inFlight int    // records whose write is out
}

// soloTransfer is a push to one destination (a consumer of one shard,
// the common case) with its record, record list and destination list:
// one allocation a push instead of four.
type soloTransfer struct {
	tr    transfer
	rec   [1]rec
	recs  [1]*rec
	dests [1]string
}

// newTransfer returns p's transfer, holding its own copy of p.Dests, with
// no records yet, and the zeroed records to fill (one per destination).
func newTransfer(p Push) (*transfer, []rec) {
	if len(p.Dests) == 1 {
		s := &soloTransfer{}
		s.dests[0] = p.Dests[0]
		p.Dests = s.dests[:]
		s.tr = transfer{push: p, live: 1, recs: s.recs[:0]}
		return &s.tr, s.rec[:]
	}
	p.Dests = slices.Clone(p.Dests)
	tr := &transfer{push: p, live: len(p.Dests), recs: make([]*rec, 0, len(p.Dests))}
	// One allocation for the records of a push, not one each.
	return tr, make([]rec, len(p.Dests))
}

type rec struct {
	tr       *transfer
	dest     string
	state    State
	grant    Grant
	hasGrant bool // holds a region on the shard that a cancel must free
	// followed says another push of the content got a follow grant from
	// this record's shard: the shard joined it to this record's write, so
	// cancelling this push must not cancel that write.
	followed bool
	// asked says Ready handed the reservation out: the shard may already
	// have answered it, and made another push of the content follow it.
	asked bool
	// answered says Granted applied the shard's answer to that reservation.
	answered bool
	// unanswered says the record ended (cancelled, or failed at its
	// deadline) while its reservation was out and unanswered; it is
	// counted in Manager.unanswered until the answer comes or the record
	// is forgotten.
	unanswered bool
	// cancelWanted says Cancel was asked while another push of the content
	// follows this record's write, or may come to: the cancel waits until
	// it can no longer cost that push its image (settle).
	cancelWanted bool
	// overdue says the record's wait for its source ran out while another
	// push of the content had its reservation out to the same shard: the
	// shard may have joined that push to this write, so the record waits
	// for that answer (overdueAt) before it fails.
	overdue bool
	// sourceDue is when the record's own wait for its source ends
	// (SourceWait from its write grant); its deadline may lie later.
	sourceDue time.Time
	inFlight  bool // a write reading src is out; may outlive the record's failure
	src       SourceID
	queued    bool // in writeQ
	// completeOut says Ready handed the complete out and no outcome came
	// back yet: the record holds a place in its destination's window.
	completeOut bool
	waited      bool // its complete waited for a place in the window
	deadline    time.Time
	seq         uint64 // seq of the current deadline entry; 0 when none
}

// content is what the manager knows about one mm_hash: its live pushes and
// the one source they share.
type content struct {
	nbytes    uint64
	transfers []*transfer // live, in Add order
	waiters   int         // records in a state that needsSource
	readers   int         // records with a write in flight
	src       SourceID    // 0 when none is held
	srcBytes  uint64
}

type destCancel struct {
	dest string
	c    Cancel
}

type destTID struct{ dest, tid string }

type destHash struct{ dest, mmHash string }

// New returns an empty manager.
func New(cfg Config) *Manager {
	return &Manager{
		cfg:       cfg.withDefaults(),
		transfers: make(map[string]*transfer),
		contents:  make(map[string]*content),
		tombs:     newTombstones(),
		seed:      maphash.MakeSeed(),
		checkSet:  make(map[string]struct{}),

		cancelsOut: make(map[destTID]string),
		abandoning: make(map[destHash]int),
		unanswered: make(map[destHash]int),

		completesOut: make(map[string]int),
	}
}

// Add announces a push; its reservations go out at the next Ready. The
// same push again is harmless (even after it ended); a transfer_id that
// names another push, or content announced with another size, is refused
// with ErrCollision and changes nothing.
func (m *Manager) Add(p Push, now time.Time) error {
	m.advance(now)
	if err := validate(p); err != nil {
		return err
	}
	if known := m.transfers[p.TransferID]; known != nil {
		if samePush(known.push, p) {
			return nil
		}
		m.collisions++
		return fmt.Errorf("add %s: %w: already announced as %s", describe(p), ErrCollision, describe(known.push))
	}
	if t, ok := m.tombs.byKey[m.tombKey(p.TransferID)]; ok {
		if t.digest == m.digest(p) {
			return nil
		}
		m.collisions++
		return fmt.Errorf("add %s: %w: already announced, and ended, as another push", describe(p), ErrCollision)
	}
	c := m.contents[p.MMHash]
	if c != nil && c.size() != 0 && c.size() != p.NBytes {
		m.collisions++
		return fmt.Errorf("add %s: %w: mm_hash %s is %d bytes", describe(p), ErrCollision, p.MMHash, c.size())
	}
	if c == nil {
		c = &content{}
		m.contents[p.MMHash] = c
	}
	tr, block := newTransfer(p)
	p = tr.push
	for i, d := range p.Dests {
		r := &block[i]
		*r = rec{tr: tr, dest: d, state: Reserving}
		tr.recs = append(tr.recs, r)
		m.setDeadline(r, now.Add(m.cfg.ReserveWait))
		m.reserveQ = append(m.reserveQ, r)
	}
	m.transfers[p.TransferID] = tr
	m.liveRecs += len(tr.recs)
	c.nbytes = p.NBytes
	c.transfers = append(c.transfers, tr)
	c.waiters += len(tr.recs)
	return nil
}

// smallDests is the longest destination list that validate checks for
// repeats without a map.
const smallDests = 16

func validate(p Push) error {
	switch {
	case p.TransferID == "" || p.MMHash == "":
		return fmt.Errorf("add %s: %w: empty transfer_id or mm_hash", describe(p), ErrInvalid)
	case p.NBytes == 0:
		return fmt.Errorf("add %s: %w: zero bytes", describe(p), ErrInvalid)
	case len(p.Dests) == 0:
		return fmt.Errorf("add %s: %w: no destination", describe(p), ErrInvalid)
	}
	// Destinations are a consumer's shards, usually a handful: comparing
	// each with the ones before it then costs less than a map a push. The
	// map stays for long lists, which a shard's peers reply can make.
	var seen map[string]bool
	if len(p.Dests) > smallDests {
		seen = make(map[string]bool, len(p.Dests))
	}
	for i, d := range p.Dests {
		repeated := seen[d]
		if seen == nil {
			repeated = slices.Contains(p.Dests[:i], d)
		} else {
			seen[d] = true
		}
		if d == "" || repeated {
			return fmt.Errorf("add %s: %w: empty or repeated destination %q", describe(p), ErrInvalid, d)
		}
	}
	return nil
}

func describe(p Push) string {
	return fmt.Sprintf("%s (mm_hash %s, %d bytes, dests %v)", p.TransferID, p.MMHash, p.NBytes, p.Dests)
}

// samePush compares destinations as a set: the engine may list them in
// another order when it repeats an announcement.
func samePush(a, b Push) bool {
	if a.MMHash != b.MMHash || a.NBytes != b.NBytes || a.Meta != b.Meta || len(a.Dests) != len(b.Dests) {
		return false
	}
	x, y := slices.Clone(a.Dests), slices.Clone(b.Dests)
	slices.Sort(x)
	slices.Sort(y)
	return slices.Equal(x, y)
}

// size is the byte count every push and source of the content must have;
// zero while nothing pins it.
func (c *content) size() uint64 {
	switch {
	case len(c.transfers) > 0:
		return c.nbytes
	case c.src != 0:
		return c.srcBytes
	}
	return 0
}

// Granted applies a shard's answer to the reservation of (transferID,
// dest). The answer to a record that ended while its reservation was out
// ends the hold that record kept on its content's reservations to that
// shard; a region it grants is answered with a Cancel (which holds them
// until it is answered in turn), so the shard does not keep a region
// nobody will write. Any other grant that matches no reserving record is
// counted and dropped.
func (m *Manager) Granted(transferID, dest string, g Grant, now time.Time) {
	m.advance(now)
	r := m.find(transferID, dest)
	if r == nil {
		m.ignored++
		return
	}
	if r.state != Reserving {
		if !r.unanswered {
			m.ignored++
			return
		}
		m.answer(r)
		if g.Err == "" && g.Res != 0 {
			r.grant, r.hasGrant = g, true
			m.queueCancel(r)
		}
		return
	}
	r.answered = true
	if g.Err != "" {
		m.move(r, Failed, now, "reserve refused: "+g.Err)
		return
	}
	if g.Res != 0 {
		r.grant, r.hasGrant = g, true
	}
	if r.cancelWanted && (g.Kind == KindFollow || g.Kind == KindCached) {
		// Nothing to write and nobody follows a follower: the cancel asked
		// for earlier takes effect, freeing the region it was granted.
		m.move(r, Cancelled, now, "")
		return
	}
	switch g.Kind {
	case KindFollow:
		m.noteFollower(r, now)
		m.move(r, Done, now, "")
	case KindCached:
		m.move(r, Done, now, "")
	case KindWrite:
		switch {
		case g.Res == 0 || g.Token.IsZero():
			m.move(r, Failed, now, "write grant without reservation id or token")
		case g.NBytes < r.tr.push.NBytes:
			m.move(r, Failed, now, fmt.Sprintf("granted %d bytes for a %d-byte push", g.NBytes, r.tr.push.NBytes))
		default:
			m.move(r, WaitingInputs, now, "")
		}
	default:
		m.move(r, Failed, now, fmt.Sprintf("unknown grant kind %q", g.Kind))
	}
}

// noteFollower marks the write that a follow grant joined: the live write
// record of the same content to the same shard. Replies of two reserve
// batches may come back in either order, so when no such record holds its
// grant yet, the ones whose reservation is out and unanswered are marked:
// the writer is among them. A follow from a region of another producer
// finds none, which is right: that write is not ours.
//
// A marked write still waiting for the source gets the follower's own wait
// for it (SourceWait from now) when that ends later than its own: the
// follower's request hands over the content's source, and this write is
// the one that carries it to the shard. Failing the write at its own,
// earlier deadline would make the shard fail the follower with it (a
// request whose writer was aborted before its encoder ran, and a retry
// that joined that region).
func (m *Manager) noteFollower(follower *rec, now time.Time) {
	var writers, asked []*rec
	for _, r := range m.peers(follower) {
		switch {
		case r.hasGrant && r.grant.Kind == KindWrite:
			writers = append(writers, r)
		case r.state == Reserving && r.asked:
			asked = append(asked, r)
		}
	}
	if len(writers) == 0 {
		writers = asked
	}
	for _, r := range writers {
		r.followed = true
		if r.state == WaitingInputs {
			r.overdue = false
			if at := now.Add(m.cfg.SourceWait); at.After(r.deadline) {
				m.setDeadline(r, at)
			}
		}
	}
}

// peers returns the live records of other pushes of r's content to r's
// shard.
func (m *Manager) peers(r *rec) []*rec {
	c := m.contents[r.tr.push.MMHash]
	if c == nil {
		return nil
	}
	var out []*rec
	for _, tr := range c.transfers {
		for _, x := range tr.recs {
			if x.dest == r.dest && x.tr != r.tr && !x.state.Terminal() {
				out = append(out, x)
			}
		}
	}
	return out
}

// awaitedAt reports whether another push of r's content, not itself being
// cancelled, still waits for its grant from r's shard while r holds a write
// grant or has its own reservation out: the shard makes the later of two
// reservations follow the earlier's write, and the producer cannot yet
// tell which one writes.
func (m *Manager) awaitedAt(r *rec) bool {
	switch {
	case r.state == Reserving && r.asked:
	case !r.state.Terminal() && r.hasGrant && r.grant.Kind == KindWrite:
	default:
		return false
	}
	for _, x := range m.peers(r) {
		if x.state == Reserving && !x.cancelWanted {
			return true
		}
		if x.hasGrant && x.grant.Provisional && !x.cancelWanted {
			return true
		}
	}
	return false
}

// overdueAt reports, for a write whose wait for its source ran out, until
// when it must still wait: the latest reservation deadline of the other
// pushes of its content whose reservation is out to the same shard (asked,
// not answered, not being cancelled). The shard may have made any of them
// follow this write, and giving the write up would fail them; their answer
// says whether they follow (noteFollower) or not (recheckOverdue).
func (m *Manager) overdueAt(r *rec) (time.Time, bool) {
	var at time.Time
	for _, x := range m.peers(r) {
		if x.state == Reserving && x.asked && !x.cancelWanted && x.deadline.After(at) {
			at = x.deadline
		}
	}
	return at, !at.IsZero()
}

// recheckOverdue fails an overdue write once no reservation it waited for
// is out any more and none of them followed it.
func (m *Manager) recheckOverdue(r *rec, now time.Time) {
	if r.overdue && r.state == WaitingInputs {
		if _, wait := m.overdueAt(r); !wait {
			m.expire(r, now)
		}
	}
}

// holdsBack reports whether a reservation of content to a shard must wait:
// a Cancel of a region of that content there is not yet answered, or a
// push of it ended while its reservation there was out (the shard may
// have made a region for it that is about to be given up).
func (m *Manager) holdsBack(dh destHash) bool {
	return m.abandoning[dh] > 0 || m.unanswered[dh] > 0
}

// givingUpAt reports whether another push of r's content was cancelled
// mid-write to r's shard: its region is given up once the write ends, so a
// reservation joined to it now would fail with it.
func (m *Manager) givingUpAt(r *rec) bool {
	for _, x := range m.peers(r) {
		if x.state == CancelPending {
			return true
		}
	}
	return false
}

// SourceReady hands over the encoder output of mmHash. The manager keeps it
// until no push needs it and then returns it in Ready.Releases; a second
// source for content that already has one is not needed and is released
// at the next Ready. A source whose size differs from what the pushes of
// its content announced is refused with ErrSizeMismatch (the caller keeps
// it) and those pushes fail, since no source can satisfy them.
func (m *Manager) SourceReady(mmHash string, src SourceID, nbytes uint64, now time.Time) error {
	m.advance(now)
	if mmHash == "" || src == 0 || nbytes == 0 {
		return fmt.Errorf("source %d for %q (%d bytes): %w: empty mm_hash, zero id or zero bytes", src, mmHash, nbytes, ErrInvalid)
	}
	c := m.contents[mmHash]
	if c != nil && c.src != 0 {
		switch {
		case c.src == src && c.srcBytes == nbytes:
		case c.src == src:
			return fmt.Errorf("source %d for %s: %w: reported with %d bytes, earlier with %d", src, mmHash, ErrSizeMismatch, nbytes, c.srcBytes)
		default:
			m.releases = append(m.releases, src)
		}
		return nil
	}
	if c != nil && len(c.transfers) > 0 && c.nbytes != nbytes {
		reason := fmt.Sprintf("encoder output is %d bytes, push announced %d", nbytes, c.nbytes)
		for _, tr := range slices.Clone(c.transfers) {
			for _, r := range tr.recs {
				if r.state.needsSource() {
					m.move(r, Failed, now, reason)
				}
			}
		}
		return fmt.Errorf("source %d for %s: %w: %s", src, mmHash, ErrSizeMismatch, reason)
	}
	if c == nil {
		c = &content{}
		m.contents[mmHash] = c
	}
	c.src, c.srcBytes = src, nbytes
	m.held++
	m.markCheck(mmHash)
	for _, tr := range c.transfers {
		for _, r := range tr.recs {
			m.queueWrite(r)
		}
	}
	return nil
}

func (m *Manager) queueWrite(r *rec) {
	if r.state == WaitingInputs && !r.queued {
		r.queued = true
		m.writeQ = append(m.writeQ, r)
	}
}

// maxKeptCheck bounds the check list a step keeps for the next.
const maxKeptCheck = 1024

func (m *Manager) markCheck(mmHash string) {
	if _, ok := m.checkSet[mmHash]; !ok {
		m.checkSet[mmHash] = struct{}{}
		m.check = append(m.check, mmHash)
	}
}

// Ready applies the deadlines due at now, then returns the effects to
// perform now and forgets them: taking them acknowledges them (the
// protocol of core/fsm). The caller performs each and reports outcomes
// through Granted, WriteDone, CompleteDone and CancelDone. Writes handed
// out here are in flight until WriteDone.
func (m *Manager) Ready(now time.Time) Effects {
	m.advance(now)
	var out Effects
	held := m.reserveQ[:0]
	for _, r := range m.reserveQ {
		p := r.tr.push
		switch {
		case r.state != Reserving:
		case m.holdsBack(destHash{r.dest, p.MMHash}) || m.givingUpAt(r):
			held = append(held, r)
		default:
			r.asked = true
			out.Reserves = appendSized(out.Reserves, r.dest, ReserveItem{p.TransferID, p.MMHash, p.NBytes, p.Meta}, perDest(m.reserveQ))
		}
	}
	clear(m.reserveQ[len(held):])
	m.reserveQ = held
	if len(m.reserveQ) == 0 {
		m.reserveQ = nil
	}
	for _, r := range m.writeQ {
		r.queued = false
		c := m.contents[r.tr.push.MMHash]
		if r.state != WaitingInputs || c.src == 0 {
			continue
		}
		m.move(r, Writing, now, "")
		r.inFlight, r.src = true, c.src
		r.tr.inFlight++
		c.readers++
		p := r.tr.push
		out.Writes = appendSized(out.Writes, r.dest, Write{p.TransferID, p.MMHash, r.grant.Res, r.grant.Token, c.src, p.NBytes, r.grant.Addr, r.grant.Plane}, perDest(m.writeQ))
	}
	m.writeQ = nil
	waiting := m.completeQ[:0]
	for _, r := range m.completeQ {
		switch {
		case r.state != Notifying:
		case m.completesOut[r.dest] >= m.cfg.CompleteWindow:
			if !r.waited {
				r.waited = true
				m.windowWaits++
			}
			waiting = append(waiting, r)
		default:
			r.completeOut = true
			m.completesOut[r.dest]++
			out.Completes = appendTo(out.Completes, r.dest, Complete{r.tr.push.TransferID, r.grant.Res, r.grant.Token, r.tr.push.MMHash})
		}
	}
	clear(m.completeQ[len(waiting):])
	m.completeQ = waiting
	if len(m.completeQ) == 0 {
		m.completeQ = nil
	}
	for _, dc := range m.cancels {
		out.Cancels = appendTo(out.Cancels, dc.dest, dc.c)
	}
	m.cancels = nil
	for _, h := range m.check {
		delete(m.checkSet, h)
		c := m.contents[h]
		if c != nil && c.src != 0 && c.waiters == 0 && c.readers == 0 {
			m.releases = append(m.releases, c.src)
			c.src, c.srcBytes = 0, 0
			m.held--
			m.dropContent(h)
		}
	}
	// Kept for the next step (a handful of hashes a batch), unless a
	// burst grew it.
	clear(m.check)
	m.check = m.check[:0]
	if cap(m.check) > maxKeptCheck {
		m.check = nil
	}
	out.Releases, m.releases = m.releases, nil
	out.Failures, m.failures = m.failures, nil
	out.Done, m.done = m.done, nil
	return out
}

// appendSized is appendTo for a queue of about hint items a destination:
// a batch's slice is made once, not grown item by item.
func appendSized[T any](m map[string][]T, dest string, v T, hint int) map[string][]T {
	if m == nil {
		m = make(map[string][]T)
	}
	batch, ok := m[dest]
	if !ok {
		batch = make([]T, 0, hint)
	}
	m[dest] = append(batch, v)
	return m
}

// perDest is how many records of q each destination has when every push
// in it goes to the destinations of its first (a batch of pushes to one
// consumer, the common case); elsewhere a batch's slice grows as needed.
func perDest(q []*rec) int {
	if len(q) == 0 {
		return 0
	}
	k := max(len(q[0].tr.recs), 1)
	return (len(q) + k - 1) / k
}

func appendTo[T any](m map[string][]T, dest string, v T) map[string][]T {
	if m == nil {
		m = make(map[string][]T)
	}
	m[dest] = append(m[dest], v)
	return m
}

// WriteDone reports the outcome of a write handed out by Ready. It ends the
// write's hold on its source whatever the record's state, because the
// record may have failed or been cancelled while the write was in flight.
// A write that landed moves on to Notifying, whose complete Ready hands
// out.
func (m *Manager) WriteDone(transferID, dest string, err error, now time.Time) {
	m.writeEnded(transferID, dest, err, false, now)
}

// WriteDoneInBand is WriteDone for a write whose data plane completed it
// in-band (TCP: each frame carried the completion, and the shard made the
// item ready as its last byte landed, before acknowledging it): a write
// that landed ends the record Done, with no complete to send. A write
// cancelled in flight still ends Cancelled; its region is complete at the
// shard, which drops a copy no request wants (its scheduler, its lease).
func (m *Manager) WriteDoneInBand(transferID, dest string, err error, now time.Time) {
	m.writeEnded(transferID, dest, err, true, now)
}

func (m *Manager) writeEnded(transferID, dest string, err error, inBand bool, now time.Time) {
	m.advance(now)
	r := m.find(transferID, dest)
	if r == nil || !r.inFlight {
		m.ignored++
		return
	}
	r.inFlight = false
	r.tr.inFlight--
	c := m.contents[r.tr.push.MMHash]
	c.readers--
	if c.readers == 0 {
		m.markCheck(r.tr.push.MMHash)
	}
	switch {
	case r.state == Writing && err == nil && inBand:
		m.move(r, Done, now, "")
	case r.state == Writing && err == nil:
		m.move(r, Notifying, now, "")
	case r.state == Writing:
		m.move(r, Failed, now, fmt.Sprintf("write failed: %v", err))
	case r.state == CancelPending:
		m.move(r, Cancelled, now, "")
	}
	m.maybeRetire(r.tr)
}

// CompleteDone reports the outcome of a complete handed out by Ready. The
// runtime hands a complete to its link and goes on: the source was
// released when the write ended (the shard holds the bytes), so this
// outcome only ends the record. A refusal (a token or lease the shard no
// longer honours) or a failed call fails the push as a write error would,
// counted in Stats.CompletesFailed, and gives the region up.
func (m *Manager) CompleteDone(transferID, dest string, err error, now time.Time) {
	m.advance(now)
	r := m.find(transferID, dest)
	if r == nil || r.state != Notifying {
		m.ignored++
		return
	}
	if err != nil {
		m.completesBad++
		m.move(r, Failed, now, fmt.Sprintf("complete failed: %v", err))
		return
	}
	m.move(r, Done, now, "")
}

// CancelDone reports that the Cancel of (transferID, dest) handed out by
// Ready was answered by the shard, or that its call failed: either way the
// reservations of its content to that shard, held back meanwhile, go out
// at the next Ready. A report that matches no Cancel out is counted and
// dropped.
func (m *Manager) CancelDone(transferID, dest string, now time.Time) {
	m.advance(now)
	k := destTID{dest, transferID}
	h, ok := m.cancelsOut[k]
	if !ok {
		m.ignored++
		return
	}
	delete(m.cancelsOut, k)
	dh := destHash{dest, h}
	if m.abandoning[dh]--; m.abandoning[dh] <= 0 {
		delete(m.abandoning, dh)
	}
}

// answer ends the hold of an ended record whose reservation was out: its
// answer came, or it was forgotten and no answer can find it any more.
func (m *Manager) answer(r *rec) {
	r.unanswered = false
	dh := destHash{r.dest, r.tr.push.MMHash}
	if m.unanswered[dh]--; m.unanswered[dh] <= 0 {
		delete(m.unanswered, dh)
	}
}

// queueCancel asks the shard to free the region r was granted. Until the
// shard has answered, a reservation of r's content to that shard waits:
// one that overtook the cancel would be joined to the region being given
// up, as a follower, and fail with it.
func (m *Manager) queueCancel(r *rec) {
	p := r.tr.push
	m.cancels = append(m.cancels, destCancel{r.dest, Cancel{p.TransferID, r.grant.Res, r.grant.Token}})
	k := destTID{r.dest, p.TransferID}
	if _, dup := m.cancelsOut[k]; dup {
		return
	}
	m.cancelsOut[k] = p.MMHash
	m.abandoning[destHash{r.dest, p.MMHash}]++
}

// Cancel stops a transfer on every destination where it can still be
// stopped: before the write it ends at once (with a Cancel to a shard that
// granted a region); during the write it waits in CancelPending for the
// write to finish, because the write reads the source. Once the bytes
// landed the push completes anyway. A write that another push of the
// content follows, or may follow (its reservation is on its way to the
// same shard, or both reservations are out and unanswered), goes on: the
// shard fails a follower whose writer gives up, and a request still
// waiting for the image would fail with it. Such a cancel waits (settle)
// and takes effect once the other push's grant shows that it does not
// follow; a followed write ends at its deadlines if no source comes.
func (m *Manager) Cancel(transferID string, now time.Time) {
	m.advance(now)
	tr := m.transfers[transferID]
	if tr == nil {
		return
	}
	for _, r := range tr.recs {
		if !r.state.Terminal() {
			r.cancelWanted = true
			m.settle(r, now)
			// A push being cancelled no longer keeps another's cancel
			// waiting (awaitedAt skips it), even when its own cancel must
			// wait because a follower holds it; nor does it keep an overdue
			// write waiting (overdueAt skips it too).
			for _, x := range m.peers(r) {
				m.settle(x, now)
				m.recheckOverdue(x, now)
			}
		}
	}
}

// settle carries out a cancel that r waits with, unless another push of the
// content follows r's write or still may.
func (m *Manager) settle(r *rec, now time.Time) {
	if !r.cancelWanted || r.state.Terminal() || r.followed || m.awaitedAt(r) {
		return
	}
	r.cancelWanted = false
	switch r.state {
	case Reserving, WaitingInputs:
		m.move(r, Cancelled, now, "")
	case Writing:
		m.move(r, CancelPending, now, "")
	}
}

// Tick applies every deadline due at now; the failures appear in the next
// Ready. Every method that takes a time does the same first.
func (m *Manager) Tick(now time.Time) { m.advance(now) }

// NextDeadline returns the earliest deadline of a live record.
func (m *Manager) NextDeadline() (time.Time, bool) {
	m.pruneDeadlines()
	if len(m.deadlines) == 0 {
		return time.Time{}, false
	}
	return m.deadlines[0].at, true
}

// Pending reports whether anything is left to do or to hand back: a live
// transfer, a held source, effects not yet taken by Ready, or a Cancel not
// yet answered. It answers
// vLLM's has_pending_push_work.
func (m *Manager) Pending() bool {
	if len(m.transfers) > 0 || len(m.reserveQ) > 0 || len(m.writeQ) > 0 || len(m.completeQ) > 0 ||
		len(m.cancels) > 0 || len(m.cancelsOut) > 0 || len(m.failures) > 0 || len(m.done) > 0 || len(m.releases) > 0 {
		return true
	}
	return m.held > 0
}

// Status returns the state per destination of a live or tombstoned
// transfer.
func (m *Manager) Status(transferID string) (map[string]State, bool) {
	tr := m.transfers[transferID]
	if tr == nil {
		return m.tombs.status(m.tombKey(transferID), transferID)
	}
	out := make(map[string]State, len(tr.recs))
	for _, r := range tr.recs {
		out[r.dest] = r.state
	}
	return out, true
}

// Stats returns a snapshot.
func (m *Manager) Stats() Stats {
	s := Stats{
		Records:    make(map[State]int),
		Ended:      make(map[State]uint64),
		Transfers:  len(m.transfers),
		Ignored:    m.ignored,
		Collisions: m.collisions,
		Tombstones: len(m.tombs.byKey),
		Sources:    m.held,
		CancelsOut: len(m.cancelsOut),

		CompletesFailed: m.completesBad,
		WindowWaits:     m.windowWaits,
		WaitsExtended:   m.extended,
	}
	for _, n := range m.completesOut {
		s.CompletesOut += n
	}
	for _, n := range m.unanswered {
		s.Unanswered += n
	}
	for _, tr := range m.transfers {
		for _, r := range tr.recs {
			s.Records[r.state]++
		}
		s.InFlight += tr.inFlight
	}
	for st, n := range m.ended {
		if n > 0 {
			s.Ended[State(st)] = n
		}
	}
	return s
}

func (m *Manager) find(transferID, dest string) *rec {
	tr := m.transfers[transferID]
	if tr == nil {
		// A tombstone keeps its records only while one of them waits for
		// its reservation's answer; any other answer would be ignored.
		if full := m.tombs.full[m.tombKey(transferID)]; full != nil && full.push.TransferID == transferID {
			tr = full
		}
	}
	if tr == nil {
		return nil
	}
	for _, r := range tr.recs {
		if r.dest == dest {
			return r
		}
	}
	return nil
}

func (m *Manager) advance(now time.Time) {
	for len(m.deadlines) > 0 && !m.deadlines[0].at.After(now) {
		d := m.deadlines.Take()
		if d.current() {
			m.expire(d.rec, now)
		}
	}
}

func (m *Manager) expire(r *rec, now time.Time) {
	var what string
	var wait time.Duration
	switch r.state {
	case Reserving:
		what, wait = "no reservation grant", m.cfg.ReserveWait
	case WaitingInputs:
		if at, ok := m.overdueAt(r); ok && at.After(now) {
			r.overdue = true
			m.setDeadline(r, at)
			return
		}
		what, wait = "no encoder output", m.cfg.SourceWait
	case Writing:
		what, wait = "write not finished", m.cfg.WriteWait
	case Notifying:
		what, wait = "complete not acknowledged", m.cfg.NotifyWait
	case CancelPending:
		what, wait = "cancelled write not finished", m.cfg.WriteWait
	default:
		return
	}
	m.move(r, Failed, now, fmt.Sprintf("%s: %s within %s", r.state, what, deadlines.Secs(wait)))
}

// move is the only writer of rec.state. Every caller picks the target from
// the current state, so a refused move is a bug in this package: it is
// counted, never panicked on, and CheckInvariants reports it.
func (m *Manager) move(r *rec, to State, now time.Time, reason string) {
	if err := transition(r.state, to); err != nil {
		m.illegalMoves++
		return
	}
	from := r.state
	r.state = to
	if from == WaitingInputs && r.deadline.After(r.sourceDue) && now.After(r.sourceDue) {
		// It waited past its own wait, for another push of its content.
		m.extended++
	}
	if to != WaitingInputs {
		r.overdue = false
	}
	p := r.tr.push
	if r.completeOut {
		// Acknowledged, refused or out of time: the place in the window is
		// free for the destination's next complete.
		r.completeOut = false
		if m.completesOut[r.dest]--; m.completesOut[r.dest] <= 0 {
			delete(m.completesOut, r.dest)
		}
	}
	if from.needsSource() && !to.needsSource() {
		c := m.contents[p.MMHash]
		c.waiters--
		if c.waiters == 0 {
			m.markCheck(p.MMHash)
		}
	}
	switch to {
	case WaitingInputs:
		r.sourceDue = now.Add(m.cfg.SourceWait)
		m.setDeadline(r, r.sourceDue)
		if m.contents[p.MMHash].src != 0 {
			m.queueWrite(r)
		}
	case Writing:
		m.setDeadline(r, now.Add(m.cfg.WriteWait))
	case Notifying:
		m.setDeadline(r, now.Add(m.cfg.NotifyWait))
		m.completeQ = append(m.completeQ, r)
	case CancelPending:
		// The write it waits for keeps the deadline it had.
	default:
		m.end(r, reason)
	}
	if from == Reserving || (r.hasGrant && r.grant.Provisional && r.state.Terminal()) {
		// r has its answer and one fewer push waits for a grant from r's
		// shard: a cancel that waited for either may now take effect, and
		// a write whose wait ran out while r's reservation was out fails
		// unless r now follows it.
		m.settle(r, now)
		for _, x := range m.peers(r) {
			m.settle(x, now)
			m.recheckOverdue(x, now)
		}
	}
}

// end finishes a record that reached a terminal state.
func (m *Manager) end(r *rec, reason string) {
	r.seq, r.deadline = 0, time.Time{}
	m.liveRecs--
	m.ended[r.state]++
	p := r.tr.push
	if r.state == Failed {
		m.failures = append(m.failures, Failure{p.TransferID, p.MMHash, r.dest, reason})
	}
	if r.state != Done && r.hasGrant {
		m.queueCancel(r)
	}
	if r.asked && !r.answered && !r.hasGrant {
		r.unanswered = true
		m.unanswered[destHash{r.dest, p.MMHash}]++
	}
	tr := r.tr
	tr.live--
	if tr.live == 0 && !slices.ContainsFunc(tr.recs, func(x *rec) bool { return x.state != Done }) {
		m.done = append(m.done, p.TransferID)
	}
	m.maybeRetire(tr)
}

// maybeRetire turns a transfer into a tombstone once every record ended and
// no write of it is in flight; until then its source stays held.
func (m *Manager) maybeRetire(tr *transfer) {
	if tr.live > 0 || tr.inFlight > 0 {
		return
	}
	if _, live := m.transfers[tr.push.TransferID]; !live {
		return
	}
	delete(m.transfers, tr.push.TransferID)
	c := m.contents[tr.push.MMHash]
	c.transfers = slices.DeleteFunc(c.transfers, func(x *transfer) bool { return x == tr })
	m.dropContent(tr.push.MMHash)
	m.retire(tr)
}

// digest hashes what samePush compares (destinations as a set), with the
// manager's own seed: an ended push announced again matches its tomb.
// Two pushes that differ share a digest with a chance of 2^-64, and then
// the later one's Add is taken as the same push announced again instead
// of being refused with ErrCollision: a caller that reuses a transfer_id
// for other content after its push ended gets no error, once in 2^64.
func (m *Manager) digest(p Push) uint64 {
	var h maphash.Hash
	h.SetSeed(m.seed)
	h.WriteString(p.MMHash)
	h.WriteByte(0)
	maphash.WriteComparable(&h, p.NBytes)
	h.WriteString(p.Meta)
	h.WriteByte(0)
	dests := p.Dests
	if len(dests) > 1 {
		dests = slices.Clone(dests)
		slices.Sort(dests)
	}
	for _, d := range dests {
		h.WriteString(d)
		h.WriteByte(0)
	}
	return h.Sum64()
}

// dropContent forgets content that has neither pushes nor a source.
func (m *Manager) dropContent(mmHash string) {
	if c := m.contents[mmHash]; c != nil && len(c.transfers) == 0 && c.src == 0 {
		delete(m.contents, mmHash)
	}
}

func (m *Manager) setDeadline(r *rec, at time.Time) {
	m.seq++
	r.seq, r.deadline = m.seq, at
	m.deadlines.Add(deadline{at: at, rec: r, seq: r.seq})
	if len(m.deadlines) > 2*m.liveRecs+64 {
		kept := m.deadlines[:0]
		for _, d := range m.deadlines {
			if d.current() {
				kept = append(kept, d)
			}
		}
		clear(m.deadlines[len(kept):])
		m.deadlines = kept
		heap.Init(&m.deadlines)
	}
}

func (m *Manager) pruneDeadlines() {
	for len(m.deadlines) > 0 && !m.deadlines[0].current() {
		m.deadlines.Take()
	}
}
