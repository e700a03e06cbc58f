package logqueuetest

import (
	"context"
	"log/slog"
	"sync"
)

// StuckHandler records what it is asked to write; the first record closes
// Entered and waits until Release closes, as a write to a full stderr
// pipe waits.
type StuckHandler struct {
	Entered, Release chan struct{}
	once             sync.Once

	mu   sync.Mutex
	msgs []string
}

// NewStuckHandler returns a handler whose first write waits.
func NewStuckHandler() *StuckHandler {
	return &StuckHandler{Entered: make(chan struct{}), Release: make(chan struct{})}
}

func (h *StuckHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *StuckHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *StuckHandler) WithGroup(string) slog.Handler            { return h }

func (h *StuckHandler) Handle(_ context.Context, r slog.Record) error {
	h.once.Do(func() {
		close(h.Entered)
		<-h.Release
	})
	h.mu.Lock()
	h.msgs = append(h.msgs, r.Message)
	h.mu.Unlock()
	return nil
}

// Written returns the messages written so far.
func (h *StuckHandler) Written() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.msgs...)
}
