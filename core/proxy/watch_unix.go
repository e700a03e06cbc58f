//go:build unix

package proxy

import (
	"errors"
	"net"
	"os"
	"syscall"
	"time"
)

// watchPeer calls gone once if the client closes its connection while a
// request is being served, and returns a function that stops watching and
// waits for the watcher to finish.
//
// fasthttp reads nothing from a connection while its handler runs, so a
// client that gives up is otherwise noticed only when the answer is
// written, after the backends have done all the work. The watcher peeks
// (MSG_PEEK) at the socket: a read of zero bytes is the client's FIN, an
// error its RST. Peeking consumes nothing, so a pipelined next request is
// left for fasthttp; once data is seen the watcher stops, since the
// client is plainly alive.
func watchPeer(c net.Conn, gone func()) (stop func()) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return func() {}
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return func() {}
	}
	// fasthttp leaves its read deadline armed while the handler runs; the
	// watcher needs none, and fasthttp sets its own again before it reads
	// the next request.
	if c.SetReadDeadline(time.Time{}) != nil {
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() { _ = recover() }()
		var buf [1]byte
		closed := false
		err := raw.Read(func(fd uintptr) bool {
			n, _, err := syscall.Recvfrom(int(fd), buf[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
			switch {
			case errors.Is(err, syscall.EAGAIN), errors.Is(err, syscall.EINTR):
				return false
			case err != nil, n == 0:
				closed = true
			}
			return true
		})
		if closed || err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			gone()
		}
	}()
	return func() {
		_ = c.SetReadDeadline(time.Now())
		<-done
		_ = c.SetReadDeadline(time.Time{})
	}
}
