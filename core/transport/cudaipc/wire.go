package cudaipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/serve"
)

// The shard's socket serves one exchange per producer connection, the
// hello; the connection then stays open, idle, for as long as the producer
// keeps the slab mapped, so that each side learns at once when the other
// goes. Little-endian:
//
//	request:  0 magic "ECMI"  4 version u8  5 op u8 (1)  6 reserved [10]  16 nonce [16]
//	reply:    0 magic "ECMJ"  4 version u8  5 op u8 (1)  6 status u16  8 reserved u32  12 msglen u32
//	          then msglen bytes of text, then, when status is 0, the hello:
//	          nonce [16], handle [64], offset u64, base u64, size u64, ordinal i32, 4 reserved (112 bytes)
//
// Version 2 is the one-sided protocol: version 1 admitted frames with
// begin and end exchanges, which a shard no longer serves.
const (
	headerLen   = 16
	requestLen  = headerLen + nonceLen
	wireVersion = 2
	opHello     = 1
	helloLen    = 112
	maxMsg      = 1 << 10
)

const (
	reqMagic   = "ECMI"
	replyMagic = "ECMJ"
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
	if err := checkHeader(b[:], reqMagic); err != nil {
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

func checkHeader(h []byte, magic string) error {
	if string(h[:4]) != magic {
		return fmt.Errorf("%w: magic %q, want %q", errBadMessage, h[:4], magic)
	}
	if h[4] != wireVersion {
		return fmt.Errorf("%w: version %d, want %d (producer and consumer of different versions?)", errBadMessage, h[4], wireVersion)
	}
	if h[5] != opHello {
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
	return append(b, 0, 0, 0, 0)
}

func readHelloReply(r io.Reader) (helloReply, error) {
	var h [headerLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return helloReply{}, truncated(err)
	}
	if err := checkHeader(h[:], replyMagic); err != nil {
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
	return rep, nil
}

// truncated makes a short message a bad message rather than a clean EOF.
func truncated(err error) error {
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: truncated: %w", errBadMessage, err)
	}
	return err
}
