package reserve

import (
	"container/list"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/google/btree"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/internal/defaults"
	"github.com/ecmooncake/ecmooncake/core/internal/machine"
)

// Sentinel errors; callers test them with errors.Is. ErrInvalid,
// ErrSizeMismatch, ErrCollision and ErrUnknown are the ones every state
// machine shares (core/internal/machine).
var (
	// ErrInvalid: an item with an empty id or zero size.
	ErrInvalid = machine.ErrInvalid
	// ErrPoolFull: the slab cannot hold the region even after evicting
	// every resident copy.
	ErrPoolFull = errors.New("pool full")
	// ErrSizeMismatch: an mm_hash asked with a size other than its region's.
	ErrSizeMismatch = machine.ErrSizeMismatch
	// ErrCollision: a transfer id already known for another mm_hash.
	ErrCollision = machine.ErrCollision
	// ErrUnknown: an id that was never issued here (or long forgotten).
	ErrUnknown = machine.ErrUnknown
	// ErrGone: the transfer or region is over; a late message is harmless.
	ErrGone = errors.New("gone")
	// ErrBadToken: the token does not authorise this region.
	ErrBadToken = errors.New("bad token")
	// ErrOutOfBounds: a write that does not fit inside its region.
	ErrOutOfBounds = errors.New("out of bounds")
	// ErrNotWritable: the region is not in the Writing state.
	ErrNotWritable = errors.New("not writable")
	// ErrWritesInFlight: Complete while writes have not ended.
	ErrWritesInFlight = errors.New("writes in flight")
	// ErrTorn: a write failed part way; the region must be rewritten whole.
	ErrTorn = errors.New("region torn")
	// ErrNoWrite: an in-band complete that ends no write in flight.
	ErrNoWrite = errors.New("no write in flight")
	// ErrNotReady: Acquire of an mm_hash that is still being written.
	ErrNotReady = errors.New("not ready")
	// ErrNotPinned: Release of an mm_hash that is not acquired.
	ErrNotPinned = errors.New("not pinned")
	// ErrInProgress: a reserve repeating a write grant that another
	// requester holds; it learns nothing else (no region, no token).
	ErrInProgress = errors.New("in progress for another requester")
	// ErrOverQuota: the requester holds its share of pending
	// reservations, bytes or followers, or the transfer its followers.
	ErrOverQuota = errors.New("over quota")
	// ErrNeedsToken: a cancel by transfer id named a write grant, which
	// only its token's holder may end (Abandon).
	ErrNeedsToken = errors.New("a write grant is ended only with its token")
)

// Reasons carried by failure events and Status.
const (
	ReasonCancelled = "cancelled"
	ReasonExpired   = "lease expired"
	ReasonEvicted   = "evicted"
	ReasonAbandoned = "abandoned"
	// ReasonTakenOver: a write whose writer's connection ended, taken over
	// by another requester's reserve of its content (PeerGone).
	ReasonTakenOver = "taken over: its writer's connection ended"
	// ReasonCopyGone: Status of a follower or cached transfer whose
	// content this shard no longer holds ready.
	ReasonCopyGone = "copy gone"
	// ReasonOverQuota: a reservation refused for its requester's quota or
	// its transfer's followers (ErrOverQuota).
	ReasonOverQuota = "over quota"
)

// Defaults applied to zero Config fields.
const (
	DefaultLease         = 300 * time.Second
	DefaultMaxTombstones = 65536
	// DefaultMaxFollowers bounds the transfers waiting on one write: far
	// more than the requests that share one image at once.
	DefaultMaxFollowers = 1024
	// DefaultMaxPendingPerOwner and DefaultMaxFollowersPerOwner bound the
	// records one requester keeps live.
	DefaultMaxPendingPerOwner   = 4096
	DefaultMaxFollowersPerOwner = 4096
	// DefaultMaxOwnersPerPeer bounds the requesters one connection holds
	// records for: a producer sends under one.
	DefaultMaxOwnersPerPeer = 4
	// DefaultCreditLease outlives the gap between a busy producer's
	// batches by far; an idle producer's window goes back to the slab
	// and its next batch reserves (and is granted a window again).
	DefaultCreditLease = 30 * time.Second
)

// Config tunes a Table; zero fields take the defaults.
type Config struct {
	// Lease bounds how long a region may stay Writing, and how long a
	// Ready region may wait for its first Acquire.
	Lease time.Duration
	// MaxTombstones bounds the memory of finished transfers and regions.
	MaxTombstones int
	// MaxResidentBytes caps the slab bytes held by resident copies;
	// 0 means no cap other than the slab itself.
	MaxResidentBytes uint64
	// MaxFollowers bounds the transfers following one write.
	MaxFollowers int
	// MaxPendingPerOwner, MaxPendingBytesPerOwner and
	// MaxFollowersPerOwner bound what one peer (Item.Peer, the
	// authenticated connection) holds at once, whatever requesters it
	// names: regions being written, their bytes, and transfers following
	// others' writes. The bytes default to three quarters of the slab; a
	// peer holding nothing is always allowed one region, so an item
	// larger than its share still fits an idle slab.
	MaxPendingPerOwner      int
	MaxPendingBytesPerOwner uint64
	MaxFollowersPerOwner    int
	// MaxOwnersPerPeer bounds the requesters one peer holds records for
	// at once; one more is refused (ErrOverQuota, counted as
	// QuotaRequesters). It bounds a peer's credit windows too.
	MaxOwnersPerPeer int
	// CreditWindowBytes is the most slab room one requester's credit
	// window may hold (credit.go); 0 grants no credit. It is capped at a
	// quarter of the slab, so that windows never starve reservations.
	CreditWindowBytes uint64
	// CreditLease is how long a window lives past its last renewal.
	CreditLease time.Duration
}

func (c Config) withDefaults(slabSize uint64) Config {
	defaults.Positive(&c.Lease, DefaultLease)
	defaults.Positive(&c.MaxTombstones, DefaultMaxTombstones)
	defaults.Positive(&c.MaxFollowers, DefaultMaxFollowers)
	defaults.Positive(&c.MaxPendingPerOwner, DefaultMaxPendingPerOwner)
	defaults.Positive(&c.MaxFollowersPerOwner, DefaultMaxFollowersPerOwner)
	defaults.Positive(&c.MaxOwnersPerPeer, DefaultMaxOwnersPerPeer)
	defaults.Positive(&c.CreditLease, DefaultCreditLease)
	c.CreditWindowBytes = min(c.CreditWindowBytes, slabSize/4) &^ (slab.Align - 1)
	if c.MaxPendingBytesPerOwner == 0 {
		c.MaxPendingBytesPerOwner = max(slabSize/4*3, 1)
	}
	return c
}

