package reserve

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/ids"
)

// Standing credit. A reservation costs a round trip before any byte can
// move; a credit window is room granted ahead: slab extents held for one
// requester (Item.Owner on its Item.Peer) under a generation, a 128-bit
// token and a lease. The requester carves a batch's regions out of its
// window with no message, writes the bytes, and names them in one Claim
// per item; Claim checks the claim against the window and files the region
// already written (Ready). The window is renewed (lease extended, topped up
// from free room or resident copies, never from regions in use) whenever its owner is answered
// anyway (Credit), so credit costs no message of its own. An expired lease
// (Tick) or a dropped window (DropCredit) returns the room; a new window
// gets a new generation and token, so a claim against the old one is
// refused and can never land in room handed to someone else.

// Errors of a refused claim; a requester that gets one drops its window
// and reserves instead.
var (
	// ErrNoCredit: the requester holds no window here (never granted, lease
	// ended and swept, dropped, or the shard restarted).
	ErrNoCredit = errors.New("no credit window")
	// ErrStaleCredit: the claim names another generation than the
	// window's, or the window's lease ended.
	ErrStaleCredit = errors.New("stale credit")
)

// Reasons a claim was refused (CreditStats.Refused keys).
const (
	ClaimNoCredit  = "no_credit"
	ClaimStale     = "stale"
	ClaimBadToken  = "bad_token"
	ClaimOutOfRoom = "outside_window"
	ClaimInvalid   = "invalid"
)

// maxWindowPieces stops top-ups of a window cut into this many pieces:
// a top-up adds one piece, and carving a claim splits at most one in two,
// so a window stays within its bytes over Align pieces.
const maxWindowPieces = 64

// Extent is [Off, Off+Len) of the slab.
type Extent struct{ Off, Len uint64 }

func (e Extent) end() uint64 { return e.Off + e.Len }

// Credit is what a requester learns of its window: generation, token,
// lease end and the free extents it may carve. Extents is a copy.
type Credit struct {
	Gen uint64
	// Version counts the changes of the window's room in this generation:
	// a requester applies what a reply says only when it is newer than
	// what it applied, since replies of pipelined calls may cross.
	Version  uint64
	Token    ids.Token
	Deadline time.Time
	Extents  []Extent
}

// Bytes is the room the window holds.
func (c Credit) Bytes() uint64 {
	var n uint64
	for _, e := range c.Extents {
		n += e.Len
	}
	return n
}

// Claim names bytes a requester wrote into its window: the item, the slab
// offset where they start, and the window's generation and token.
type Claim struct {
	Item
	Offset uint64
	Gen    uint64
	Token  ids.Token
}

// CreditStats counts the standing credit.
type CreditStats struct {
	Windows     int    // live windows
	WindowBytes uint64 // room they hold
	Granted     uint64 // windows granted since New (each a new generation)
	Expired     uint64 // windows whose lease ended
	Dropped     uint64 // windows dropped by their owner's going
	Claimed     uint64 // claims filed as written regions
	ClaimedB    uint64
	// Wasted counts claims answered from the table (cached or following
	// a write under way): their bytes were written for nothing, and the
	// extent went back to the window.
	Wasted   uint64
	WastedB  uint64
	Replayed uint64 // claims of a transfer already known, answered again
	// Refused counts refused claims by reason (Claim* names).
	Refused map[string]uint64
}

type creditKey struct{ peer, owner string }

// window is one requester's standing credit.
type window struct {
	key      creditKey
	gen      uint64
	token    ids.Token
	deadline time.Time
	version  uint64 // changes of its room (Credit.Version)
	want     uint64 // the room it is topped up to
	// pieces are slab allocations the window owns, sorted by offset.
	pieces []Extent
}

func (w *window) bytes() uint64 {
	var n uint64
	for _, p := range w.pieces {
		n += p.Len
	}
	return n
}

func (w *window) credit() Credit {
	return Credit{Gen: w.gen, Version: w.version, Token: w.token, Deadline: w.deadline, Extents: slices.Clone(w.pieces)}
}

