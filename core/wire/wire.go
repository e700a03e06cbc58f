package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	fastjson "github.com/go-json-experiment/json/v1"
)

const (
	// Version is the protocol version every envelope carries.
	Version = 1
	// MaxMessage bounds one encoded message, so a peer cannot make a
	// decoder allocate without limit.
	MaxMessage = 16 << 20
	// MaxItems bounds the items of one batch (and every other list).
	MaxItems = 8192
	// MaxIDLen bounds transfer ids, mm hashes and other names.
	MaxIDLen = 512
)

// Op names a request.
type Op string

// The ops a consumer shard serves.
const (
	OpPeers         Op = "peers"          // no body → PeersReply
	OpEventPort     Op = "event_port"     // no body → EventPortReply
	OpReserveBatch  Op = "reserve_batch"  // ReserveBatch → ReserveBatchReply
	OpCompleteBatch Op = "complete_batch" // CompleteBatch → CompleteBatchReply
	OpCancel        Op = "cancel"         // Cancel → CancelReply
	OpStatus        Op = "status"         // Status → StatusReply
	OpClaimBatch    Op = "claim_batch"    // ClaimBatch → ClaimBatchReply (credit.go)
)

// Known reports whether this build serves o.
func (o Op) Known() bool {
	switch o {
	case OpPeers, OpEventPort, OpReserveBatch, OpCompleteBatch, OpCancel, OpStatus, OpClaimBatch:
		return true
	}
	return false
}

// Reply error codes. Handlers may add their own; these are the ones the
// codec and the server produce.
const (
	CodeBadRequest   = "bad_request"
	CodeVersion      = "version"
	CodeUnknownOp    = "unknown_op"
	CodeInternal     = "internal"
	CodeShuttingDown = "shutting_down"
	CodeTooLarge     = "too_large"
)

// Sentinels, one per code. ErrMalformed and ErrInvalid refine ErrBadRequest
// so that a caller can tell broken JSON from a missing field locally while
// both travel as CodeBadRequest.
var (
	ErrBadRequest   = errors.New("bad request")
	ErrMalformed    = fmt.Errorf("%w: malformed", ErrBadRequest)
	ErrInvalid      = fmt.Errorf("%w: invalid", ErrBadRequest)
	ErrVersion      = errors.New("version mismatch")
	ErrUnknownOp    = errors.New("unknown op")
	ErrInternal     = errors.New("internal error")
	ErrShuttingDown = errors.New("shutting down")
	ErrTooLarge     = errors.New("message too large")
)

var codeSentinel = map[string]error{
	CodeBadRequest:   ErrBadRequest,
	CodeVersion:      ErrVersion,
	CodeUnknownOp:    ErrUnknownOp,
	CodeInternal:     ErrInternal,
	CodeShuttingDown: ErrShuttingDown,
	CodeTooLarge:     ErrTooLarge,
}

// CodeOf maps an error to the reply code that reports it: the code of an
// *Error, the code of a wrapped sentinel, else CodeInternal. It returns ""
// for nil.
func CodeOf(err error) string {
	if err == nil {
		return ""
	}
	var we *Error
	if errors.As(err, &we) {
		return we.Code
	}
	for _, code := range []string{CodeTooLarge, CodeVersion, CodeUnknownOp, CodeShuttingDown, CodeBadRequest} {
		if errors.Is(err, codeSentinel[code]) {
			return code
		}
	}
	return CodeInternal
}

// Error is a reply's failure. It matches the sentinel of its code with
// errors.Is, so remote and local failures are tested the same way.
type Error struct {
	Code string `json:"code"`
	Msg  string `json:"msg,omitempty"`
}

func (e *Error) Error() string {
	if e.Msg == "" {
		return e.Code
	}
	return e.Code + ": " + e.Msg
}

// Is reports whether target is the sentinel of e's code.
func (e *Error) Is(target error) bool {
	s, ok := codeSentinel[e.Code]
	return ok && s == target
}

