package tcp

import (
	"encoding/binary"
	"fmt"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/serve"
)

// Wire layout (little-endian). A data frame is a fixed HeaderLen-byte
// header followed by Length payload bytes:
//
//	0  magic "ECMW"   4  version u8   5  flags u8 (FlagComplete)   6  reserved u16
//	8  seq u64        16 res u64      24 token [16]byte
//	40 offset u64     48 length u64
//
// An ack is a fixed AckHeaderLen-byte header followed by msglen bytes of
// text:
//
//	0  magic "ECMA"   4  seq u64      12 status u16  14 msglen u16
const (
	HeaderLen    = 56
	AckHeaderLen = 16
	Version      = 1
	// MaxFrame bounds one frame's payload, so a header alone can never make
	// a receiver wait for (or drain) an unbounded amount of data.
	MaxFrame = 1 << 30
	// MaxAckMsg bounds an ack's message; longer messages are truncated.
	MaxAckMsg = 1 << 10
)

const (
	frameMagic = "ECMW"
	ackMagic   = "ECMA"
)

// FlagComplete, in a header's flags, says the frame carries its item's
// completion: the receiver completes the reservation in-band once every
// byte of it has landed (see transport.CompleteSink), so no complete
// message follows the item. It is the one flag defined: a frame with any
// other flag or reserved bit set is refused, so that a later version can
// give those bits meaning without a receiver misreading it.
const FlagComplete = 1

// Header is a decoded data-frame header.
type Header struct {
	Seq    uint64
	Res    ids.ResID
	Token  ids.Token
	Offset uint64
	Length uint64
	// Complete: FlagComplete is set.
	Complete bool
}

// AppendHeader appends h's wire form to b.
func AppendHeader(b []byte, h Header) []byte {
	b = append(b, frameMagic...)
	var flags byte
	if h.Complete {
		flags = FlagComplete
	}
	b = append(b, Version, flags, 0, 0)
	b = binary.LittleEndian.AppendUint64(b, h.Seq)
	b = binary.LittleEndian.AppendUint64(b, uint64(h.Res))
	b = append(b, h.Token[:]...)
	b = binary.LittleEndian.AppendUint64(b, h.Offset)
	return binary.LittleEndian.AppendUint64(b, h.Length)
}

// DecodeHeader decodes the header at the start of b. Every error wraps
// ErrBadFrame; the connection it came from can no longer be trusted to be
// in step.
func DecodeHeader(b []byte) (Header, error) {
	if len(b) < HeaderLen {
		return Header{}, fmt.Errorf("transport: frame header: %d of %d bytes: %w", len(b), HeaderLen, transport.ErrBadFrame)
	}
	if string(b[:4]) != frameMagic {
		return Header{}, fmt.Errorf("transport: frame header: magic %q: %w", b[:4], transport.ErrBadFrame)
	}
	if b[4] != Version {
		return Header{}, fmt.Errorf("transport: frame header: version %d, want %d: %w", b[4], Version, transport.ErrBadFrame)
	}
	if b[5]&^FlagComplete != 0 || b[6] != 0 || b[7] != 0 {
		return Header{}, fmt.Errorf("transport: frame header: flags %#x reserved %#x%02x not zero: %w", b[5], b[7], b[6], transport.ErrBadFrame)
	}
	h := Header{
		Seq:      binary.LittleEndian.Uint64(b[8:]),
		Res:      ids.ResID(binary.LittleEndian.Uint64(b[16:])),
		Offset:   binary.LittleEndian.Uint64(b[40:]),
		Length:   binary.LittleEndian.Uint64(b[48:]),
		Complete: b[5]&FlagComplete != 0,
	}
	copy(h.Token[:], b[24:40])
	if h.Length > MaxFrame {
		return Header{}, fmt.Errorf("transport: frame header: length %d over %d: %w", h.Length, MaxFrame, transport.ErrBadFrame)
	}
	return h, nil
}

// Ack is a receiver's answer to one frame, matched to it by Seq.
type Ack struct {
	Seq    uint64
	Status transport.Status
	Msg    string
}

// AppendAck appends a's wire form to b, truncating Msg to MaxAckMsg bytes.
func AppendAck(b []byte, a Ack) []byte {
	msg := serve.ClipMsg(a.Msg, MaxAckMsg)
	b = append(b, ackMagic...)
	b = binary.LittleEndian.AppendUint64(b, a.Seq)
	b = binary.LittleEndian.AppendUint16(b, uint16(a.Status))
	b = binary.LittleEndian.AppendUint16(b, uint16(len(msg)))
	return append(b, msg...)
}

// DecodeAck decodes the ack at the start of b; b must hold its message too.
// Every error wraps ErrBadFrame.
func DecodeAck(b []byte) (Ack, error) {
	a, n, err := decodeAckHead(b)
	if err != nil {
		return Ack{}, err
	}
	if len(b) < AckHeaderLen+n {
		return Ack{}, fmt.Errorf("transport: ack: message %d of %d bytes: %w", len(b)-AckHeaderLen, n, transport.ErrBadFrame)
	}
	a.Msg = string(b[AckHeaderLen : AckHeaderLen+n])
	return a, nil
}

// decodeAckHead decodes the fixed part of an ack and returns the length of
// the message that follows, so a stream reader knows how much more to read.
func decodeAckHead(b []byte) (Ack, int, error) {
	if len(b) < AckHeaderLen {
		return Ack{}, 0, fmt.Errorf("transport: ack: %d of %d bytes: %w", len(b), AckHeaderLen, transport.ErrBadFrame)
	}
	if string(b[:4]) != ackMagic {
		return Ack{}, 0, fmt.Errorf("transport: ack: magic %q: %w", b[:4], transport.ErrBadFrame)
	}
	n := int(binary.LittleEndian.Uint16(b[14:]))
	if n > MaxAckMsg {
		return Ack{}, 0, fmt.Errorf("transport: ack: message length %d over %d: %w", n, MaxAckMsg, transport.ErrBadFrame)
	}
	a := Ack{
		Seq:    binary.LittleEndian.Uint64(b[4:]),
		Status: transport.Status(binary.LittleEndian.Uint16(b[12:])),
	}
	return a, n, nil
}
