package cudaipc

import (
	"crypto/rand"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"

	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/serve"
)

// receiver is a shard's exported slab and the socket that hands its
// handle to producers. It never sees a write: producers copy straight into
// the slab (see transport.Direct), so it only greets them.
type receiver struct {
	ln    net.Listener
	hello hello
	log   *slog.Logger
	cfg   Config

	requests, attached, badConns atomic.Uint64
	rejected, closedBy           serve.Counts

	conns     *serve.Conns[net.Conn]
	closeOnce sync.Once
}

var _ transport.Direct = (*receiver)(nil)

func (t *Transport) listen(addr string) (*receiver, error) {
	exp, err := t.cfg.SlabDevice.ExportIPC(t.cfg.Slab.Addr, t.cfg.Slab.Len)
	if err != nil {
		return nil, fmt.Errorf("cudaipc: export the slab on %s: %w", t.cfg.SlabDevice.Name(), err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("cudaipc: listen %s: %w", addr, err)
	}
	r := &receiver{
		ln: ln, cfg: t.cfg,
		hello: hello{Export: exp, Base: uint64(t.cfg.Slab.Addr), Size: t.cfg.Slab.Len, Ordinal: int32(t.cfg.SlabDevice.Ordinal())},
		log:   t.cfg.Logger.With("transport", Name, "listen", ln.Addr().String()),
		conns: serve.NewConns[net.Conn](t.cfg.MaxConns),
	}
	_, _ = rand.Read(r.hello.Nonce[:]) // crypto/rand never fails on Linux
	r.conns.Go(serve.Acceptor[net.Conn]{
		Accept: r.ln.Accept,
		Admit: func(c net.Conn) bool {
			return r.conns.Admit(c, r.serve, func(c net.Conn) {
				r.closedBy.Add(transport.ClosedLimit)
				_ = c.Close()
			})
		},
		Failed: func(err error, retryIn time.Duration) {
			r.log.Warn("cudaipc: accept failed", "cause", err, "retry_in", retryIn)
		},
		Done: r.conns.Done(),
		Log:  r.log,
	}.Run)
	return r, nil
}

// Addr is the address the shard publishes: the socket and the nonce of
// this incarnation.
func (r *receiver) Addr() string {
	return peerAddr{hostPort: r.ln.Addr().String(), nonce: r.hello.Nonce}.String()
}

// RemoteAddr is what a write grant carries for the region at slabOff: the
// region's address in the shard's own process. Every one-sided plane of a
// shard names regions this way, so one grant serves whichever a producer
// picks; the writer translates it into its own mapping of the slab.
func (r *receiver) RemoteAddr(slabOff uint64) uint64 { return r.hello.Base + slabOff }

// Stats counts the producers greeted (Attached), refused greetings
// (bad_nonce) and connections closed for sending something else; Frames
// and Bytes stay 0, since no write passes through the receiver.
func (r *receiver) Stats() transport.RecvStats {
	return transport.RecvStats{Rejected: r.rejected.Snapshot(), BadConns: r.badConns.Load(), Closed: r.closedBy.Snapshot(), Attached: r.attached.Load()}
}

// Close stops accepting and cuts every connection, which tells each
// producer to close its mapping of the slab.
func (r *receiver) Close() error {
	r.closeOnce.Do(func() {
		r.conns.Close()
		_ = r.ln.Close()
	})
	r.conns.Wait()
	return nil
}

// serve greets one producer, then holds its connection open until either
// side goes: the connection's end is how the producer learns that the
// shard is gone (and unmaps the slab), so it carries nothing else.
func (r *receiver) serve(c net.Conn) {
	defer func() {
		if p := recover(); p != nil {
			serve.LogPanic(r.log, p, "cudaipc: panic serving connection", "peer", c.RemoteAddr().String())
		}
	}()
	_ = c.SetDeadline(time.Now().Add(r.cfg.DialTimeout))
	nonce, err := readHello(c)
	if err != nil {
		if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
			r.badConns.Add(1)
			r.log.Warn("cudaipc: closing connection", "peer", c.RemoteAddr().String(), "cause", err)
		}
		return
	}
	r.requests.Add(1)
	if subtle.ConstantTimeCompare(nonce[:], r.hello.Nonce[:]) != 1 {
		r.rejected.Add("bad_nonce")
		_, _ = c.Write(appendHelloReply(nil, helloReply{status: statusBadNonce, msg: "this shard does not know that address's nonce (it restarted, or the address is stale)"}))
		return
	}
	// Counted before the reply goes out: a producer that has the handle
	// is one the shard has counted.
	r.attached.Add(1)
	if _, err := c.Write(appendHelloReply(nil, helloReply{hello: r.hello})); err != nil {
		r.attached.Add(^uint64(0))
		return
	}
	_ = c.SetDeadline(time.Time{})
	var b [1]byte
	if n, _ := c.Read(b[:]); n > 0 {
		r.badConns.Add(1)
		r.log.Warn("cudaipc: closing connection: bytes after the hello", "peer", c.RemoteAddr().String())
	}
}
