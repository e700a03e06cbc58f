package cudaipc

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// Wire layout, little-endian. A request is a 16-byte header followed by
// count fixed-size entries:
//
//	0 magic "ECMI"  4 version u8  5 op u8  6 reserved u16  8 count u32  12 reserved u32
//	hello: no entries
//	begin: res u64, token [16]byte, offset u64, length u64   (40 bytes each)
//	end:   frame u64, ok u8, 7 reserved bytes                (16 bytes each)
//
// A reply is a 16-byte header, a message of msglen bytes (the reason when
// status is not 0), then its body:
//
//	0 magic "ECMJ"  4 version u8  5 op u8  6 status u16  8 count u32  12 msglen u32
//	hello: instance [16], handle [64], offset u64, size u64, ordinal i32, 4 reserved (104 bytes)
//	begin: count entries: frame u64, at u64, status u16, msglen u16, 4 reserved, then msglen bytes
//	end:   nothing
const (
	headerLen     = 16
	wireVersion   = 1
	beginEntryLen = 40
	endEntryLen   = 16
	helloLen      = 104
	grantLen      = 24
	// maxEntries bounds one request, so that a header alone never makes
	// the receiver allocate much.
	maxEntries = 4096
	maxMsg     = 1 << 10
)

const (
	reqMagic   = "ECMI"
	replyMagic = "ECMJ"
)

// op is a request kind.
type op uint8

const (
	opHello op = iota + 1
	opBegin
	opEnd
)

func (o op) String() string {
	switch o {
	case opHello:
		return "hello"
	case opBegin:
		return "begin"
	case opEnd:
		return "end"
	}
	return fmt.Sprintf("op_%d", uint8(o))
}

// errBadMessage wraps every decoding error: the stream is out of step.
var errBadMessage = errors.New("cudaipc: bad message")

// frameReq asks to write [Off, Off+N) of reservation Res.
type frameReq struct {
	Res   ids.ResID
	Token ids.Token
	Off   uint64
	N     uint64
}

// endReq ends an admitted frame.
type endReq struct {
	Frame uint64
	OK    bool
}

type request struct {
	Op    op
	Begin []frameReq
	End   []endReq
}

// hello is what a producer needs to write into the slab.
type hello struct {
	Instance [16]byte // changes when the consumer restarts
	Export   gpu.Export
	Size     uint64 // slab bytes
	Ordinal  int32  // the slab's device, as the consumer numbers them (for logs)
}

// grant answers one frameReq: At is where the frame lands in the slab;
// Frame names it in the end request. Status is not StatusOK for a refusal.
type grant struct {
	Frame  uint64
	At     uint64
	Status transport.Status
	Msg    string
}

type reply struct {
	Op     op
	Status uint16 // 0, or the request failed as a whole for Msg
	Msg    string
	Hello  hello
	Grants []grant
}

func appendHeader(b []byte, magic string, o op, word uint16, count, last uint32) []byte {
	b = append(b, magic...)
	b = append(b, wireVersion, byte(o))
	b = binary.LittleEndian.AppendUint16(b, word)
	b = binary.LittleEndian.AppendUint32(b, count)
	return binary.LittleEndian.AppendUint32(b, last)
}

func appendRequest(b []byte, r request) []byte {
	switch r.Op {
	case opBegin:
		b = appendHeader(b, reqMagic, r.Op, 0, uint32(len(r.Begin)), 0)
		for _, f := range r.Begin {
			b = binary.LittleEndian.AppendUint64(b, uint64(f.Res))
			b = append(b, f.Token[:]...)
			b = binary.LittleEndian.AppendUint64(b, f.Off)
			b = binary.LittleEndian.AppendUint64(b, f.N)
		}
	case opEnd:
		b = appendHeader(b, reqMagic, r.Op, 0, uint32(len(r.End)), 0)
		for _, e := range r.End {
			b = binary.LittleEndian.AppendUint64(b, e.Frame)
			ok := byte(0)
			if e.OK {
				ok = 1
			}
			b = append(b, ok, 0, 0, 0, 0, 0, 0, 0)
		}
	default:
		b = appendHeader(b, reqMagic, r.Op, 0, 0, 0)
	}
	return b
}

// readHeader reads and checks a header; it returns op, the 16-bit word,
// count and the last word.
func readHeader(r io.Reader, magic string) (op, uint16, uint32, uint32, error) {
	var h [headerLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, 0, 0, 0, err
	}
	if string(h[:4]) != magic {
		return 0, 0, 0, 0, fmt.Errorf("%w: magic %q, want %q", errBadMessage, h[:4], magic)
	}
	if h[4] != wireVersion {
		return 0, 0, 0, 0, fmt.Errorf("%w: version %d, want %d", errBadMessage, h[4], wireVersion)
	}
	o := op(h[5])
	if o < opHello || o > opEnd {
		return 0, 0, 0, 0, fmt.Errorf("%w: unknown op %d", errBadMessage, h[5])
	}
	count := binary.LittleEndian.Uint32(h[8:])
	if count > maxEntries {
		return 0, 0, 0, 0, fmt.Errorf("%w: %d entries, at most %d", errBadMessage, count, maxEntries)
	}
	return o, binary.LittleEndian.Uint16(h[6:]), count, binary.LittleEndian.Uint32(h[12:]), nil
}

