package cudaipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/serve"
)

// The shard's abstract socket serves, per producer connection, the hello
// and then the producer's announcements of ready words; the shard sends
// nothing after the hello reply, and the connection stays open for as
// long as the producer keeps the slab mapped, so that each side learns at
// once when the other goes. Little-endian:
//
//	request:  0 magic "ECMI"  4 version u8  5 op u8 (1)  6 reserved [10]  16 nonce [16]
//	reply:    0 magic "ECMJ"  4 version u8  5 op u8 (1)  6 status u16  8 reserved u32  12 msglen u32
//	          then msglen bytes of text, then, when status is 0, the hello:
//	          nonce [16], handle [64], offset u64, base u64, size u64, ordinal i32, 4 reserved,
//	          generation u32, slots u32 (120 bytes)
//	          and, when slots is not 0, the ready-word region's memfd with the reply's
//	          first byte (SCM_RIGHTS); see words.go
//	announce: 0 magic "ECMW"  4 version u8  5 op u8 (2)  6 count u16  8 reserved [8]
//	          then count (1..maxEntries) entries of 40 bytes:
//	          0 res u64  8 token [16]  24 slot u32  28 reserved u32  32 value u64
//
// Version 3 completes in-band through ready words; version 2 had no
// region and no announcements, and listened on TCP.
const (
	headerLen   = 16
	requestLen  = headerLen + nonceLen
	wireVersion = 3
	opHello     = 1
	opAnnounce  = 2
	helloLen    = 120
	entryLen    = 40
	maxEntries  = wordSlots
	maxMsg      = 1 << 10
)

const (
	reqMagic      = "ECMI"
	replyMagic    = "ECMJ"
	announceMagic = "ECMW"
)

// Reply statuses.
const (
	statusOK       uint16 = 0
	statusBadNonce uint16 = 1 // the nonce names no incarnation of this shard
)

// errBadMessage wraps every decoding error: the peer is out of step.
var errBadMessage = errors.New("cudaipc: bad message")

// hello is what a producer needs to write into the slab: the IPC handle
// of the allocation that holds it and where in it the slab starts, and
// the slab's own address and size, which write grants' addresses are
// relative to.
type hello struct {
	Nonce   [nonceLen]byte
	Export  gpu.Export
	Base    uint64 // the slab's address in the shard's process
	Size    uint64 // slab bytes
	Ordinal int32  // the slab's device, as the shard numbers them (for logs)
	// Generation is the high half of every ready word of this attachment
	// and Slots the size of its region (words.go); Slots is 0 when the
	// shard offers no region (its sink cannot complete in-band).
	Generation uint32
	Slots      uint32
}

type helloReply struct {
	status uint16
	msg    string
	hello  hello
}

func appendHello(b []byte, nonce [nonceLen]byte) []byte {
	b = append(b, reqMagic...)
	b = append(b, wireVersion, opHello)
	b = append(b, make([]byte, 10)...)
	return append(b, nonce[:]...)
}

// readHello reads a hello request and returns the nonce it presents.
func readHello(r io.Reader) ([nonceLen]byte, error) {
	var nonce [nonceLen]byte
	var b [requestLen]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return nonce, truncated(err)
	}
	if err := checkHeader(b[:], reqMagic, opHello); err != nil {
		return nonce, err
	}
	for _, x := range b[6:headerLen] {
		if x != 0 {
			return nonce, fmt.Errorf("%w: reserved request bytes not zero", errBadMessage)
		}
	}
	copy(nonce[:], b[headerLen:])
	return nonce, nil
}

func checkHeader(h []byte, magic string, op byte) error {
	if string(h[:4]) != magic {
		return fmt.Errorf("%w: magic %q, want %q", errBadMessage, h[:4], magic)
	}
	if h[4] != wireVersion {
		return fmt.Errorf("%w: version %d, want %d (producer and consumer of different versions?)", errBadMessage, h[4], wireVersion)
	}
	if h[5] != op {
		return fmt.Errorf("%w: unknown op %d", errBadMessage, h[5])
	}
	return nil
}

func appendHelloReply(b []byte, rep helloReply) []byte {
	msg := serve.ClipMsg(rep.msg, maxMsg)
	b = append(b, replyMagic...)
	b = append(b, wireVersion, opHello)
	b = binary.LittleEndian.AppendUint16(b, rep.status)
	b = binary.LittleEndian.AppendUint32(b, 0)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(msg)))
	b = append(b, msg...)
	if rep.status != statusOK {
		return b
	}
	h := rep.hello
	b = append(b, h.Nonce[:]...)
	b = append(b, h.Export.Handle[:]...)
	b = binary.LittleEndian.AppendUint64(b, h.Export.Offset)
	b = binary.LittleEndian.AppendUint64(b, h.Base)
	b = binary.LittleEndian.AppendUint64(b, h.Size)
	b = binary.LittleEndian.AppendUint32(b, uint32(h.Ordinal))
	b = append(b, 0, 0, 0, 0)
	b = binary.LittleEndian.AppendUint32(b, h.Generation)
	return binary.LittleEndian.AppendUint32(b, h.Slots)
}

