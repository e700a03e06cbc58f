package serve

import (
	"log/slog"
	"sync"
)

// WarnOnce logs the first event of each kind at Warn and the rest at
// Debug: a peer that keeps knocking must not flood the log, and the
// counters say how often it knocked. The zero value is ready.
type WarnOnce struct {
	mu   sync.Mutex
	seen map[string]bool
}

// Log logs msg with args and the kind as its reason.
func (w *WarnOnce) Log(log *slog.Logger, kind, msg string, args ...any) {
	w.mu.Lock()
	first := !w.seen[kind]
	if w.seen == nil {
		w.seen = map[string]bool{}
	}
	w.seen[kind] = true
	w.mu.Unlock()
	args = append(args, "reason", kind)
	if first {
		log.Warn(msg, append(args, "note", "later ones of this reason are logged at debug level; see the counters")...)
		return
	}
	log.Debug(msg, args...)
}