func readRequest(r *bufio.Reader) (request, error) {
	o, word, count, last, err := readHeader(r, reqMagic)
	if err != nil {
		return request{}, err
	}
	if word != 0 || last != 0 {
		return request{}, fmt.Errorf("%w: reserved request fields not zero", errBadMessage)
	}
	req := request{Op: o}
	switch o {
	case opHello:
		if count != 0 {
			return request{}, fmt.Errorf("%w: hello with %d entries", errBadMessage, count)
		}
	case opBegin:
		req.Begin = make([]frameReq, count)
		var e [beginEntryLen]byte
		for i := range req.Begin {
			if _, err := io.ReadFull(r, e[:]); err != nil {
				return request{}, truncated(err)
			}
			f := &req.Begin[i]
			f.Res = ids.ResID(binary.LittleEndian.Uint64(e[0:]))
			copy(f.Token[:], e[8:24])
			f.Off = binary.LittleEndian.Uint64(e[24:])
			f.N = binary.LittleEndian.Uint64(e[32:])
		}
	case opEnd:
		req.End = make([]endReq, count)
		var e [endEntryLen]byte
		for i := range req.End {
			if _, err := io.ReadFull(r, e[:]); err != nil {
				return request{}, truncated(err)
			}
			if e[8] > 1 || binary.LittleEndian.Uint64(e[8:])>>8 != 0 {
				return request{}, fmt.Errorf("%w: end entry %d: ok byte %d, reserved bytes %x", errBadMessage, i, e[8], e[9:])
			}
			req.End[i] = endReq{Frame: binary.LittleEndian.Uint64(e[0:]), OK: e[8] == 1}
		}
	}
	return req, nil
}

// truncated makes a short body a bad message rather than a clean EOF.
func truncated(err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: truncated: %w", errBadMessage, io.ErrUnexpectedEOF)
	}
	return err
}

func clip(s string) string {
	if len(s) > maxMsg {
		return s[:maxMsg]
	}
	return s
}

func appendReply(b []byte, r reply) []byte {
	msg := clip(r.Msg)
	count := uint32(0)
	if r.Op == opBegin {
		count = uint32(len(r.Grants))
	}
	b = appendHeader(b, replyMagic, r.Op, r.Status, count, uint32(len(msg)))
	b = append(b, msg...)
	if r.Status != 0 {
		return b
	}
	switch r.Op {
	case opHello:
		h := r.Hello
		b = append(b, h.Instance[:]...)
		b = append(b, h.Export.Handle[:]...)
		b = binary.LittleEndian.AppendUint64(b, h.Export.Offset)
		b = binary.LittleEndian.AppendUint64(b, h.Size)
		b = binary.LittleEndian.AppendUint32(b, uint32(h.Ordinal))
		b = append(b, 0, 0, 0, 0)
	case opBegin:
		for _, g := range r.Grants {
			m := clip(g.Msg)
			b = binary.LittleEndian.AppendUint64(b, g.Frame)
			b = binary.LittleEndian.AppendUint64(b, g.At)
			b = binary.LittleEndian.AppendUint16(b, uint16(g.Status))
			b = binary.LittleEndian.AppendUint16(b, uint16(len(m)))
			b = append(b, 0, 0, 0, 0)
			b = append(b, m...)
		}
	}
	return b
}

func readMsg(r io.Reader, n uint32) (string, error) {
	if n > maxMsg {
		return "", fmt.Errorf("%w: message of %d bytes, at most %d", errBadMessage, n, maxMsg)
	}
	if n == 0 {
		return "", nil
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return "", truncated(err)
	}
	return string(b), nil
}

func readReply(r *bufio.Reader) (reply, error) {
	o, status, count, msgLen, err := readHeader(r, replyMagic)
	if err != nil {
		return reply{}, err
	}
	rep := reply{Op: o, Status: status}
	if rep.Msg, err = readMsg(r, msgLen); err != nil {
		return reply{}, err
	}
	if o != opBegin && count != 0 {
		return reply{}, fmt.Errorf("%w: %s reply with %d entries", errBadMessage, o, count)
	}
	if status != 0 {
		if count != 0 {
			return reply{}, fmt.Errorf("%w: failed %s reply with %d entries", errBadMessage, o, count)
		}
		return rep, nil
	}
	switch o {
	case opHello:
		var e [helloLen]byte
		if _, err := io.ReadFull(r, e[:]); err != nil {
			return reply{}, truncated(err)
		}
		h := &rep.Hello
		copy(h.Instance[:], e[0:16])
		copy(h.Export.Handle[:], e[16:80])
		h.Export.Offset = binary.LittleEndian.Uint64(e[80:])
		h.Size = binary.LittleEndian.Uint64(e[88:])
		h.Ordinal = int32(binary.LittleEndian.Uint32(e[96:]))
	case opBegin:
		rep.Grants = make([]grant, count)
		var e [grantLen]byte
		for i := range rep.Grants {
			if _, err := io.ReadFull(r, e[:]); err != nil {
				return reply{}, truncated(err)
			}
			g := &rep.Grants[i]
			g.Frame = binary.LittleEndian.Uint64(e[0:])
			g.At = binary.LittleEndian.Uint64(e[8:])
			g.Status = transport.Status(binary.LittleEndian.Uint16(e[16:]))
			if g.Msg, err = readMsg(r, uint32(binary.LittleEndian.Uint16(e[18:]))); err != nil {
				return reply{}, err
			}
		}
	}
	return rep, nil
}