// Item asks for room for one transfer's bytes.
type Item struct {
	TransferID string
	MMHash     string
	NBytes     uint64
	Meta       string // opaque; kept with the region and returned by Meta
	// Owner names the requester (the producer that sent the reserve): a
	// write grant is repeated only to its owner. It must be unguessable
	// to others, or they can claim the grant.
	Owner string
	// Peer names what the reserve came from as its sender proved it (the
	// control plane's name for the authenticated connection): quotas are
	// counted per peer, so that naming more requesters gains no room.
	// The table only compares it.
	Peer string
}

// Grant answers one Item. Res, Token and Offset are set only for
// KindWrite.
type Grant struct {
	TransferID string
	Kind       Kind
	Res        ids.ResID
	Token      ids.Token
	// Offset is where the region starts in the slab: a one-sided data
	// plane turns it into the remote address the writer targets.
	Offset uint64
	NBytes uint64
	Err    error
	// TookOver: this write grant took over an orphaned write (PeerGone).
	TookOver bool
}

// Event is the terminal news of one transfer: ready, or failed with a
// reason. With Gone set it is instead the end of a region that had been
// ready: it names the content (MMHash, NBytes, Reason) and no transfer,
// because the transfers the copy served (the writer's, cached answers,
// followers) all had their Ready event long ago, and most of them are
// forgotten. Without it the scheduler would keep offering the content.
type Event struct {
	TransferID string
	MMHash     string
	Ready      bool
	NBytes     uint64
	Reason     string
	Gone       bool
}

// StatusInfo describes a transfer. For a live transfer State is its
// region's state; for a finished one it is the outcome it ended with.
type StatusInfo struct {
	MMHash string
	State  State
	Kind   Kind
	NBytes uint64
	Done   bool   // the terminal event has been emitted
	Reason string // why it failed, for a failed transfer
}

type region struct {
	owner  string // the requester whose write grant it is
	peer   string // the connection its quota counts under
	res    ids.ResID
	token  ids.Token
	mmHash string
	meta   string // the writer's description of the bytes
	off    uint64 // slab offset
	age    int    // roomFor's scratch: the rank of a resident, 0 the least recently used
	nbytes uint64 // the size asked; the allocation is rounded up
	alloc  uint64 // the slab allocation's length
	state  State

	inflight int
	torn     bool
	// landed is what frames that carried the item's completion have
	// written, as disjoint [off, end) runs in offset order (EndComplete):
	// the region completes in-band once it covers every byte.
	landed []span
	// abandoned: the writer gave up while an expiry was pending, so the
	// region ends Cancelled rather than Expired.
	abandoned bool
	reason    string
	// orphaned: the connection its write grant came on ended (PeerGone),
	// so another requester's reserve of its content takes the write over.
	orphaned bool

	writer    *transfer   // nil once the writer's transfer is detached
	followers []*transfer // live KindFollow transfers, in join order
	joined    int         // transfers that ever joined after the writer

	// deadline is set only while a lease runs: Writing, and Ready before
	// the first Acquire.
	deadline time.Time
	pins     int
	acquired bool
	lru      *list.Element // set exactly while resident
}

type transfer struct {
	owner  string
	peer   string
	id     string
	mmHash string
	kind   Kind
	nbytes uint64
	region *region
	done   bool // terminal event emitted (only a writer stays live after it)
}

// Rejections counts refused writes by reason.
type Rejections struct {
	Unknown, Gone, BadToken, OutOfBounds, NotWritable uint64
}

// Stats is a snapshot for metrics.
type Stats struct {
	SlabSize       uint64
	BytesInUse     uint64
	Regions        map[State]int // live regions by state (Writing, Ready, *Pending)
	Cancelled      uint64        // regions ended Cancelled since New
	Expired        uint64        // regions ended Expired since New (evictions included)
	Pending        int           // regions whose memory waits for writes in flight
	WritesInFlight int
	Pinned         int
	Residents      int
	ResidentBytes  uint64
	Transfers      int // live transfer records
	Tombstones     int
	Evictions      uint64
	// Completed and CompletedBytes count regions the writer completed, so
	// the items this shard received whatever the data plane (a one-sided
	// write, shm or RDMA, passes no receiver of the shard's own).
	Completed      uint64
	CompletedBytes uint64
	RejectedWrites Rejections
	UnmatchedEnds  uint64 // EndWrite calls with no write in flight
	// InBandRefused counts in-band completes refused (EndComplete): for no
	// write in flight, a bad token, bytes landing twice or scattered past
	// maxLanded runs.
	InBandRefused uint64
	// Orphaned counts Writing regions whose writer's connection ended
	// (PeerGone); TakenOver those of them whose write another requester
	// took over.
	Orphaned  uint64
	TakenOver uint64
	// OverQuota counts reservations refused for quota, by reason
	// (QuotaPending, QuotaPendingBytes, QuotaFollowers,
	// QuotaPeerFollowers, QuotaRequesters).
	OverQuota map[string]uint64
	// Credit is the standing credit: windows, claims and their refusals.
	Credit CreditStats
}

// Table is the reservation table of one consumer shard. It is not safe for
// concurrent use: its owner serialises every call.
type Table struct {
	cfg    Config
	slab   *slab.Slab
	tokens ids.TokenSource

	resIDs  ids.Counter
	lastRes ids.ResID

	regions map[ids.ResID]*region
	// byOff is every live region in address order, filed and unfiled
	// with regions, so that making room need not sort them each time. A
	// B-tree: filing and unfiling cost O(log n) however many residents a
	// slab of small items holds (a sorted slice moved every region after
	// the one filed: ~9 µs a reserve at 131,072 residents).
	byOff     *btree.BTreeG[*region]
	deadlines deadlineHeap       // lease ends, with stale entries skipped lazily
	byHash    map[string]*region // the joinable (Writing or Ready) region of each mm_hash
	transfers map[string]*transfer

	residents     *list.List // of *region, most recently used at the front
	residentBytes uint64

	tomb   tombstones
	events []Event

	rejected      Rejections
	unmatchedEnds uint64
	inBandRefused uint64
	orphaned      uint64
	takenOver     uint64
	cancelled     uint64
	expired       uint64
	evictions     uint64
	completed     uint64
	completedB    uint64

	// peers counts what each peer holds; an entry goes when it holds
	// nothing, so the map is bounded by the live records.
	peers map[string]*peerUse
	// overQuota counts quota refusals by reason (Quota* names).
	overQuota map[string]uint64

	// windows are the standing credit of each requester (credit.go).
	windows map[creditKey]*window
	gens    uint64 // the last window generation issued
	credit  CreditStats
	// broken records the first internal inconsistency (an illegal
	// transition or a refused free); CheckInvariants reports it.
	broken error
}

