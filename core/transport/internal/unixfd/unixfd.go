package unixfd

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"

	"github.com/ecmooncake/ecmooncake/core/internal/peercred"
)

// ErrBadRights is wrapped by every error about a message's descriptors.
var ErrBadRights = errors.New("bad descriptor message")

// TakeRights returns the single descriptor that oob (a control message
// buffer read with a message) carries. Every descriptor it received is
// either returned or closed, also on error.
func TakeRights(oob []byte, flags int) (int, error) {
	fds, err := ParseRights(oob, flags)
	if err != nil {
		for _, fd := range fds {
			if fd >= 0 {
				syscall.Close(fd)
			}
		}
		return -1, err
	}
	return fds[0], nil
}

// ParseRights decodes the descriptors in oob; the error is nil only when
// there is exactly one, in one message, none cut off (MSG_CTRUNC).
func ParseRights(oob []byte, flags int) ([]int, error) {
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("control message: %v: %w", err, ErrBadRights)
	}
	var fds []int
	for i := range msgs {
		// ParseUnixRights panics on data that is not whole descriptors;
		// the kernel never sends such, but the check costs nothing.
		if len(msgs[i].Data)%4 != 0 {
			return fds, fmt.Errorf("control message of %d bytes: %w", len(msgs[i].Data), ErrBadRights)
		}
		if got, err := syscall.ParseUnixRights(&msgs[i]); err == nil {
			fds = append(fds, got...)
		}
	}
	if len(fds) == 1 && len(msgs) == 1 && fds[0] >= 0 && flags&syscall.MSG_CTRUNC == 0 {
		return fds, nil
	}
	return fds, fmt.Errorf("message carries %d descriptors in %d control messages (truncated: %t), want exactly one: %w",
		len(fds), len(msgs), flags&syscall.MSG_CTRUNC != 0, ErrBadRights)
}

// SameUser checks that c's peer runs as this process's uid.
func SameUser(c *net.UnixConn) error {
	uid, err := peercred.UID(c)
	if err != nil {
		return err
	}
	if me := uint32(os.Getuid()); uid != me {
		return fmt.Errorf("peer runs as uid %d, this process as %d", uid, me)
	}
	return nil
}

// CheckSocketName accepts only the abstract socket names the same-host
// planes make: prefix, then lower-case letters, digits and dashes, at
// most max bytes in all. A peer's address names a socket this process
// dials, so anything else is refused before it is used.
func CheckSocketName(name, prefix string, max int) error {
	if !strings.HasPrefix(name, prefix) || len(name) == len(prefix) || len(name) > max {
		return fmt.Errorf("socket name %q is not %s... of at most %d characters", name, prefix, max)
	}
	for _, r := range name {
		if !(r == '-' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z') {
			return fmt.Errorf("socket name %q has a character other than a-z, 0-9 and -", name)
		}
	}
	return nil
}
