package wire

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"

	"github.com/ecmooncake/ecmooncake/core/ids"
)

// Grant kinds: what a reservation asks of the producer.
const (
	// KindWrite: write the bytes into the granted region, then complete.
	KindWrite = "write"
	// KindFollow: another transfer of the same mm_hash is writing the
	// region; do not write; completing is a harmless no-op.
	KindFollow = "follow"
	// KindCached: the content is already resident; nothing to write.
	KindCached = "cached"
)

// ShardInfo describes one TP shard of a consumer.
type ShardInfo struct {
	Rank    int    `json:"rank"`
	Control string `json:"control"` // ZeroMQ endpoint of the shard's control server
	// Data maps a transport name to that transport's data-plane address.
	Data map[string]string `json:"data,omitempty"`
	// Epoch names the shard process's incarnation; only the shard that
	// answers knows its own, so the other entries leave it out.
	Epoch string `json:"epoch,omitempty"`
}

// PeersReply answers OpPeers: every shard of the consumer (one entry per TP
// rank), so that a producer that knows one shard can reserve on all.
type PeersReply struct {
	Shards     []ShardInfo `json:"shards"`
	TPSize     int         `json:"tp_size"`
	DPRank     int         `json:"dp_rank"`
	Host       string      `json:"host"` // host identity: equal hosts may use same-host transports
	SlabBytes  uint64      `json:"slab_bytes"`
	Transports []string    `json:"transports"`
}

// Validate requires exactly one shard per rank in [0, TPSize).
func (p PeersReply) Validate() error {
	if p.TPSize < 1 || p.TPSize > MaxItems {
		return fmt.Errorf("%w: tp_size: %d not in [1, %d]", ErrInvalid, p.TPSize, MaxItems)
	}
	if len(p.Shards) != p.TPSize {
		return fmt.Errorf("%w: shards: %d entries for tp_size %d", ErrInvalid, len(p.Shards), p.TPSize)
	}
	seen := make([]bool, p.TPSize)
	for i, s := range p.Shards {
		if s.Rank < 0 || s.Rank >= p.TPSize {
			return fmt.Errorf("%w: shards[%d].rank: %d not in [0, %d)", ErrInvalid, i, s.Rank, p.TPSize)
		}
		if seen[s.Rank] {
			return fmt.Errorf("%w: shards[%d].rank: %d listed twice", ErrInvalid, i, s.Rank)
		}
		seen[s.Rank] = true
		if err := checkIDAt("shards", i, "control", s.Control); err != nil {
			return err
		}
		if err := checkOffer(fmt.Sprintf("shards[%d].data", i), s.Data); err != nil {
			return err
		}
		if err := checkOptionalAt("shards", i, "epoch", s.Epoch); err != nil {
			return err
		}
	}
	if p.DPRank < 0 {
		return fmt.Errorf("%w: dp_rank: %d is negative", ErrInvalid, p.DPRank)
	}
	if err := checkID("host", p.Host); err != nil {
		return err
	}
	if p.SlabBytes == 0 {
		return fmt.Errorf("%w: slab_bytes: must be positive", ErrInvalid)
	}
	if err := checkList("transports", p.Transports); err != nil {
		return err
	}
	if len(p.Transports) == 0 {
		return fmt.Errorf("%w: transports: empty", ErrInvalid)
	}
	return nil
}

// EventPortReply answers OpEventPort: where the shard publishes its events.
type EventPortReply struct {
	Endpoint string `json:"endpoint"`
	// Epoch names the shard's incarnation: a scheduler that sees it change
	// knows the shard restarted and lost every item it held.
	Epoch string `json:"epoch,omitempty"`
}

// Validate requires an endpoint.
func (e EventPortReply) Validate() error {
	if err := checkID("endpoint", e.Endpoint); err != nil {
		return err
	}
	return checkOptional("epoch", e.Epoch)
}