// New builds a table over s, which it then owns: nothing else may allocate
// from s.
func New(s *slab.Slab, cfg Config, tokens ids.TokenSource) *Table {
	cfg = cfg.withDefaults(s.Size())
	return &Table{
		cfg:       cfg,
		slab:      s,
		tokens:    tokens,
		regions:   make(map[ids.ResID]*region),
		byOff:     btree.NewG(byOffDegree, func(a, b *region) bool { return a.off < b.off }),
		byHash:    make(map[string]*region),
		transfers: make(map[string]*transfer),
		peers:     make(map[string]*peerUse),
		overQuota: make(map[string]uint64),
		windows:   make(map[creditKey]*window),
		residents: list.New(),
		tomb:      newTombstones(cfg.MaxTombstones),
	}
}

// Reserve answers each item in order; a failed item (Grant.Err) never
// fails the batch. For each item:
//   - a transfer id already live or remembered for the same mm_hash and
//     size gets its grant again, with no second event (a producer retrying
//     a lost reply); a finished writer's transfer gets ErrGone instead;
//   - a transfer id known for another mm_hash fails with ErrCollision, an
//     mm_hash whose region has another size with ErrSizeMismatch;
//   - an mm_hash being written is followed (KindFollow), a ready one is
//     answered at once (KindCached, with a Ready event);
//   - otherwise a region is allocated (KindWrite), evicting resident
//     copies least recently used first when the slab is full.
func (t *Table) Reserve(items []Item, now time.Time) []Grant {
	out := make([]Grant, len(items))
	for i, it := range items {
		out[i] = t.reserve(it, now)
		out[i].TransferID = it.TransferID
	}
	return out
}

func (t *Table) reserve(it Item, now time.Time) Grant {
	fail := func(err error) Grant { return Grant{Err: err} }
	switch {
	case it.TransferID == "":
		return fail(fmt.Errorf("reserve mm_hash %q: empty transfer id: %w", it.MMHash, ErrInvalid))
	case it.MMHash == "":
		return fail(fmt.Errorf("reserve transfer %s: empty mm_hash: %w", it.TransferID, ErrInvalid))
	case it.NBytes == 0:
		return fail(fmt.Errorf("reserve transfer %s (%s): zero size: %w", it.TransferID, it.MMHash, ErrInvalid))
	}

	if tr, ok := t.transfers[it.TransferID]; ok {
		if err := sameItem(it, tr.mmHash, tr.nbytes); err != nil {
			return fail(err)
		}
		// A write grant carries the token that lets its holder write,
		// complete and abandon: only the requester that made it gets it
		// again (a retry after a lost reply).
		if tr.kind == KindWrite && tr.owner != it.Owner {
			if g, ok := t.takeOver(tr.region, it, now); ok {
				return g
			}
			return fail(fmt.Errorf("reserve transfer %s (%s): %w", it.TransferID, it.MMHash, ErrInProgress))
		}
		if tr.kind == KindWrite {
			// Its writer is back (a new connection, the old one idled
			// out): the write is its own again.
			tr.region.orphaned = false
		}
		return grantFor(tr)
	}
	if tb, ok := t.tomb.transfers[it.TransferID]; ok {
		if err := sameItem(it, tb.mmHash, tb.nbytes); err != nil {
			return fail(err)
		}
		// A producer that lost the reply retries: a finished follower or
		// cached answer is repeated without a second event.
		if tb.state == Ready && tb.kind != KindWrite {
			return Grant{Kind: tb.kind, NBytes: tb.nbytes}
		}
		return fail(fmt.Errorf("reserve transfer %s (%s): %w: finished %s%s",
			it.TransferID, it.MMHash, ErrGone, tb.state, because(tb.reason)))
	}

	if r := t.byHash[it.MMHash]; r != nil {
		if r.nbytes != it.NBytes {
			return fail(fmt.Errorf("reserve transfer %s: mm_hash %s holds %d bytes, asked %d: %w",
				it.TransferID, it.MMHash, r.nbytes, it.NBytes, ErrSizeMismatch))
		}
		if g, ok := t.takeOver(r, it, now); ok {
			return g
		}
		if r.state == Writing {
			if err := t.followQuota(it, r); err != nil {
				t.refuse(it, err)
				return fail(err)
			}
		}
		r.joined++
		tr := &transfer{owner: it.Owner, peer: it.Peer, id: it.TransferID, mmHash: it.MMHash, nbytes: it.NBytes, region: r}
		if r.state == Writing {
			t.hold(it.Peer, it.Owner, func(u *peerUse) { u.followers++ })
			tr.kind = KindFollow
			r.followers = append(r.followers, tr)
			t.transfers[tr.id] = tr
			return grantFor(tr)
		}
		// Ready: answered at once. Refreshing the lease and the LRU gives
		// the new request time to load before the copy may go.
		tr.kind = KindCached
		if !r.acquired {
			t.setDeadline(r, now.Add(t.cfg.Lease))
		}
		if r.lru != nil {
			t.residents.MoveToFront(r.lru)
		}
		t.settle(tr, Ready, "")
		return grantFor(tr)
	}

	if err := t.pendingQuota(it); err != nil {
		t.refuse(it, err)
		return fail(err)
	}
	tok, err := t.tokens.NewToken()
	if err != nil {
		return fail(fmt.Errorf("reserve transfer %s (%s): %w", it.TransferID, it.MMHash, err))
	}
	off, err := t.alloc(it)
	if err != nil {
		t.refuse(it, err)
		return fail(err)
	}
	return grantFor(t.newRegion(it, off, tok, now))
}

// PeerGone says the connection peer ended; the process behind it may be
// dead (an encoder killed after its reserve). Each region it was writing
// is orphaned and otherwise unchanged: its lease runs on, a write in
// flight still lands, its writer may still complete it. But the next
// reserve of its content by another requester (the same transfer sent to
// a second encoder, or a new request for the content) takes the write
// over (takeOver) instead of being refused (ErrInProgress) or following
// a write that may never come. A writer whose connection only idled out
// loses nothing it needs: the content is the same, its transfers are
// served by the new write, and its own late complete fails with ErrGone.
// It returns how many regions it orphaned.
func (t *Table) PeerGone(peer string, now time.Time) int {
	n := 0
	for _, r := range t.regions {
		if r.state == Writing && r.peer == peer && !r.orphaned {
			r.orphaned = true
			n++
		}
	}
	t.orphaned += uint64(n)
	return n
}

// takeOver gives it the write of old, an orphaned Writing region of its
// content, when there is room: a new region of its own (the old writer
// may still have a one-sided write landing in the old one, whose memory
// waits for it as for any cancel), which the old region's transfers now
// follow (adopt). A transfer with its id is its own write now. Without
// room or quota nothing changes, and ok is false: the caller answers as
// if old were not orphaned.
func (t *Table) takeOver(old *region, it Item, now time.Time) (g Grant, ok bool) {
	if !orphanOf(old, it) || t.pendingQuota(it) != nil {
		return Grant{}, false
	}
	tok, err := t.tokens.NewToken()
	if err != nil {
		return Grant{}, false
	}
	off, err := t.alloc(it)
	if err != nil {
		return Grant{}, false
	}
	if prev := old.writer; prev != nil && prev.id == it.TransferID {
		// Replaced by the new writer's record below, before any event:
		// the transfer keeps exactly one terminal event.
		old.writer = nil
		delete(t.transfers, prev.id)
	}
	tr := t.newRegion(it, off, tok, now)
	t.adopt(old, tr.region)
	g = grantFor(tr)
	g.TookOver = true
	return g, true
}

