package control

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// A Unix control connection carries the wire package's request and reply
// frames, each behind its length:
//
//	0  length u32 (big endian, 1..wire.MaxMessage)   4  frame [length]byte
//
// A stream socket has no message boundaries of its own, so the length is
// the whole framing; it is checked before a byte of the frame is read, so
// that a peer cannot make the reader hold more than wire.MaxMessage.
const unixFrameHeader = 4

// errUnixFrame: a length that no frame may have.
var errUnixFrame = errors.New("bad unix control frame")

// appendUnixFrame appends frame, behind its length, to b.
func appendUnixFrame(b, frame []byte) ([]byte, error) {
	if len(frame) == 0 || len(frame) > wire.MaxMessage {
		return b, fmt.Errorf("control: unix frame of %d bytes, want 1..%d: %w", len(frame), wire.MaxMessage, errUnixFrame)
	}
	b = binary.BigEndian.AppendUint32(b, uint32(len(frame)))
	return append(b, frame...), nil
}

// unixFrameLen checks a frame's header and returns its length.
func unixFrameLen(hdr []byte) (int, error) {
	n := binary.BigEndian.Uint32(hdr)
	if n == 0 || n > uint32(wire.MaxMessage) {
		return 0, fmt.Errorf("control: unix frame of %d bytes, want 1..%d: %w", n, wire.MaxMessage, errUnixFrame)
	}
	return int(n), nil
}

// decodeUnixFrame splits the first frame off b. ok is false when b does
// not hold all of it yet; an error means the stream is not ours and the
// connection must close.
func decodeUnixFrame(b []byte) (frame, rest []byte, ok bool, err error) {
	if len(b) < unixFrameHeader {
		return nil, b, false, nil
	}
	n, err := unixFrameLen(b)
	if err != nil {
		return nil, b, false, err
	}
	if len(b)-unixFrameHeader < n {
		return nil, b, false, nil
	}
	return b[unixFrameHeader : unixFrameHeader+n], b[unixFrameHeader+n:], true, nil
}

// readUnixFrame reads one frame from r, allocating only once its length
// is known to be within the cap.
func readUnixFrame(r io.Reader) ([]byte, error) {
	var hdr [unixFrameHeader]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n, err := unixFrameLen(hdr[:])
	if err != nil {
		return nil, err
	}
	frame := make([]byte, n)
	if _, err := io.ReadFull(r, frame); err != nil {
		return nil, fmt.Errorf("control: unix frame cut after %d-byte header: %w", unixFrameHeader, err)
	}
	return frame, nil
}
