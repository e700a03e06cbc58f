package peercred

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// UID is the uid of the process at the other end of c: a peer cannot
// claim another, since the kernel recorded it at connect.
func UID(c *net.UnixConn) (uint32, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("SO_PEERCRED: %w", err)
	}
	var cred *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, fmt.Errorf("SO_PEERCRED: %w", err)
	}
	if serr != nil {
		return 0, fmt.Errorf("SO_PEERCRED: %w", serr)
	}
	return cred.Uid, nil
}