// orphanOf reports whether it may take over old's write: old is an
// orphaned write of the same size, and it is another requester's.
func orphanOf(old *region, it Item) bool {
	return old.state == Writing && old.orphaned && old.owner != it.Owner && old.nbytes == it.NBytes
}

// adopt makes old's transfers, its writer's included, follow r, the write
// that took old over, and cancels old (newRegion filed r as the content's
// region already).
func (t *Table) adopt(old, r *region) {
	prev, moved := old.writer, old.followers
	old.writer, old.followers = nil, nil
	if prev != nil {
		prev.kind = KindFollow
		t.hold(prev.peer, prev.owner, func(u *peerUse) { u.followers++ })
		moved = append([]*transfer{prev}, moved...)
	}
	for _, f := range moved {
		f.region = r
		r.followers = append(r.followers, f)
		r.joined++
	}
	t.doom(old, Cancelled, ReasonTakenOver)
	t.takenOver++
}

// newRegion files a Writing region for it over the slab allocation at off,
// and its writer's transfer.
func (t *Table) newRegion(it Item, off uint64, tok ids.Token, now time.Time) *transfer {
	alloc, _ := t.slab.Len(off)
	res := t.resIDs.Next()
	t.lastRes = res
	r := &region{
		owner: it.Owner, peer: it.Peer, res: res, token: tok, mmHash: it.MMHash, meta: it.Meta,
		off: off, nbytes: it.NBytes, alloc: alloc,
		state: Writing,
	}
	t.setDeadline(r, now.Add(t.cfg.Lease))
	tr := &transfer{owner: it.Owner, peer: it.Peer, id: it.TransferID, mmHash: it.MMHash, kind: KindWrite, nbytes: it.NBytes, region: r}
	r.writer = tr
	t.hold(it.Peer, it.Owner, func(u *peerUse) {
		u.pending++
		u.pendingBytes += r.nbytes
	})
	t.regions[res] = r
	t.fileByOff(r)
	t.byHash[it.MMHash] = r
	t.transfers[tr.id] = tr
	return tr
}

func sameItem(it Item, mmHash string, nbytes uint64) error {
	if mmHash != it.MMHash {
		return fmt.Errorf("reserve transfer %s: known for mm_hash %s, asked for %s: %w",
			it.TransferID, mmHash, it.MMHash, ErrCollision)
	}
	if nbytes != it.NBytes {
		return fmt.Errorf("reserve transfer %s (%s): known with %d bytes, asked %d: %w",
			it.TransferID, it.MMHash, nbytes, it.NBytes, ErrSizeMismatch)
	}
	return nil
}

func grantFor(tr *transfer) Grant {
	g := Grant{Kind: tr.kind, NBytes: tr.nbytes}
	if tr.kind == KindWrite {
		g.Res, g.Token, g.Offset = tr.region.res, tr.region.token, tr.region.off
	}
	return g
}

// alloc carves room for it. When no free extent is large enough it evicts
// the resident copies that open one (see roomFor), and only those: a
// fragmented slab can hold many resident bytes none of which help.
func (t *Table) alloc(it Item) (uint64, error) {
	off, ok, err := t.slab.TryAlloc(it.NBytes)
	switch {
	case err != nil:
		return 0, fmt.Errorf("reserve transfer %s (%s): %w", it.TransferID, it.MMHash, err)
	case ok:
		return off, nil
	}
	victims := t.roomFor(it.NBytes)
	if victims == nil {
		why := ""
		if t.residentBytes > 0 {
			why = fmt.Sprintf("; evicting the %d resident bytes would not free a large enough extent", t.residentBytes)
		}
		return 0, fmt.Errorf("reserve transfer %s (%s): %w (%d bytes asked, %d of %d bytes in use, largest free extent %d bytes%s)",
			it.TransferID, it.MMHash, ErrPoolFull, it.NBytes, t.slab.InUse(), t.slab.Size(), t.slab.LargestFree(), why)
	}
	for _, r := range victims {
		t.evict(r)
	}
	off, err = t.slab.Alloc(it.NBytes)
	if err != nil {
		// roomFor promised an extent: the table and the slab disagree.
		return 0, t.fault(fmt.Errorf("reserve transfer %s (%s): evicted %d resident copies and still: %w", it.TransferID, it.MMHash, len(victims), err))
	}
	return off, nil
}

// roomFor picks the resident copies whose eviction frees one contiguous
// extent of n bytes (rounded up to the slab's alignment), or nil when no
// set of them can. The slab is cut by regions that cannot go (being
// written, pinned, not yet loaded); between two such regions, evicting a
// run of adjacent residents joins them with the free gaps around them.
// Of all runs that are just large enough, it takes the one whose most
// recently used copy is the oldest (least recently used first, as far as
// contiguity allows), then the one that evicts fewer bytes.
//
// When the least recently used copy alone is large enough, that copy is
// the answer without a scan: every run it is in evicts it, and no other
// run is as old. That is the common case (items of one size, a full slab
// of residents), and it spares each reserve a pass over every region.
func (t *Table) roomFor(n uint64) []*region {
	if t.residents.Len() == 0 {
		return nil
	}
	need := (n + slab.Align - 1) &^ (slab.Align - 1)
	if need > t.slab.Size()-t.slab.InUse()+t.residentBytes {
		return nil
	}
	if lru := t.residents.Back().Value.(*region); lru.alloc >= need {
		return []*region{lru}
	}
	return t.roomForScan(need)
}

