package unixfd

import (
	"syscall"
	"testing"
)

// FuzzParseRights decodes control data without closing what it names:
// these descriptor numbers are made up, and TakeRights would close them.
func FuzzParseRights(f *testing.F) {
	f.Add(syscall.UnixRights(1<<30), 0)
	f.Add(syscall.UnixRights(1<<30, 1<<30+1), 0)
	f.Add(syscall.UnixRights(1<<30), syscall.MSG_CTRUNC)
	f.Add([]byte{1, 2, 3}, 0)
	f.Fuzz(func(t *testing.T, oob []byte, flags int) {
		fds, err := ParseRights(oob, flags)
		if err == nil && (len(fds) != 1 || fds[0] < 0 || flags&syscall.MSG_CTRUNC != 0) {
			t.Fatalf("ParseRights(%x, %#x) = %v with no error", oob, flags, fds)
		}
	})
}