// Credit grants or renews the window of owner on peer, asking want bytes
// (capped at Config.CreditWindowBytes): the lease restarts and the window
// is topped up (windowRoom). ok is false
// when no credit is granted (off, nothing asked, or the peer holds windows
// of MaxOwnersPerPeer requesters). A window whose lease ended is replaced
// by a new generation. A window may hold less than asked, or nothing, when
// the slab is full: that is backpressure, and the requester reserves.
func (t *Table) Credit(peer, owner string, want uint64, now time.Time) (Credit, bool) {
	want = min(want, t.cfg.CreditWindowBytes) &^ (slab.Align - 1)
	if want == 0 {
		return Credit{}, false
	}
	key := creditKey{peer, owner}
	w := t.windows[key]
	if w != nil && !now.Before(w.deadline) {
		t.endWindow(w)
		t.credit.Expired++
		w = nil
	}
	if w == nil {
		if t.peerWindows(peer) >= t.cfg.MaxOwnersPerPeer {
			return Credit{}, false
		}
		tok, err := t.tokens.NewToken()
		if err != nil {
			return Credit{}, false
		}
		t.gens++
		t.credit.Granted++
		w = &window{key: key, gen: t.gens, token: tok}
		t.windows[key] = w
	}
	w.want = want
	w.deadline = now.Add(t.cfg.CreditLease)
	if held := w.bytes(); held < want && len(w.pieces) < maxWindowPieces {
		if off, ok := t.windowRoom(want - held); ok {
			n, _ := t.slab.Len(off)
			i, _ := slices.BinarySearchFunc(w.pieces, off, func(p Extent, o uint64) int { return cmpUint(p.Off, o) })
			w.pieces = slices.Insert(w.pieces, i, Extent{off, n})
			w.version++
		}
	}
	return w.credit(), true
}

// windowRoom allocates up to n bytes in one piece for a window: n when a
// free extent holds them, or when evicting resident copies opens one (as
// the reservation the room stands for would), else the largest free
// extent. Room held by regions being written, pinned or not yet loaded is
// never taken: a slab full of those is backpressure, and the window holds
// less, or nothing.
func (t *Table) windowRoom(n uint64) (uint64, bool) {
	off, err := t.slab.Alloc(n)
	if err == nil {
		return off, true
	}
	if victims := t.roomFor(n); victims != nil {
		for _, r := range victims {
			t.evict(r)
		}
		if off, err = t.slab.Alloc(n); err == nil {
			return off, true
		}
	}
	if lf := t.slab.LargestFree(); lf > 0 {
		if off, err = t.slab.Alloc(lf); err == nil {
			return off, true
		}
	}
	return 0, false
}

// DropCredit returns owner's window on peer to the slab (its connection
// went away, or it gave the window up); a later claim against it is
// refused.
func (t *Table) DropCredit(peer, owner string) {
	if w := t.windows[creditKey{peer, owner}]; w != nil {
		t.endWindow(w)
		t.credit.Dropped++
	}
}

func (t *Table) peerWindows(peer string) int {
	n := 0
	for k := range t.windows {
		if k.peer == peer {
			n++
		}
	}
	return n
}

func (t *Table) endWindow(w *window) {
	for _, p := range w.pieces {
		if err := t.slab.Free(p.Off); err != nil {
			t.fault(fmt.Errorf("credit window %d of %q: free [%d,+%d): %w", w.gen, w.key.owner, p.Off, p.Len, err))
		}
	}
	w.pieces = nil
	delete(t.windows, w.key)
}

// expireWindows ends the windows whose lease ran out by now.
func (t *Table) expireWindows(now time.Time) {
	for _, w := range t.windows {
		if !now.Before(w.deadline) {
			t.endWindow(w)
			t.credit.Expired++
		}
	}
}

func (t *Table) nextWindowDeadline() (time.Time, bool) {
	var at time.Time
	for _, w := range t.windows {
		if at.IsZero() || w.deadline.Before(at) {
			at = w.deadline
		}
	}
	return at, !at.IsZero()
}