func readHelloReply(r io.Reader) (helloReply, error) {
	var h [headerLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return helloReply{}, truncated(err)
	}
	if err := checkHeader(h[:], replyMagic, opHello); err != nil {
		return helloReply{}, err
	}
	if binary.LittleEndian.Uint32(h[8:]) != 0 {
		return helloReply{}, fmt.Errorf("%w: reserved reply bytes not zero", errBadMessage)
	}
	rep := helloReply{status: binary.LittleEndian.Uint16(h[6:])}
	n := binary.LittleEndian.Uint32(h[12:])
	if n > maxMsg {
		return helloReply{}, fmt.Errorf("%w: message of %d bytes, at most %d", errBadMessage, n, maxMsg)
	}
	if n > 0 {
		msg := make([]byte, n)
		if _, err := io.ReadFull(r, msg); err != nil {
			return helloReply{}, truncated(err)
		}
		rep.msg = string(msg)
	}
	if rep.status != statusOK {
		return rep, nil
	}
	var e [helloLen]byte
	if _, err := io.ReadFull(r, e[:]); err != nil {
		return helloReply{}, truncated(err)
	}
	hl := &rep.hello
	copy(hl.Nonce[:], e[0:16])
	copy(hl.Export.Handle[:], e[16:80])
	hl.Export.Offset = binary.LittleEndian.Uint64(e[80:])
	hl.Base = binary.LittleEndian.Uint64(e[88:])
	hl.Size = binary.LittleEndian.Uint64(e[96:])
	hl.Ordinal = int32(binary.LittleEndian.Uint32(e[104:]))
	if binary.LittleEndian.Uint32(e[108:]) != 0 {
		return helloReply{}, fmt.Errorf("%w: reserved hello bytes not zero", errBadMessage)
	}
	hl.Generation = binary.LittleEndian.Uint32(e[112:])
	hl.Slots = binary.LittleEndian.Uint32(e[116:])
	if hl.Slots != 0 && (hl.Slots != wordSlots || hl.Generation == 0) {
		return helloReply{}, fmt.Errorf("%w: a ready-word region of %d slots, generation %d (want %d slots, a generation not 0)", errBadMessage, hl.Slots, hl.Generation, wordSlots)
	}
	return rep, nil
}

// announcement is one item a producer tells the shard to watch for: the
// reservation and its token, and the slot of its region where the GPU
// will store Value once the item's bytes are in the slab.
type announcement struct {
	Res   uint64
	Token ids.Token
	Slot  uint32
	Value uint64
}

func appendAnnounce(b []byte, as []announcement) []byte {
	b = append(b, announceMagic...)
	b = append(b, wireVersion, opAnnounce)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(as)))
	b = append(b, make([]byte, 8)...)
	for _, a := range as {
		b = binary.LittleEndian.AppendUint64(b, a.Res)
		b = append(b, a.Token[:]...)
		b = binary.LittleEndian.AppendUint32(b, a.Slot)
		b = binary.LittleEndian.AppendUint32(b, 0)
		b = binary.LittleEndian.AppendUint64(b, a.Value)
	}
	return b
}

// readAnnounce reads one announcement message: the header, then at most
// maxEntries entries. It checks the encoding only; what the entries name
// (slot, value, reservation) is the receiver's to judge.
func readAnnounce(r io.Reader) ([]announcement, error) {
	var h [headerLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, truncated(err)
	}
	if err := checkHeader(h[:], announceMagic, opAnnounce); err != nil {
		return nil, err
	}
	n := int(binary.LittleEndian.Uint16(h[6:]))
	if n == 0 || n > maxEntries {
		return nil, fmt.Errorf("%w: %d entries, want 1 to %d", errBadMessage, n, maxEntries)
	}
	for _, x := range h[8:] {
		if x != 0 {
			return nil, fmt.Errorf("%w: reserved announce bytes not zero", errBadMessage)
		}
	}
	body := make([]byte, n*entryLen)
	if _, err := io.ReadFull(r, body); err != nil {
		return nil, truncated(noEOF(err))
	}
	out := make([]announcement, n)
	for i := range out {
		e := body[i*entryLen : (i+1)*entryLen]
		a := &out[i]
		a.Res = binary.LittleEndian.Uint64(e)
		copy(a.Token[:], e[8:24])
		a.Slot = binary.LittleEndian.Uint32(e[24:])
		if binary.LittleEndian.Uint32(e[28:]) != 0 {
			return nil, fmt.Errorf("%w: reserved entry bytes not zero", errBadMessage)
		}
		a.Value = binary.LittleEndian.Uint64(e[32:])
	}
	return out, nil
}

// noEOF makes a message cut off after its header a truncated one.
func noEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// truncated makes a short message a bad message rather than a clean EOF.
func truncated(err error) error {
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: truncated: %w", errBadMessage, err)
	}
	return err
}