// ReserveItem asks for room for one transfer.
type ReserveItem struct {
	TransferID string `json:"transfer_id"`
	MMHash     string `json:"mm_hash"`
	NBytes     uint64 `json:"nbytes"`
	// Meta is opaque to the core: the producer describes the bytes (dtype
	// and shape of the tensor), and the consumer's engine reads it back
	// when it loads the item, so an item is self-describing.
	Meta string `json:"meta,omitempty"`
}

// MaxMetaLen bounds ReserveItem.Meta.
const MaxMetaLen = 4096

// ReserveBatch is the body of OpReserveBatch: one producer step's items for
// one shard.
type ReserveBatch struct {
	// Requester is the producer's identity: 128 random bits in hex, drawn
	// once per producer. A write grant's token goes only to the requester
	// that made it, and quotas count per requester. Required: a producer
	// that predates it is refused with a reply that says so.
	Requester string        `json:"requester"`
	Items     []ReserveItem `json:"items"`
	// CreditBytes asks the shard for a standing credit window of that
	// many bytes (credit.go); 0 asks for none. The reply carries it.
	CreditBytes uint64 `json:"credit_bytes,omitempty"`
}

// RequesterLen is the length of ReserveBatch.Requester: 16 bytes in hex.
const RequesterLen = 32

// Validate requires a requester and 1..MaxItems items, each with both
// ids and a size.
func (b ReserveBatch) Validate() error {
	if err := b.checkItems(); err != nil {
		return err
	}
	return checkRequester(b.Requester)
}

func (b ReserveBatch) checkItems() error {
	return checkItems(b.Items, func(i int, it ReserveItem) error { return it.check(i) })
}

// check validates item i of a batch.
func (it ReserveItem) check(i int) error {
	if err := checkIDAt("items", i, "transfer_id", it.TransferID); err != nil {
		return err
	}
	if err := checkIDAt("items", i, "mm_hash", it.MMHash); err != nil {
		return err
	}
	if it.NBytes == 0 {
		return fmt.Errorf("%w: items[%d].nbytes: must be positive", ErrInvalid, i)
	}
	if len(it.Meta) > MaxMetaLen {
		return fmt.Errorf("%w: items[%d].meta: %d bytes, at most %d", ErrInvalid, i, len(it.Meta), MaxMetaLen)
	}
	return nil
}

// Grant answers one ReserveItem. Err, when set, refuses the item and the
// other fields may be empty.
type Grant struct {
	TransferID string    `json:"transfer_id"`
	Kind       string    `json:"kind,omitempty"` // KindWrite, KindFollow or KindCached
	Res        uint64    `json:"res,omitempty"`
	Token      ids.Token `json:"token,omitzero"`
	NBytes     uint64    `json:"nbytes,omitempty"`
	// Addr is set on a write grant of a one-sided data plane (mooncake):
	// the remote address of the reserved region, the only place the
	// producer may write. Other data planes leave it out.
	Addr uint64 `json:"addr,omitempty"`
	Err  string `json:"err,omitempty"`
	// Code names a refusal a producer reports by name (GrantInProgress,
	// GrantOverQuota); empty for the others.
	Code string `json:"code,omitempty"`
}

// Grant refusal codes.
const (
	// GrantInProgress: another requester holds the write grant of this
	// transfer; its token goes to nobody else.
	GrantInProgress = "in_progress"
	// GrantOverQuota: the requester holds its share of the shard's pending
	// reservations, bytes or followers.
	GrantOverQuota = "over_quota"
)

// ReserveBatchReply answers ReserveBatch, one grant per item, in order.
type ReserveBatchReply struct {
	Grants []Grant `json:"grants"`
	// Epoch, Host and Data say which incarnation of the shard issued the
	// grants and where its data plane listens (as in PeersReply), so that
	// a producer writes every grant to the process that issued it, even
	// when the shard restarted since the producer last looked it up.
	Epoch string            `json:"epoch,omitempty"`
	Host  string            `json:"host,omitempty"`
	Data  map[string]string `json:"data,omitempty"`
	// Credit is the requester's credit window, when it asked for one and
	// the shard granted it.
	Credit *CreditGrant `json:"credit,omitempty"`
}