// windowPieces is every window's room, sorted by offset.
func (t *Table) windowPieces() []Extent {
	var all []Extent
	for _, w := range t.windows {
		all = append(all, w.pieces...)
	}
	slices.SortFunc(all, func(a, b Extent) int { return cmpUint(a.Off, b.Off) })
	return all
}

// Claim files each claim in order, like Reserve, and answers each with a
// Grant; a refused claim (Grant.Err) never fails the batch. A claim is
// checked before any region exists: the requester's window, its
// generation, its token (constant time), its lease, and the extent
// [Offset, Offset+NBytes rounded up) lying inside the window's free room,
// which claimed extents have left: so a claim past the window, over
// another claim or replaying a claimed extent under a new id is refused
// (ErrOutOfBounds). Then:
//   - a transfer id already known is answered as Reserve answers it (a
//     replay after a lost reply gets its grant again, anyone else's
//     nothing), and the extent stays in the window;
//   - an mm_hash this shard holds or is receiving is answered cached or
//     follower, as Reserve would, and the extent stays in the window:
//     its bytes were written for nothing (CreditStats.Wasted); but where
//     its only write is orphaned (PeerGone) and of the same size, the
//     extent becomes the content's copy, as below, and that write's
//     transfers are served with it;
//   - otherwise the extent becomes a region already written: Ready, its
//     Ready events out as for Complete.
func (t *Table) Claim(claims []Claim, now time.Time) []Grant {
	out := make([]Grant, len(claims))
	for i, c := range claims {
		out[i] = t.claim(c, now)
		out[i].TransferID = c.TransferID
	}
	return out
}

func (t *Table) claim(c Claim, now time.Time) Grant {
	refuse := func(why string, err error) Grant {
		if t.credit.Refused == nil {
			t.credit.Refused = map[string]uint64{}
		}
		t.credit.Refused[why]++
		return Grant{Err: err}
	}
	if c.TransferID == "" || c.MMHash == "" || c.NBytes == 0 {
		return refuse(ClaimInvalid, fmt.Errorf("claim transfer %q (%q, %d bytes): %w", c.TransferID, c.MMHash, c.NBytes, ErrInvalid))
	}
	w := t.windows[creditKey{c.Peer, c.Owner}]
	switch {
	case w == nil:
		return refuse(ClaimNoCredit, fmt.Errorf("claim transfer %s (%s): %w", c.TransferID, c.MMHash, ErrNoCredit))
	case c.Gen != w.gen:
		return refuse(ClaimStale, fmt.Errorf("claim transfer %s (%s): generation %d, window is %d: %w", c.TransferID, c.MMHash, c.Gen, w.gen, ErrStaleCredit))
	case !c.Token.Equal(w.token):
		return refuse(ClaimBadToken, fmt.Errorf("claim transfer %s (%s): %w", c.TransferID, c.MMHash, ErrBadToken))
	case !now.Before(w.deadline):
		return refuse(ClaimStale, fmt.Errorf("claim transfer %s (%s): window %d lease ended: %w", c.TransferID, c.MMHash, w.gen, ErrStaleCredit))
	}
	if t.known(c.TransferID) {
		t.credit.Replayed++
		return t.reserve(c.Item, now)
	}
	i, ok := t.pieceFor(w, c.Offset, c.NBytes)
	if !ok {
		return refuse(ClaimOutOfRoom, fmt.Errorf("claim transfer %s (%s): [%d,+%d) is not free room of window %d: %w",
			c.TransferID, c.MMHash, c.Offset, c.NBytes, w.gen, ErrOutOfBounds))
	}
	old := t.byHash[c.MMHash]
	if old != nil && !orphanOf(old, c.Item) {
		t.credit.Wasted++
		t.credit.WastedB += c.NBytes
		return t.reserve(c.Item, now)
	}
	tok, err := t.tokens.NewToken()
	if err != nil {
		return Grant{Err: fmt.Errorf("claim transfer %s (%s): %w", c.TransferID, c.MMHash, err)}
	}
	if err := t.carve(w, i, c.Offset, c.NBytes); err != nil {
		return Grant{Err: t.fault(err)}
	}
	tr := t.newRegion(c.Item, c.Offset, tok, now)
	if old != nil {
		// The content's only write is orphaned (PeerGone): these bytes
		// are its copy, and its transfers are served with the claim's.
		t.adopt(old, tr.region)
	}
	if err := t.Complete(tr.region.res, tok, now); err != nil {
		return Grant{Err: t.fault(fmt.Errorf("claim transfer %s (%s): %w", c.TransferID, c.MMHash, err))}
	}
	t.credit.Claimed++
	t.credit.ClaimedB += c.NBytes
	g := grantFor(tr)
	g.TookOver = old != nil
	return g
}

