package cudaipc

import (
	"bufio"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"runtime/debug"
	"sync"
	"sync/atomic"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

type receiver struct {
	ln    net.Listener
	sink  transport.RegionSink
	hello hello
	log   *slog.Logger

	frames, bytes, badConns atomic.Uint64
	rejMu                   sync.Mutex
	rejected                map[string]uint64

	wg        sync.WaitGroup
	closeOnce sync.Once
	mu        sync.Mutex
	closed    bool
	conns     map[net.Conn]struct{}
}

func (t *Transport) listen(addr string, sink transport.RegionSink) (*receiver, error) {
	exp, err := t.cfg.SlabDevice.ExportIPC(t.cfg.Slab.Addr, t.cfg.Slab.Len)
	if err != nil {
		return nil, fmt.Errorf("cudaipc: export the slab on %s: %w", t.cfg.SlabDevice.Name(), err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("cudaipc: listen %s: %w", addr, err)
	}
	r := &receiver{
		ln: ln, sink: sink,
		hello:    hello{Export: exp, Size: t.cfg.Slab.Len, Ordinal: int32(t.cfg.SlabDevice.Ordinal())},
		log:      t.cfg.Logger.With("transport", Name, "listen", ln.Addr().String()),
		rejected: map[string]uint64{},
		conns:    map[net.Conn]struct{}{},
	}
	if _, err := rand.Read(r.hello.Instance[:]); err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("cudaipc: instance id: %w", err)
	}
	r.wg.Add(1)
	go r.accept()
	return r, nil
}

func (r *receiver) Addr() string { return r.ln.Addr().String() }

func (r *receiver) Stats() transport.RecvStats {
	r.rejMu.Lock()
	rej := make(map[string]uint64, len(r.rejected))
	for k, v := range r.rejected {
		rej[k] = v
	}
	r.rejMu.Unlock()
	return transport.RecvStats{Frames: r.frames.Load(), Bytes: r.bytes.Load(), Rejected: rej, BadConns: r.badConns.Load()}
}

// Close stops accepting, cuts every connection (open frames end torn) and
// waits until the sink is never called again.
func (r *receiver) Close() error {
	r.closeOnce.Do(func() {
		r.mu.Lock()
		r.closed = true
		for c := range r.conns {
			_ = c.Close()
		}
		r.mu.Unlock()
		_ = r.ln.Close()
	})
	r.wg.Wait()
	return nil
}

func (r *receiver) accept() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			r.mu.Lock()
			closed := r.closed
			r.mu.Unlock()
			if closed {
				return
			}
			r.log.Warn("cudaipc: accept failed", "cause", err)
			continue
		}
		r.mu.Lock()
		if r.closed {
			r.mu.Unlock()
			_ = c.Close()
			return
		}
		r.conns[c] = struct{}{}
		r.wg.Add(1)
		r.mu.Unlock()
		go r.serve(c)
	}
}

// openFrame is a frame admitted on one connection and not ended yet.
type openFrame struct {
	res ids.ResID
	n   uint64
}

func (r *receiver) serve(c net.Conn) {
	open := map[uint64]openFrame{}
	defer func() {
		if p := recover(); p != nil {
			r.log.Error("cudaipc: panic serving connection", "peer", c.RemoteAddr().String(), "panic", p, "stack", string(debug.Stack()))
		}
		// The writer may have copied part of these; the shard must not
		// publish them.
		for _, f := range open {
			r.sink.EndWrite(f.res, false)
		}
		_ = c.Close()
		r.mu.Lock()
		delete(r.conns, c)
		r.mu.Unlock()
		r.wg.Done()
	}()
	br := bufio.NewReader(c)
	var next uint64
	var out []byte
	for {
		req, err := readRequest(br)
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				r.badConns.Add(1)
				r.log.Warn("cudaipc: closing connection", "peer", c.RemoteAddr().String(), "cause", err)
			}
			return
		}
		var rep reply
		switch req.Op {
		case opHello:
			rep = reply{Op: opHello, Hello: r.hello}
		case opBegin:
			rep = reply{Op: opBegin, Grants: make([]grant, len(req.Begin))}
			for i, f := range req.Begin {
				next++
				rep.Grants[i] = r.admit(f, next)
				if rep.Grants[i].Status == transport.StatusOK {
					open[next] = openFrame{res: f.Res, n: f.N}
				}
			}
		case opEnd:
			rep = reply{Op: opEnd}
			for _, e := range req.End {
				f, ok := open[e.Frame]
				if !ok {
					// A writer bug, or a replay: nothing to end.
					r.log.Warn("cudaipc: end of a frame that is not open", "frame", e.Frame)
					continue
				}
				delete(open, e.Frame)
				r.sink.EndWrite(f.res, e.OK)
				if e.OK {
					r.frames.Add(1)
					r.bytes.Add(f.n)
				}
			}
		}
		out = appendReply(out[:0], rep)
		if _, err := c.Write(out); err != nil {
			return
		}
	}
}

// admit asks the sink for one frame's place in the slab.
func (r *receiver) admit(f frameReq, frame uint64) grant {
	at, err := transport.OpenRegion(r.sink, f.Res, f.Token, f.Off, f.N)
	if err == nil && (at > r.hello.Size || f.N > r.hello.Size-at) {
		// The shard granted a region past its own slab: a broken
		// invariant, and the writer would copy into memory past it.
		r.sink.EndWrite(f.Res, false)
		err = fmt.Errorf("%w: reservation %d maps to [%d,+%d), outside the %d-byte slab", transport.ErrRejected, f.Res, at, f.N, r.hello.Size)
	}
	if err != nil {
		st := transport.StatusOf(err)
		r.rejMu.Lock()
		r.rejected[st.String()]++
		r.rejMu.Unlock()
		return grant{Status: st, Msg: err.Error()}
	}
	return grant{Frame: frame, At: at, Status: transport.StatusOK}
}