// Validate requires every accepted grant to say what to do, and a write
// grant to carry the reservation and token the write will present.
func (r ReserveBatchReply) Validate() error {
	if err := checkOptional("epoch", r.Epoch); err != nil {
		return err
	}
	if err := checkOptional("host", r.Host); err != nil {
		return err
	}
	if err := checkOffer("data", r.Data); err != nil {
		return err
	}
	if err := r.Credit.validate(); err != nil {
		return err
	}
	return checkGrants(r.Grants)
}

// checkGrants is the check of a reply's grants (ReserveBatchReply,
// ClaimBatchReply).
func checkGrants(grants []Grant) error {
	if len(grants) > MaxItems {
		return fmt.Errorf("%w: grants: %d entries, limit %d", ErrInvalid, len(grants), MaxItems)
	}
	for i, g := range grants {
		if err := checkIDAt("grants", i, "transfer_id", g.TransferID); err != nil {
			return err
		}
		if g.Err != "" {
			continue
		}
		switch g.Kind {
		case KindWrite:
			if g.Res == 0 {
				return fmt.Errorf("%w: grants[%d].res: a write grant needs a reservation", ErrInvalid, i)
			}
			if g.Token.IsZero() {
				return fmt.Errorf("%w: grants[%d].token: a write grant needs a token", ErrInvalid, i)
			}
		case KindFollow, KindCached:
		default:
			return fmt.Errorf("%w: grants[%d].kind: %q is not write, follow or cached", ErrInvalid, i, g.Kind)
		}
		if g.NBytes == 0 {
			return fmt.Errorf("%w: grants[%d].nbytes: must be positive", ErrInvalid, i)
		}
	}
	return nil
}

// CompleteItem reports the end of one transfer's write: done, or abandoned
// with a reason. Res and Token are checked against the reservation by the
// consumer, not here.
type CompleteItem struct {
	TransferID string    `json:"transfer_id"`
	Res        uint64    `json:"res,omitempty"`
	Token      ids.Token `json:"token,omitzero"`
	Abandon    bool      `json:"abandon,omitempty"`
	Reason     string    `json:"reason,omitempty"`
}

// CompleteBatch is the body of OpCompleteBatch.
type CompleteBatch struct {
	Items []CompleteItem `json:"items"`
}

// Validate requires 1..MaxItems items with transfer ids.
func (b CompleteBatch) Validate() error {
	return checkItems(b.Items, func(i int, it CompleteItem) error {
		return checkIDAt("items", i, "transfer_id", it.TransferID)
	})
}

// ItemResult answers one item of a batch; Err is empty on success.
type ItemResult struct {
	TransferID string `json:"transfer_id"`
	Err        string `json:"err,omitempty"`
}

// CompleteBatchReply answers CompleteBatch, one result per item, in order.
type CompleteBatchReply struct {
	Results []ItemResult `json:"results"`
}

// Validate requires transfer ids on at most MaxItems results.
func (r CompleteBatchReply) Validate() error {
	if len(r.Results) > MaxItems {
		return fmt.Errorf("%w: results: %d entries, limit %d", ErrInvalid, len(r.Results), MaxItems)
	}
	for i, it := range r.Results {
		if err := checkIDAt("results", i, "transfer_id", it.TransferID); err != nil {
			return err
		}
	}
	return nil
}

// Cancel is the body of OpCancel.
type Cancel struct {
	TransferIDs []string `json:"transfer_ids"`
}

// Validate requires 1..MaxItems transfer ids.
func (c Cancel) Validate() error {
	if err := checkCount("transfer_ids", len(c.TransferIDs)); err != nil {
		return err
	}
	return checkList("transfer_ids", c.TransferIDs)
}