// roomForScan is roomFor's search over every run of residents, for need
// bytes already aligned.
func (t *Table) roomForScan(need uint64) []*region {
	for e, i := t.residents.Back(), 0; e != nil; e, i = e.Prev(), i+1 {
		e.Value.(*region).age = i // 0 is the least recently used
	}

	var best []*region
	bestAge, bestBytes := -1, uint64(0)
	consider := func(run []*region, lo, hi uint64) {
		// run: adjacent residents in address order between lo and hi, the
		// ends of the fixed regions around them. Evicting run[j..l] frees
		// from the end of run[j-1] (or lo) to the start of run[l+1] (or hi).
		start := func(j int) uint64 {
			if j == 0 {
				return lo
			}
			return run[j-1].off + run[j-1].alloc
		}
		end := func(l int) uint64 {
			if l == len(run)-1 {
				return hi
			}
			return run[l+1].off
		}
		l := 0
		for j := range run {
			l = max(l, j)
			for l < len(run) && end(l)-start(j) < need {
				l++
			}
			if l == len(run) {
				return // later windows start further right and end no later
			}
			newest, bytes := 0, uint64(0)
			for _, r := range run[j : l+1] {
				newest = max(newest, r.age)
				bytes += r.alloc
			}
			if best == nil || newest < bestAge || (newest == bestAge && bytes < bestBytes) {
				best, bestAge, bestBytes = run[j:l+1], newest, bytes
			}
		}
	}
	// A credit window's room is no region, but it cuts the slab like a
	// region that cannot go: evicting around it opens nothing across it.
	cuts := t.windowPieces()
	var run []*region
	lo := uint64(0)
	t.byOff.Ascend(func(r *region) bool {
		for len(cuts) > 0 && cuts[0].Off < r.off {
			consider(run, lo, cuts[0].Off)
			run, lo, cuts = nil, cuts[0].end(), cuts[1:]
		}
		if r.lru != nil {
			run = append(run, r)
			return true
		}
		consider(run, lo, r.off)
		run, lo = nil, r.off+r.alloc
		return true
	})
	for _, c := range cuts {
		consider(run, lo, c.Off)
		run, lo = nil, c.end()
	}
	consider(run, lo, t.slab.Size())
	return slices.Clone(best)
}

// byOffDegree is the B-tree's degree: nodes of up to 63 pointers, a few
// cache lines each.
const byOffDegree = 32

// fileByOff adds r to byOff at its address.
func (t *Table) fileByOff(r *region) { t.byOff.ReplaceOrInsert(r) }

// unfileByOff removes r from byOff.
func (t *Table) unfileByOff(r *region) {
	if got, ok := t.byOff.Get(r); ok && got == r {
		t.byOff.Delete(r)
	}
}