// Request is the envelope of a call.
type Request struct {
	V    int             `json:"v"`
	ID   uint64          `json:"id"`
	Op   Op              `json:"op"`
	Body json.RawMessage `json:"body,omitempty"`
	// Peer names the connection the request came on as the server that
	// received it proved it ("zmq:<routing id>", "unix:uid=<uid>:conn=<n>",
	// "inmem:<links>#<n>"); the server sets it and never reads it off
	// the wire, so a peer cannot name another.
	Peer string `json:"-"`
}

// Reply answers the Request with the same ID.
type Reply struct {
	V    int             `json:"v"`
	ID   uint64          `json:"id"`
	Err  *Error          `json:"err,omitempty"`
	Body json.RawMessage `json:"body,omitempty"`
}

// Validate checks the envelope: version, op and id.
func (r Request) Validate() error {
	if r.V != Version {
		return versionErr(r.V)
	}
	if !r.Op.Known() {
		return fmt.Errorf("%w %q", ErrUnknownOp, r.Op)
	}
	if r.ID == 0 {
		return fmt.Errorf("%w: id: must be non-zero", ErrInvalid)
	}
	return nil
}

// Validate checks the envelope. Id 0 is allowed only on an error reply: it
// is how a server answers a request whose id it could not read.
func (r Reply) Validate() error {
	if r.V != Version {
		return versionErr(r.V)
	}
	if r.Err != nil {
		if r.Err.Code == "" {
			return fmt.Errorf("%w: err.code: empty", ErrInvalid)
		}
		if len(r.Body) > 0 {
			return fmt.Errorf("%w: reply carries both err and body", ErrInvalid)
		}
		return nil
	}
	if r.ID == 0 {
		return fmt.Errorf("%w: id: must be non-zero on a reply without err", ErrInvalid)
	}
	return nil
}

func versionErr(v int) error {
	return fmt.Errorf("%w: message is v%d, this build speaks v%d", ErrVersion, v, Version)
}

// NewRequest builds a request of this version, marshalling body (nil for
// ops without one) and validating both envelope and body.
func NewRequest(id uint64, op Op, body any) (Request, error) {
	req := Request{V: Version, ID: id, Op: op}
	if err := req.Validate(); err != nil {
		return req, fmt.Errorf("wire: new %s request: %w", op, err)
	}
	raw, err := marshalBody(body)
	if err != nil {
		return req, fmt.Errorf("wire: new %s request: %w", op, err)
	}
	req.Body = raw
	return req, nil
}

// OKReply answers id with body. A body that cannot be marshalled is a bug
// on the serving side, so it becomes a CodeInternal reply rather than an
// error the handler would have to route.
func OKReply(id uint64, body any) Reply {
	raw, err := marshalBody(body)
	if err != nil {
		return ErrReply(id, CodeInternal, err.Error())
	}
	return Reply{V: Version, ID: id, Body: raw}
}

// ErrReply answers id with a failure.
func ErrReply(id uint64, code, msg string) Reply {
	return Reply{V: Version, ID: id, Err: &Error{Code: code, Msg: msg}}
}

// marshalBody encodes a body; nil (or a typed nil) means no body. A body
// with a Validate method is validated so that a bad request fails at its
// author rather than at the far end.
func marshalBody(body any) (json.RawMessage, error) {
	if body == nil {
		return nil, nil
	}
	raw, err := marshal(body)
	if err != nil {
		return nil, fmt.Errorf("encode body %T: %w", body, err)
	}
	if bytes.Equal(raw, null) {
		return nil, nil
	}
	if v, ok := body.(validator); ok {
		if err := v.Validate(); err != nil {
			return nil, fmt.Errorf("body %T: %w", body, err)
		}
	}
	return raw, nil
}

type validator interface{ Validate() error }

var null = []byte("null")

// marshal encodes without HTML escaping: the bytes never meet a browser,
// and escaping would make a decoded body re-encode differently.
func marshal(v any) ([]byte, error) {
	var buf bytes.Buffer
	enc := fastjson.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte{'\n'}), nil
}