// known reports whether id names a live or remembered transfer.
func (t *Table) known(id string) bool {
	if _, ok := t.transfers[id]; ok {
		return true
	}
	_, ok := t.tomb.transfers[id]
	return ok
}

// pieceFor finds the piece of w that holds [off, off+n rounded up).
func (t *Table) pieceFor(w *window, off, n uint64) (int, bool) {
	if off%slab.Align != 0 || n > t.slab.Size() {
		return 0, false
	}
	need := (n + slab.Align - 1) &^ (slab.Align - 1)
	for i, p := range w.pieces {
		if p.Off <= off && off < p.end() && need <= p.end()-off {
			return i, true
		}
	}
	return 0, false
}

// carve cuts [off, off+n rounded up) out of piece i of w into a slab
// allocation of its own; what is left of the piece stays in the window.
func (t *Table) carve(w *window, i int, off, n uint64) error {
	p := w.pieces[i]
	end := off + (n+slab.Align-1)&^(slab.Align-1)
	var left []Extent
	if off > p.Off {
		if err := t.slab.Split(p.Off, off); err != nil {
			return fmt.Errorf("credit window %d: carve [%d,%d): %w", w.gen, off, end, err)
		}
		left = append(left, Extent{p.Off, off - p.Off})
	}
	if end < p.end() {
		if err := t.slab.Split(off, end); err != nil {
			return fmt.Errorf("credit window %d: carve [%d,%d): %w", w.gen, off, end, err)
		}
		left = append(left, Extent{end, p.end() - end})
	}
	w.pieces = slices.Replace(w.pieces, i, i+1, left...)
	w.version++
	return nil
}

func (t *Table) creditStats() CreditStats {
	s := t.credit
	s.Refused = maps.Clone(t.credit.Refused)
	s.Windows = len(t.windows)
	for _, w := range t.windows {
		s.WindowBytes += w.bytes()
	}
	return s
}

// checkWindows states the windows' invariants through bad and returns the
// room they hold and in how many slab allocations.
func (t *Table) checkWindows(bad func(string, ...any)) (bytes uint64, pieces int) {
	perPeer := map[string]int{}
	for k, w := range t.windows {
		if w.key != k || w.gen == 0 || w.gen > t.gens || w.deadline.IsZero() {
			bad("credit window of %q/%q: key %v, generation %d of %d, deadline %v", k.peer, k.owner, w.key, w.gen, t.gens, w.deadline)
		}
		if uint64(len(w.pieces)) > w.want/slab.Align+1 {
			bad("credit window %d holds %d pieces for %d bytes", w.gen, len(w.pieces), w.want)
		}
		for i, p := range w.pieces {
			if n, ok := t.slab.Len(p.Off); !ok || n != p.Len {
				bad("credit window %d: piece [%d,+%d) is slab allocation (%d, %v)", w.gen, p.Off, p.Len, n, ok)
			}
			if i > 0 && w.pieces[i-1].end() > p.Off {
				bad("credit window %d: pieces %d and %d overlap or are out of order", w.gen, i-1, i)
			}
			bytes += p.Len
		}
		pieces += len(w.pieces)
		perPeer[k.peer]++
	}
	for peer, n := range perPeer {
		if n > t.cfg.MaxOwnersPerPeer {
			bad("peer %q holds %d credit windows, over %d", peer, n, t.cfg.MaxOwnersPerPeer)
		}
	}
	return bytes, pieces
}