func cmpUint(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// refuse settles a transfer the table could not make room for: its
// failure event reaches the scheduler now, so the request waiting for it
// fails at once (and can be retried) instead of at its push deadline; the
// tombstone keeps the refusal for a repeated reserve and for Status.
func (t *Table) refuse(it Item, err error) {
	reason := "refused: " + err.Error()
	if errors.Is(err, ErrOverQuota) {
		reason = ReasonOverQuota + ": " + err.Error()
	}
	t.events = append(t.events, Event{TransferID: it.TransferID, MMHash: it.MMHash, NBytes: it.NBytes, Reason: reason})
	t.tomb.addTransfer(it.TransferID, transferTomb{mmHash: it.MMHash, nbytes: it.NBytes, state: Cancelled, reason: reason})
}

func (t *Table) evict(r *region) {
	t.evictions++
	t.doom(r, Expired, ReasonEvicted)
}

// lookup finds a live region for a data-plane or writer message; op names
// the message in the error.
func (t *Table) lookup(op string, res ids.ResID) (*region, error) {
	if r, ok := t.regions[res]; ok {
		return r, nil
	}
	if tb, ok := t.tomb.regions[res]; ok {
		return nil, fmt.Errorf("%s region %d (%s): %w: %s%s", op, res, tb.mmHash, ErrGone, tb.state, because(tb.reason))
	}
	// Ids come from a counter and are never reused, so an id at or below
	// the last one issued is over even once its tombstone is forgotten.
	if res != 0 && res <= t.lastRes {
		return nil, fmt.Errorf("%s region %d: %w", op, res, ErrGone)
	}
	return nil, fmt.Errorf("%s region %d: %w", op, res, ErrUnknown)
}

// BeginWrite admits one data-plane write of n bytes at off inside region
// res and returns where it lands in the slab. Every accepted BeginWrite
// must be followed by exactly one EndWrite.
func (t *Table) BeginWrite(res ids.ResID, tok ids.Token, off, n uint64, now time.Time) (slabOff uint64, err error) {
	r, err := t.lookup("write", res)
	if err != nil {
		if errors.Is(err, ErrGone) {
			t.rejected.Gone++
		} else {
			t.rejected.Unknown++
		}
		return 0, err
	}
	if !tok.Equal(r.token) {
		t.rejected.BadToken++
		return 0, fmt.Errorf("write region %d: %w", res, ErrBadToken)
	}
	if r.state != Writing {
		t.rejected.NotWritable++
		return 0, fmt.Errorf("write region %d (%s): %w: %s", res, r.mmHash, ErrNotWritable, r.state)
	}
	if n == 0 || off > r.nbytes || n > r.nbytes-off {
		t.rejected.OutOfBounds++
		return 0, fmt.Errorf("write region %d (%s): [%d,+%d) outside %d bytes: %w", res, r.mmHash, off, n, r.nbytes, ErrOutOfBounds)
	}
	r.inflight++
	if off == 0 && n == r.nbytes {
		r.torn = false
		r.landed = r.landed[:0]
	}
	return r.off + off, nil
}

// EndWrite ends a write admitted by BeginWrite; ok=false tears the region.
// The last write to end on a doomed region returns its memory.
func (t *Table) EndWrite(res ids.ResID, ok bool, now time.Time) {
	r, found := t.regions[res]
	if !found || r.inflight == 0 {
		t.unmatchedEnds++
		return
	}
	r.inflight--
	if !ok {
		r.torn = true
	}
	if r.inflight > 0 || !r.state.pending() {
		return
	}
	final := Expired
	if r.state == CancelPending || r.abandoned {
		final = Cancelled
	}
	if t.check(r.transition(final)) {
		t.release(r)
	}
}

// EndComplete ends, like EndWrite(res, true, now), a write admitted by
// BeginWrite whose frame carried its item's completion (the data plane's
// in-band complete, so that no complete message follows the bytes): its
// bytes [off, off+n) count as landed, and the end that leaves every byte of
// the region landed with no write in flight completes it, as Complete
// would. A nil error while bytes are still missing means the frame landed
// and the item waits for the rest.
//
// Bytes count once: a frame landing over bytes already landed (a replay)
// tears the region rather than stand in for bytes that never came, and so
// does scattering more than maxLanded disjoint runs. A torn region
// completes only after one write of the whole region (as for Complete).
// An end for no write in flight, or with a token that is not the
// region's, completes nothing; the latter ends its write torn. Each
// refusal is counted (Stats.InBandRefused). The error says why the item
// did not complete: the writer's frame fails with it.
func (t *Table) EndComplete(res ids.ResID, tok ids.Token, off, n uint64, now time.Time) error {
	r, found := t.regions[res]
	if !found || r.inflight == 0 {
		t.unmatchedEnds++
		t.inBandRefused++
		return fmt.Errorf("in-band complete of region %d: %w", res, ErrNoWrite)
	}
	if !tok.Equal(r.token) {
		t.inBandRefused++
		t.EndWrite(res, false, now)
		return fmt.Errorf("in-band complete of region %d: %w", res, ErrBadToken)
	}
	if r.state == Writing && !r.torn {
		var ok bool
		if r.landed, ok = addLanded(r.landed, off, off+n); !ok {
			t.inBandRefused++
			r.torn = true
		}
	}
	t.EndWrite(res, true, now)
	switch {
	case r.state != Writing:
		return fmt.Errorf("in-band complete of region %d (%s): %w: %s", res, r.mmHash, ErrGone, r.state)
	case r.torn:
		return fmt.Errorf("in-band complete of region %d (%s): %w: bytes landed twice, scattered or lost; rewrite it whole or abandon", res, r.mmHash, ErrTorn)
	case r.inflight > 0 || len(r.landed) != 1 || r.landed[0] != (span{0, r.nbytes}):
		return nil
	}
	return t.Complete(res, tok, now)
}

// span is one run [off, end) of landed bytes.
type span struct{ off, end uint64 }

// maxLanded bounds the disjoint runs one region's landed bytes may form:
// a writer's frames land nearly in order (a run per connection at most),
// so only a hostile one scatters more.
const maxLanded = 256

// addLanded adds [off, end) to the sorted disjoint runs l, merging
// neighbours; false when it overlaps a run or would make too many.
func addLanded(l []span, off, end uint64) ([]span, bool) {
	i, _ := slices.BinarySearchFunc(l, off, func(s span, o uint64) int { return cmpUint(s.off, o) })
	if (i > 0 && l[i-1].end > off) || (i < len(l) && l[i].off < end) {
		return l, false
	}
	joinLeft := i > 0 && l[i-1].end == off
	joinRight := i < len(l) && l[i].off == end
	switch {
	case joinLeft && joinRight:
		l[i-1].end = l[i].end
		return slices.Delete(l, i, i+1), true
	case joinLeft:
		l[i-1].end = end
		return l, true
	case joinRight:
		l[i].off = off
		return l, true
	case len(l) >= maxLanded:
		return l, false
	}
	return slices.Insert(l, i, span{off, end}), true
}

// Complete marks the region written: Ready events go to the writer's
// transfer and to every follower. A repeated Complete on a Ready region is
// a no-op; one on a doomed or finished region gets ErrGone.
func (t *Table) Complete(res ids.ResID, tok ids.Token, now time.Time) error {
	r, err := t.lookup("complete", res)
	if err != nil {
		return err
	}
	if !tok.Equal(r.token) {
		return fmt.Errorf("complete region %d: %w", res, ErrBadToken)
	}
	switch {
	case r.state == Ready:
		return nil
	case r.state != Writing:
		return fmt.Errorf("complete region %d (%s): %w: %s", res, r.mmHash, ErrGone, r.state)
	case r.inflight > 0:
		return fmt.Errorf("complete region %d (%s): %w (%d)", res, r.mmHash, ErrWritesInFlight, r.inflight)
	case r.torn:
		return fmt.Errorf("complete region %d (%s): %w: rewrite it whole or abandon", res, r.mmHash, ErrTorn)
	}
	if err := r.transition(Ready); err != nil {
		return t.fault(err)
	}
	r.landed = nil
	t.unpend(r)
	t.setDeadline(r, now.Add(t.cfg.Lease))
	t.completed++
	t.completedB += r.nbytes
	if w := r.writer; w != nil {
		t.emit(w, true, "")
		w.done = true
	}
	for len(r.followers) > 0 {
		t.settle(r.followers[0], Ready, "")
	}
	return nil
}

// Abandon is the writer giving up. Followers fail at once; the memory
// returns when no write is in flight any more.
func (t *Table) Abandon(res ids.ResID, tok ids.Token, reason string, now time.Time) error {
	r, err := t.lookup("abandon", res)
	if err != nil {
		return err
	}
	if !tok.Equal(r.token) {
		return fmt.Errorf("abandon region %d: %w", res, ErrBadToken)
	}
	switch r.state {
	case Writing:
		why := ReasonAbandoned
		if reason != "" {
			why += ": " + reason
		}
		t.doom(r, Cancelled, why)
	case ExpirePending:
		r.abandoned = true
	case Ready:
		return fmt.Errorf("abandon region %d (%s): %w: already complete", res, r.mmHash, ErrNotWritable)
	}
	return nil
}

// Cancel says one transfer is no longer wanted. A follower detaches. A
// Writing region ends when its last transfer is cancelled, the writer's
// included; while others follow it, it stays and the writer may still
// finish it. A Ready region is cancelled with its writer's transfer only
// if it was never shared, pinned or loaded; otherwise the transfer just
// detaches and the copy stays for whoever else may load it.
func (t *Table) Cancel(transferID string, now time.Time) error {
	tr, ok := t.transfers[transferID]
	if !ok {
		if _, gone := t.tomb.transfers[transferID]; gone {
			return nil
		}
		return fmt.Errorf("cancel transfer %s: %w", transferID, ErrUnknown)
	}
	r := tr.region
	switch r.state {
	case Writing:
		t.settle(tr, Cancelled, ReasonCancelled)
		if r.writer == nil && len(r.followers) == 0 {
			t.doom(r, Cancelled, ReasonCancelled)
		}
	case Ready:
		if r.pins == 0 && !r.acquired && r.joined == 0 {
			t.doom(r, Cancelled, ReasonCancelled)
		} else {
			t.settle(tr, Ready, "")
		}
	default:
		return t.fault(fmt.Errorf("cancel transfer %s: live on a %s region", transferID, r.state))
	}
	return nil
}

// Detach is Cancel for a caller that holds no token: a cancel by transfer
// id from the control plane, the scheduler's when its request went away
// or anybody's who learnt the id (it is no secret: it travels with the
// request, to the scheduler and to the proxy's clients). A follower or a
// transfer of a Ready region detaches as with Cancel; a write grant is
// refused with ErrNeedsToken and goes on, since only its token's holder
// may end it (Abandon).
func (t *Table) Detach(transferID string, now time.Time) error {
	if tr, ok := t.transfers[transferID]; ok && tr.region != nil && tr.region.writer == tr {
		return fmt.Errorf("cancel transfer %s (%s): %w; its writer abandons it with the token", transferID, tr.mmHash, ErrNeedsToken)
	}
	return t.Cancel(transferID, now)
}

// Tick ends the leases that have run out by now.
func (t *Table) Tick(now time.Time) {
	t.expireWindows(now)
	for {
		r := t.dueRegion(now)
		if r == nil {
			return
		}
		t.doom(r, Expired, ReasonExpired)
	}
}

// NextDeadline is the earliest time at which Tick would change something.
func (t *Table) NextDeadline() (time.Time, bool) {
	t.dropStaleDeadlines()
	at, ok := t.nextWindowDeadline()
	if len(t.deadlines) > 0 && (!ok || t.deadlines[0].at.Before(at)) {
		at, ok = t.deadlines[0].at, true
	}
	return at, ok
}

// Meta returns the description the writer gave the bytes of mmHash's
// joinable region.
func (t *Table) Meta(mmHash string) (string, bool) {
	r := t.byHash[mmHash]
	if r == nil {
		return "", false
	}
	return r.meta, true
}

// Acquire pins the Ready region of mmHash for loading. A pinned region
// never expires and is never evicted.
func (t *Table) Acquire(mmHash string, now time.Time) (slabOff, nbytes uint64, err error) {
	r := t.byHash[mmHash]
	if r == nil {
		return 0, 0, fmt.Errorf("acquire mm_hash %s: %w", mmHash, ErrUnknown)
	}
	if r.state != Ready {
		return 0, 0, fmt.Errorf("acquire mm_hash %s: %w: %s", mmHash, ErrNotReady, r.state)
	}
	if r.lru != nil {
		t.residents.Remove(r.lru)
		r.lru = nil
		t.residentBytes -= r.alloc
	}
	r.pins++
	r.acquired = true
	r.deadline = time.Time{}
	return r.off, r.nbytes, nil
}

// Release unpins; at zero pins the region becomes a resident copy.
func (t *Table) Release(mmHash string, now time.Time) error {
	r := t.byHash[mmHash]
	if r == nil || r.pins == 0 {
		return fmt.Errorf("release mm_hash %s: %w", mmHash, ErrNotPinned)
	}
	r.pins--
	if r.pins > 0 {
		return nil
	}
	r.lru = t.residents.PushFront(r)
	t.residentBytes += r.alloc
	for t.cfg.MaxResidentBytes > 0 && t.residentBytes > t.cfg.MaxResidentBytes {
		t.evict(t.residents.Back().Value.(*region))
	}
	return nil
}

// Lookup finds the Ready region of mmHash without pinning it.
func (t *Table) Lookup(mmHash string) (slabOff, nbytes uint64, ok bool) {
	r := t.byHash[mmHash]
	if r == nil || r.state != Ready {
		return 0, 0, false
	}
	return r.off, r.nbytes, true
}

// EvictResidents drops every resident copy (on shutdown, or when the owner
// needs the memory back) and returns how many it dropped.
func (t *Table) EvictResidents() int {
	n := 0
	for t.residents.Len() > 0 {
		t.evict(t.residents.Back().Value.(*region))
		n++
	}
	return n
}

// Effects holds what the table produced since the last Ready: the events
// to publish to the consumer scheduler, in the order they arose.
type Effects struct {
	Events []Event
}

// Empty reports whether there is nothing to publish.
func (e Effects) Empty() bool { return len(e.Events) == 0 }

// Ready returns the effects produced since the last call and forgets
// them: taking them acknowledges them (the protocol of core/fsm). Unlike
// the other machines' Ready it takes no time, because this table applies
// its deadlines only in Tick, which its owner calls at NextDeadline.
func (t *Table) Ready() Effects {
	rd := Effects{Events: t.events}
	t.events = nil
	return rd
}

// Status describes a live or recently finished transfer, so that a
// scheduler that missed an event can catch up.
func (t *Table) Status(transferID string) (StatusInfo, bool) {
	if tr, ok := t.transfers[transferID]; ok {
		return StatusInfo{MMHash: tr.mmHash, State: tr.region.state, Kind: tr.kind, NBytes: tr.nbytes, Done: tr.done}, true
	}
	if tb, ok := t.tomb.transfers[transferID]; ok {
		info := StatusInfo{MMHash: tb.mmHash, State: tb.state, Kind: tb.kind, NBytes: tb.nbytes, Done: true, Reason: tb.reason}
		// A follower or cached transfer is forgotten as Ready, but its
		// bytes were its region's: once no ready copy of the content is
		// left, a scheduler catching up through Status must not learn
		// that the transfer is ready after the Gone event told it not.
		if tb.state == Ready && !t.holdsReady(tb.mmHash, tb.nbytes) {
			info.State, info.Reason = Expired, ReasonCopyGone
		}
		return info, true
	}
	return StatusInfo{}, false
}

// holdsReady reports whether a ready copy of mmHash, of n bytes, is here.
func (t *Table) holdsReady(mmHash string, n uint64) bool {
	r := t.byHash[mmHash]
	return r != nil && r.state == Ready && r.nbytes == n
}

// Stats is a snapshot of the counters and gauges.
func (t *Table) Stats() Stats {
	s := Stats{
		SlabSize:       t.slab.Size(),
		BytesInUse:     t.slab.InUse(),
		Regions:        map[State]int{Writing: 0, Ready: 0, CancelPending: 0, ExpirePending: 0},
		Cancelled:      t.cancelled,
		Expired:        t.expired,
		Residents:      t.residents.Len(),
		ResidentBytes:  t.residentBytes,
		Transfers:      len(t.transfers),
		Tombstones:     t.tomb.len(),
		Evictions:      t.evictions,
		Completed:      t.completed,
		CompletedBytes: t.completedB,
		RejectedWrites: t.rejected,
		UnmatchedEnds:  t.unmatchedEnds,
		InBandRefused:  t.inBandRefused,
		Orphaned:       t.orphaned,
		TakenOver:      t.takenOver,
		OverQuota:      maps.Clone(t.overQuota),
		Credit:         t.creditStats(),
	}
	for _, r := range t.regions {
		s.Regions[r.state]++
		s.WritesInFlight += r.inflight
		if r.state.pending() {
			s.Pending++
		}
		if r.pins > 0 {
			s.Pinned++
		}
	}
	return s
}

// doom ends a Writing or Ready region with outcome to (Cancelled or
// Expired). Its live transfers are settled now; its memory returns now, or
// when the last write in flight ends.
func (t *Table) doom(r *region, to State, reason string) {
	announced := r.state == Ready
	writing := r.state == Writing
	target := to
	if r.inflight > 0 {
		target = ExpirePending
		if to == Cancelled {
			target = CancelPending
		}
	}
	if !t.check(r.transition(target)) {
		return
	}
	r.reason = reason
	r.deadline = time.Time{}
	if writing {
		t.unpend(r)
	}
	if r.writer != nil {
		t.settle(r.writer, to, reason)
	}
	for len(r.followers) > 0 {
		t.settle(r.followers[0], to, reason)
	}
	if announced {
		t.events = append(t.events, Event{MMHash: r.mmHash, NBytes: r.nbytes, Reason: reason, Gone: true})
	}
	if t.byHash[r.mmHash] == r {
		delete(t.byHash, r.mmHash)
	}
	if r.lru != nil {
		t.residents.Remove(r.lru)
		r.lru = nil
		t.residentBytes -= r.alloc
	}
	if target == to {
		t.release(r)
	}
}

// release returns a final region's memory and remembers it as a tombstone.
func (t *Table) release(r *region) {
	if err := t.slab.Free(r.off); err != nil {
		t.fault(fmt.Errorf("release region %d (%s): %w", r.res, r.mmHash, err))
	}
	delete(t.regions, r.res)
	t.unfileByOff(r)
	if r.state == Cancelled {
		t.cancelled++
	} else {
		t.expired++
	}
	t.tomb.addRegion(r.res, regionTomb{mmHash: r.mmHash, state: r.state, reason: r.reason})
}

// settle gives tr its terminal event, unless it had it, and moves it from
// the live transfers to the tombstones.
func (t *Table) settle(tr *transfer, outcome State, reason string) {
	if !tr.done {
		t.emit(tr, outcome == Ready, reason)
		tr.done = true
	}
	if r := tr.region; r != nil {
		if r.writer == tr {
			r.writer = nil
		} else if i := slices.Index(r.followers, tr); i >= 0 {
			r.followers = slices.Delete(r.followers, i, i+1)
			t.drop(tr.peer, tr.owner, func(u *peerUse) { u.followers-- })
		}
	}
	delete(t.transfers, tr.id)
	t.tomb.addTransfer(tr.id, transferTomb{mmHash: tr.mmHash, kind: tr.kind, nbytes: tr.nbytes, state: outcome, reason: reason})
}

func (t *Table) emit(tr *transfer, ready bool, reason string) {
	t.events = append(t.events, Event{TransferID: tr.id, MMHash: tr.mmHash, Ready: ready, NBytes: tr.nbytes, Reason: reason})
}

// fault records an internal inconsistency for CheckInvariants and returns it.
func (t *Table) fault(err error) error {
	if t.broken == nil {
		t.broken = err
	}
	return err
}

// check records err, if any, and reports whether there was none.
func (t *Table) check(err error) bool {
	if err != nil {
		t.fault(err)
		return false
	}
	return true
}

func because(reason string) string {
	if reason == "" {
		return ""
	}
	return " (" + reason + ")"
}

// peerUse is what one peer holds: regions it is writing and their bytes,
// and transfers following others' writes; and, by requester, how many of
// those records each holds.
type peerUse struct {
	pending      int
	pendingBytes uint64
	followers    int
	owners       map[string]int
}

// Why a reservation was refused for quota (Stats.OverQuota keys).
const (
	QuotaPending         = "pending"
	QuotaPendingBytes    = "pending_bytes"
	QuotaFollowers       = "followers"
	QuotaPeerFollowers   = "peer_followers"
	QuotaRequesters      = "requesters_per_peer"
	quotaRequestersLimit = "max_requesters_per_connection"
)

// hold adds one record of owner's to peer's use, through f.
func (t *Table) hold(peer, owner string, f func(*peerUse)) {
	u := t.peers[peer]
	if u == nil {
		u = &peerUse{owners: map[string]int{}}
		t.peers[peer] = u
	}
	u.owners[owner]++
	f(u)
}

// drop takes one record of owner's from peer's use, through f, and
// forgets a requester, then a peer, that holds nothing.
func (t *Table) drop(peer, owner string, f func(*peerUse)) {
	u := t.peers[peer]
	if u == nil || u.owners[owner] == 0 {
		t.fault(fmt.Errorf("requester %q of peer %q releases what it never held", owner, peer))
		return
	}
	f(u)
	if u.owners[owner]--; u.owners[owner] == 0 {
		delete(u.owners, owner)
	}
	if len(u.owners) == 0 {
		if u.pending != 0 || u.pendingBytes != 0 || u.followers != 0 {
			t.fault(fmt.Errorf("peer %q holds no records but counts %d pending, %d bytes, %d followers", peer, u.pending, u.pendingBytes, u.followers))
		}
		delete(t.peers, peer)
	}
}

// unpend returns a region's share of its peer's quota when it stops
// being written (ready, or doomed: a pending region's memory waits for
// the writes in flight, but its writer can no longer add to them).
func (t *Table) unpend(r *region) {
	t.drop(r.peer, r.owner, func(u *peerUse) {
		u.pending--
		u.pendingBytes -= r.nbytes
	})
}

// overQuotaErr counts a quota refusal under why.
func (t *Table) overQuotaErr(why string, format string, args ...any) error {
	t.overQuota[why]++
	return fmt.Errorf(format, args...)
}

// requesterQuota refuses a record of a requester new to its peer once the
// peer holds records of MaxOwnersPerPeer requesters.
func (t *Table) requesterQuota(it Item) error {
	u := t.peers[it.Peer]
	if u == nil || u.owners[it.Owner] > 0 || len(u.owners) < t.cfg.MaxOwnersPerPeer {
		return nil
	}
	return t.overQuotaErr(QuotaRequesters, "reserve transfer %s (%s): %w: its connection holds records of %d requesters already (%s %d); requester %q is one too many",
		it.TransferID, it.MMHash, ErrOverQuota, len(u.owners), quotaRequestersLimit, t.cfg.MaxOwnersPerPeer, it.Owner)
}

// pendingQuota refuses a new region past its peer's share.
func (t *Table) pendingQuota(it Item) error {
	if err := t.requesterQuota(it); err != nil {
		return err
	}
	u := t.peers[it.Peer]
	if u == nil {
		return nil
	}
	switch {
	case u.pending >= t.cfg.MaxPendingPerOwner:
		return t.overQuotaErr(QuotaPending, "reserve transfer %s (%s): %w: its connection (requester %q) is writing %d regions (max_pending_per_producer %d)",
			it.TransferID, it.MMHash, ErrOverQuota, it.Owner, u.pending, t.cfg.MaxPendingPerOwner)
	case u.pending > 0 && u.pendingBytes+it.NBytes > t.cfg.MaxPendingBytesPerOwner:
		return t.overQuotaErr(QuotaPendingBytes, "reserve transfer %s (%s): %w: its connection (requester %q) is writing %d bytes, %d more would pass %d (max_pending_bytes_per_producer)",
			it.TransferID, it.MMHash, ErrOverQuota, it.Owner, u.pendingBytes, it.NBytes, t.cfg.MaxPendingBytesPerOwner)
	}
	return nil
}

// followQuota refuses a follower past its write's or its peer's bound.
func (t *Table) followQuota(it Item, r *region) error {
	if len(r.followers) >= t.cfg.MaxFollowers {
		return t.overQuotaErr(QuotaFollowers, "reserve transfer %s (%s): %w: %d transfers already follow its write (max_followers %d)",
			it.TransferID, it.MMHash, ErrOverQuota, len(r.followers), t.cfg.MaxFollowers)
	}
	if err := t.requesterQuota(it); err != nil {
		return err
	}
	if u := t.peers[it.Peer]; u != nil && u.followers >= t.cfg.MaxFollowersPerOwner {
		return t.overQuotaErr(QuotaPeerFollowers, "reserve transfer %s (%s): %w: its connection (requester %q) follows %d writes (max_followers_per_producer %d)",
			it.TransferID, it.MMHash, ErrOverQuota, it.Owner, u.followers, t.cfg.MaxFollowersPerOwner)
	}
	return nil
}