func encode(what string, v validator) ([]byte, error) {
	if err := v.Validate(); err != nil {
		return nil, fmt.Errorf("wire: encode %s: %w", what, err)
	}
	b, err := marshal(v)
	if err != nil {
		return nil, fmt.Errorf("wire: encode %s: %w", what, err)
	}
	if len(b) > MaxMessage {
		return nil, fmt.Errorf("wire: encode %s: %w: %d bytes, limit %d", what, ErrTooLarge, len(b), MaxMessage)
	}
	return b, nil
}

// decode unmarshals b into v and reports size and JSON failures; the
// caller validates.
func decode(what string, b []byte, v any) error {
	if len(b) > MaxMessage {
		return fmt.Errorf("wire: decode %s: %w: %d bytes, limit %d", what, ErrTooLarge, len(b), MaxMessage)
	}
	if err := fastjson.Unmarshal(b, v); err != nil {
		return fmt.Errorf("wire: decode %s: %w: %v", what, ErrMalformed, err)
	}
	return nil
}

// canonical makes a decoded raw body compare equal to its re-encoding:
// JSON null is no body, anything else is compacted.
func canonical(raw json.RawMessage) json.RawMessage {
	if len(raw) == 0 || bytes.Equal(raw, null) {
		return nil
	}
	if bytes.IndexAny(raw, " \t\r\n") < 0 {
		// Nothing to take out, as in what the encoders here write: a
		// 256-item reserve's body takes ~140 µs to compact on the 2-core
		// machine, ~16 to search. raw is valid JSON: it was decoded as a
		// raw value.
		return raw
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, raw); err != nil {
		return raw
	}
	return buf.Bytes()
}

// EncodeRequest validates and encodes r.
func EncodeRequest(r Request) ([]byte, error) { return encode("request", r) }

// DecodeRequest decodes and validates one request frame. On failure the
// returned Request holds whatever was recovered (at least the id when it
// could be read), so that the server can answer that id.
func DecodeRequest(b []byte) (Request, error) { return decodeFrame[Request]("request", b) }

// EncodeReply validates and encodes r.
func EncodeReply(r Reply) ([]byte, error) { return encode("reply", r) }

// DecodeReply decodes and validates one reply frame; on failure the id is
// recovered when possible, as for DecodeRequest.
func DecodeReply(b []byte) (Reply, error) { return decodeFrame[Reply]("reply", b) }

func (r *Request) head() (*uint64, *json.RawMessage) { return &r.ID, &r.Body }
func (r *Reply) head() (*uint64, *json.RawMessage)   { return &r.ID, &r.Body }

// decodeFrame is DecodeRequest and DecodeReply: head gives it the id and
// body every frame has.
func decodeFrame[F any, P interface {
	*F
	validator
	head() (*uint64, *json.RawMessage)
}](what string, b []byte) (F, error) {
	var f F
	id, body := P(&f).head()
	if err := decode(what, b, &f); err != nil {
		var bare F
		bareID, _ := P(&bare).head()
		*bareID = recoverID(b, *id)
		return bare, err
	}
	*body = canonical(*body)
	if err := P(&f).Validate(); err != nil {
		return f, fmt.Errorf("wire: decode %s %d: %w", what, *id, err)
	}
	return f, nil
}

// recoverID returns the id of a message that failed to decode: the one
// json.Unmarshal filled in (it keeps going past type errors), else one read
// from the head of the bytes (a syntax error leaves nothing filled in).
func recoverID(b []byte, decoded uint64) uint64 {
	if decoded != 0 {
		return decoded
	}
	return peekID(b)
}

// peekLimit bounds how much of a broken or oversized message is scanned for
// its id; encoders write the id second, right at the start.
const peekLimit = 4096

// peekID reads the top-level "id" of a JSON object from the first
// peekLimit bytes, tolerating a broken or cut-off remainder.
func peekID(b []byte) uint64 {
	if len(b) > peekLimit {
		b = b[:peekLimit]
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return 0
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return 0
		}
		key, _ := tok.(string)
		// encoding/json matches field names case-insensitively; so do we.
		if strings.EqualFold(key, "id") {
			var id uint64
			if dec.Decode(&id) != nil {
				return 0
			}
			return id
		}
		var skip json.RawMessage
		if dec.Decode(&skip) != nil {
			return 0
		}
	}
	return 0
}