// CancelReply answers Cancel with how many transfers it stopped.
type CancelReply struct {
	Cancelled int `json:"cancelled"`
}

// Validate rejects a negative count.
func (c CancelReply) Validate() error {
	if c.Cancelled < 0 {
		return fmt.Errorf("%w: cancelled: %d is negative", ErrInvalid, c.Cancelled)
	}
	return nil
}

// Status is the body of OpStatus. An empty list asks for every transfer the
// shard holds (the scheduler's resync after it missed events); the reply is
// then capped at MaxItems.
type Status struct {
	TransferIDs []string `json:"transfer_ids,omitempty"`
}

// Validate requires at most MaxItems well-formed ids.
func (s Status) Validate() error { return checkList("transfer_ids", s.TransferIDs) }

// ItemStatus is one transfer as a shard sees it. Known is false for an id
// the shard has never seen (or has forgotten); Done is true once the bytes
// are ready to load.
type ItemStatus struct {
	TransferID string `json:"transfer_id"`
	MMHash     string `json:"mm_hash,omitempty"`
	State      string `json:"state,omitempty"`
	NBytes     uint64 `json:"nbytes,omitempty"`
	Known      bool   `json:"known"`
	Done       bool   `json:"done"`
}

// StatusReply answers Status.
type StatusReply struct {
	Items []ItemStatus `json:"items"`
	// Epoch names the shard incarnation that answered, so that a
	// scheduler does not mistake a new incarnation's items for the old's.
	Epoch string `json:"epoch,omitempty"`
}

// Validate requires transfer ids on at most MaxItems items, and a hash and
// state on every known one.
func (r StatusReply) Validate() error {
	if len(r.Items) > MaxItems {
		return fmt.Errorf("%w: items: %d entries, limit %d", ErrInvalid, len(r.Items), MaxItems)
	}
	if err := checkOptional("epoch", r.Epoch); err != nil {
		return err
	}
	for i, it := range r.Items {
		if err := checkIDAt("items", i, "transfer_id", it.TransferID); err != nil {
			return err
		}
		if !it.Known {
			continue
		}
		if err := checkIDAt("items", i, "mm_hash", it.MMHash); err != nil {
			return err
		}
		if it.State == "" {
			return fmt.Errorf("%w: items[%d].state: empty on a known item", ErrInvalid, i)
		}
	}
	return nil
}

// DecodeBody decodes and validates a request or reply body. Unknown fields
// are ignored so that a newer peer may add some; a missing or out-of-bounds
// required field is an error (wrapping ErrInvalid) that names it.
func DecodeBody[T interface{ Validate() error }](raw json.RawMessage) (T, error) {
	var v T
	err := UnmarshalBody(raw, &v)
	return v, err
}

// UnmarshalBody is DecodeBody for a destination known only at run time (a
// pointer); it validates when the destination has a Validate method.
func UnmarshalBody(raw json.RawMessage, out any) error {
	name := typeName(out)
	if len(raw) == 0 {
		return fmt.Errorf("wire: decode %s: %w: missing body", name, ErrMalformed)
	}
	if err := decode(name, raw, out); err != nil {
		return err
	}
	if c, ok := out.(canonicalizer); ok {
		c.canonicalize()
	}
	if v, ok := out.(validator); ok {
		if err := v.Validate(); err != nil {
			return fmt.Errorf("wire: decode %s: %w", name, err)
		}
	}
	return nil
}

// canonicalizer is a body with optional (omitempty) collections. A peer
// may send one empty ("data":{}, "transfer_ids":[]), which decodes to an
// empty collection but re-encodes to nothing, which decodes to nil: the
// body would not survive being passed on. canonicalize makes the decoded
// value the one its encoding decodes to.
type canonicalizer interface{ canonicalize() }

func (p *PeersReply) canonicalize() {
	for i := range p.Shards {
		p.Shards[i].Data = nilIfEmpty(p.Shards[i].Data)
	}
}

