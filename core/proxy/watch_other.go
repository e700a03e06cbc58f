//go:build !unix

package proxy

import "net"

// watchPeer is a no-op where the socket cannot be peeked at: a client that
// disconnects is then noticed when the answer is written.
func watchPeer(c net.Conn, gone func()) (stop func()) { return func() {} }
