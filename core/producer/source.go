package producer

import (
	"fmt"

	"github.com/ecmooncake/ecmooncake/core/fsm/push"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// size is the number of bytes a source holds.
func (s Source) size() uint64 {
	if s.Dev != nil {
		return s.Dev.Len
	}
	return uint64(len(s.Mem))
}

// writeItem is the transport's view of the first w.NBytes of the source.
func (s Source) writeItem(w push.Write) transport.WriteItem {
	it := transport.WriteItem{Res: w.Res, Token: w.Token, Addr: w.Addr, Size: w.NBytes}
	if s.Dev != nil {
		dev := *s.Dev
		dev.Len = w.NBytes
		it.Dev = &dev
		return it
	}
	it.Src = s.Mem[:w.NBytes]
	return it
}

// releaseSourceLocked forgets a source that no write reads any more and
// closes its readiness event: nothing is ordered behind it now.
func (p *Producer) releaseSourceLocked(id push.SourceID) {
	s, ok := p.sources[id]
	if !ok {
		return
	}
	delete(p.sources, id)
	if s.Dev != nil && s.Dev.Ready != nil {
		if err := s.Dev.Ready.Close(); err != nil {
			p.log.Warn("closing a source's readiness event failed", "mm_hash", s.MMHash, "cause", err)
		}
	}
}

// pick chooses the data plane to the shard at control (who names it in
// errors), which offers the planes in offered and runs on host: the
// transport's own choice when it routes per destination (same host or
// not), else its one plane.
func (p *Producer) pick(who, control, host string, offered map[string]string) (string, error) {
	dest, err := transport.PickDest(p.tr, control, host, offered)
	if err != nil {
		return "", fmt.Errorf("%s: %w", who, err)
	}
	// A transport that can tell now that it cannot write there (another
	// protocol at the other end) fails the lookup, not every later write.
	if c, ok := p.tr.(transport.AddrChecker); ok {
		if err := c.CheckAddr(dest); err != nil {
			return "", fmt.Errorf("%s at %s: %w", who, control, err)
		}
	}
	return dest, nil
}
