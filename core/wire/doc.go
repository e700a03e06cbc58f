// Package wire defines the control-plane messages of ecmooncake and their
// codec. It owns the bytes that cross a ZeroMQ socket and nothing else: no
// sockets, no goroutines, no state.
//
// # Framing
//
// Every message is one ZeroMQ frame of at most MaxMessage bytes: a JSON
// object, or, for events, a binary event message. There are three
// envelopes:
//
//   - Request {v, id, op, body}: producer or scheduler → consumer shard
//     (DEALER → ROUTER). The id is chosen by the caller, is never zero, and
//     lets many requests be in flight on one socket.
//   - Reply {v, id, err, body}: the answer to the request with the same id.
//     A reply carries either err or body. A reply with id 0 answers a request
//     whose id could not be read; no caller can match it.
//   - Event message: the readiness or abandonment of transfers, or (kind
//     gone) the end of a shard's copy of an mm_hash, consumer shard →
//     consumer scheduler (PUSH → PULL), one message per flush of the shard
//     holding every event of it. It is binary, not JSON (eventbatch.go
//     gives the layout): a header with the version, the shard, the first
//     event's seq and the send time, then up to MaxEventRecords records.
//     Seq counts events of one publisher from 1 with no holes; a hole
//     means events were dropped and the scheduler must resync with the
//     status op. A JSON event, what builds before event messages sent, is
//     refused with ErrLegacyEvent (a kind of ErrVersion).
//
// Every envelope carries v == Version. A peer of another version is refused
// with CodeVersion rather than guessed at: both sides run from one build in
// a deployment, so a mismatch is a deployment error worth surfacing loudly.
//
// # Decoding
//
// The JSON envelopes and bodies are encoded and decoded with
// github.com/go-json-experiment/json/v1: encoding/json's API and
// semantics on the engine of encoding/json/v2 (what encoding/json itself
// runs on from Go 1.27). A reserve of 256 items and its reply take half
// the time they took with encoding/json (BenchmarkReserveRoundTrip256),
// on the path of every batch. Differential fuzz targets (the
// *AgreesWithStd ones) hold it to encoding/json: the same inputs accepted,
// the same values decoded, the same bytes encoded.
//
// DecodeRequest and DecodeReply check, in order: size, JSON, version, op
// (requests), required fields; DecodeEvents size, tag, version, bounds,
// then each record's fields. Every failure wraps one of the
// exported sentinels (ErrTooLarge, ErrMalformed, ErrInvalid, ErrVersion,
// ErrUnknownOp) so that callers branch with errors.Is, and CodeOf turns it
// into the reply code. On failure the decoders still return what they could
// recover, notably the request id, so a server can answer the right caller:
//
//	req, err := wire.DecodeRequest(frame)
//	if err != nil {
//		return wire.ErrReply(req.ID, wire.CodeOf(err), err.Error())
//	}
//	switch req.Op {
//	case wire.OpReserveBatch:
//		body, err := wire.DecodeBody[wire.ReserveBatch](req.Body)
//		if err != nil {
//			return wire.ErrReply(req.ID, wire.CodeOf(err), err.Error())
//		}
//		...
//		return wire.OKReply(req.ID, wire.ReserveBatchReply{Grants: grants})
//	}
//
// Bodies are decoded with DecodeBody, which ignores unknown fields (a newer
// peer may add some) and runs the body's Validate, so a handler only ever
// sees bodies whose required fields are present and within bounds. Validate
// checks syntax, not meaning: whether a reservation id and token match a live
// reservation is the reservation state machine's business.
//
// A reply's err is an *Error; it matches the sentinel of its code, so
// errors.Is(err, wire.ErrVersion) holds for a version refusal that came
// over the network as well as for a local decode failure.
//
// # Invariants
//
//   - Decoded values are canonical: anything that decodes re-encodes to bytes
//     that decode to an equal value (the fuzz targets check this).
//   - Decoding never panics, whatever the bytes.
//   - Ids (transfer ids, mm hashes) are non-empty and at most MaxIDLen bytes;
//     a batch holds at most MaxItems items; byte counts are positive.
package wire
