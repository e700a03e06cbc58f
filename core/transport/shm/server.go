package shm

import (
	"crypto/subtle"
	"errors"
	"io"
	"log/slog"
	"net"
	"sync"
	"syscall"
	"time"

	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/serve"
)

// handshakeTimeout bounds how long a connection may take to say hello and
// to take its grant: a peer that connects and stalls holds one slot of
// MaxConns for no longer.
const handshakeTimeout = 5 * time.Second

// Reasons a shard closes a producer connection, the keys of
// RecvStats.Closed.
const (
	closedLimit    = "limit"     // MaxConns connections were open
	closedPeerUID  = "peer_uid"  // the peer runs as another user
	closedBadHello = "bad_hello" // not a hello, or none in time
	closedBadNonce = "bad_nonce" // a hello with another incarnation's nonce
)

// receiver is a consumer shard's slab memfd, offered on an abstract
// socket. A producer that connects as this process's user and presents
// the nonce gets the descriptor; the connection then stays open until
// either side goes.
type receiver struct {
	p    peer
	fd   int // our duplicate of the slab's memfd; closed by Close
	ln   *net.UnixListener
	log  *slog.Logger
	once serve.WarnOnce

	handed atomic.Uint64
	closed serve.Counts

	conns *serve.Conns[*net.UnixConn]
	stop  sync.Once
}

func newReceiver(p peer, fd int, ln *net.UnixListener, max int, log *slog.Logger) *receiver {
	r := &receiver{p: p, fd: fd, ln: ln, log: log.With("socket", "@"+p.Socket),
		conns: serve.NewConns[*net.UnixConn](max)}
	r.conns.Go(serve.Acceptor[*net.UnixConn]{
		Accept: r.ln.AcceptUnix,
		Admit: func(c *net.UnixConn) bool {
			return r.conns.Admit(c, r.serve, func(c *net.UnixConn) {
				r.refuse(c, closedLimit, errors.New("max_data_conns connections are open"))
			})
		},
		Failed: func(err error, retryIn time.Duration) {
			r.once.Log(r.log, "accept", "shm: accept failed", "cause", err, "retry_in", retryIn)
		},
		Done: r.conns.Done(),
		Log:  r.log,
	}.Run)
	return r
}

func (r *receiver) Addr() string                     { return r.p.String() }
func (r *receiver) RemoteAddr(slabOff uint64) uint64 { return r.p.Base + slabOff }

// Stats counts the connections refused, by reason; writes never pass
// through the receiver, so frames and bytes stay zero.
func (r *receiver) Stats() transport.RecvStats {
	return transport.RecvStats{Rejected: map[string]uint64{}, Closed: r.closed.Snapshot()}
}

// Handed is how many producers got the slab's descriptor.
func (r *receiver) Handed() uint64 { return r.handed.Load() }

func (r *receiver) refuse(c *net.UnixConn, reason string, cause error) {
	r.refuseWith(c, reason, cause, nil)
}

// refuseWith counts the refusal before it sends answer (if any) and closes:
// a producer that reads the answer and then asks for the counters finds
// its refusal there.
func (r *receiver) refuseWith(c *net.UnixConn, reason string, cause error, answer []byte) {
	r.closed.Add(reason)
	if answer != nil {
		_, _ = c.Write(answer)
	}
	r.once.Log(r.log, reason, "shm: refused a producer connection", "cause", cause)
	_ = c.Close()
}

// Close stops offering the slab: the socket goes, every producer's
// connection is cut (so that producers unmap the slab) and the descriptor
// is closed. The slab itself belongs to whoever allocated it; a producer
// still copying writes into memory no one reads any more.
func (r *receiver) Close() error {
	r.stop.Do(func() {
		r.conns.Close()
		_ = r.ln.Close()
		r.conns.Wait()
		_ = syscall.Close(r.fd)
	})
	return nil
}

func (r *receiver) serve(c *net.UnixConn) {
	defer func() {
		if p := recover(); p != nil {
			serve.LogPanic(r.log, p, "shm: panic serving a producer")
		}
	}()
	if !r.handOver(c) {
		return
	}
	// Hold the connection until the producer goes or Close cuts it: its
	// end is how the producer learns to unmap. A producer sends nothing
	// more, so whatever it sends ends the connection too.
	_ = c.SetDeadline(time.Time{})
	var b [1]byte
	_, _ = c.Read(b[:])
}

// handOver checks the peer and its hello and sends the descriptor.
func (r *receiver) handOver(c *net.UnixConn) bool {
	if err := sameUser(c); err != nil {
		r.refuse(c, closedPeerUID, err)
		return false
	}
	_ = c.SetDeadline(time.Now().Add(handshakeTimeout))
	buf := make([]byte, helloLen)
	if _, err := io.ReadFull(c, buf); err != nil {
		r.refuse(c, closedBadHello, err)
		return false
	}
	h, err := decodeHello(buf)
	if err != nil {
		r.refuse(c, closedBadHello, err)
		return false
	}
	if subtle.ConstantTimeCompare(h.Nonce[:], r.p.Nonce[:]) != 1 {
		r.refuseWith(c, closedBadNonce, errors.New("the hello's nonce is not this shard's"), appendGrant(nil, grant{Status: grantBadNonce}))
		return false
	}
	if _, _, err := c.WriteMsgUnix(appendGrant(nil, grant{Status: grantOK, Len: r.p.Len}), syscall.UnixRights(r.fd), nil); err != nil {
		r.once.Log(r.log, "send", "shm: sending the slab descriptor failed", "cause", err)
		return false
	}
	r.handed.Add(1)
	return true
}