func (r *ReserveBatchReply) canonicalize() { r.Data = nilIfEmpty(r.Data) }

func (s *Status) canonicalize() {
	if len(s.TransferIDs) == 0 {
		s.TransferIDs = nil
	}
}

func nilIfEmpty(m map[string]string) map[string]string {
	if len(m) == 0 {
		return nil
	}
	return m
}

func typeName(v any) string {
	t := reflect.TypeOf(v)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil || t.Name() == "" {
		return "body"
	}
	return t.Name()
}

func checkID(field, s string) error {
	if s == "" {
		return fmt.Errorf("%w: %s: empty", ErrInvalid, field)
	}
	if len(s) > MaxIDLen {
		return fmt.Errorf("%w: %s: %d bytes, limit %d", ErrInvalid, field, len(s), MaxIDLen)
	}
	return nil
}

// checkIDAt is checkID of list[i].field, naming it only when it fails:
// a control message checks every item's ids, and a name built for each
// would cost more than the checks.
func checkIDAt(list string, i int, field, s string) error {
	if s != "" && len(s) <= MaxIDLen {
		return nil
	}
	return checkID(fmt.Sprintf("%s[%d].%s", list, i, field), s)
}

// checkOptionalAt is checkOptional of list[i].field, named only when it
// fails.
func checkOptionalAt(list string, i int, field, s string) error {
	if len(s) <= MaxIDLen {
		return nil
	}
	return checkOptional(fmt.Sprintf("%s[%d].%s", list, i, field), s)
}

// checkOptional bounds a field that may be empty.
func checkOptional(field, s string) error {
	if len(s) > MaxIDLen {
		return fmt.Errorf("%w: %s: %d bytes, limit %d", ErrInvalid, field, len(s), MaxIDLen)
	}
	return nil
}

// checkOffer checks a transport-name to data-plane-address map.
func checkOffer(field string, offer map[string]string) error {
	if len(offer) > MaxItems {
		return fmt.Errorf("%w: %s: %d entries, limit %d", ErrInvalid, field, len(offer), MaxItems)
	}
	for name, addr := range offer {
		if err := checkID(field+" key", name); err != nil {
			return err
		}
		if err := checkID(fmt.Sprintf("%s[%q]", field, name), addr); err != nil {
			return err
		}
	}
	return nil
}

// checkItems requires 1..MaxItems items, each passing check.
func checkItems[T any](items []T, check func(i int, it T) error) error {
	if err := checkCount("items", len(items)); err != nil {
		return err
	}
	for i, it := range items {
		if err := check(i, it); err != nil {
			return err
		}
	}
	return nil
}

func checkCount(field string, n int) error {
	if n == 0 {
		return fmt.Errorf("%w: %s: empty", ErrInvalid, field)
	}
	if n > MaxItems {
		return fmt.Errorf("%w: %s: %d entries, limit %d", ErrInvalid, field, n, MaxItems)
	}
	return nil
}

func checkList(field string, ss []string) error {
	if len(ss) > MaxItems {
		return fmt.Errorf("%w: %s: %d entries, limit %d", ErrInvalid, field, len(ss), MaxItems)
	}
	for i, s := range ss {
		if s != "" && len(s) <= MaxIDLen {
			continue // named only when it fails
		}
		if err := checkID(fmt.Sprintf("%s[%d]", field, i), s); err != nil {
			return err
		}
	}
	return nil
}

func checkRequester(r string) error {
	if r == "" {
		return fmt.Errorf("%w: requester: missing: the producer predates grants bound to their requester; upgrade it to this shard's release", ErrInvalid)
	}
	if len(r) != RequesterLen || strings.Trim(r, "0123456789abcdef") != "" {
		return fmt.Errorf("%w: requester: want %d lowercase hex digits (128 random bits), got %d bytes", ErrInvalid, RequesterLen, len(r))
	}
	return nil
}
