// Package invariant collects what a state machine's CheckInvariants finds:
// every violation, not only the first, so that one failing step of a test
// shows all that went wrong at once.
package invariant

import (
	"errors"
	"fmt"
)

// Report gathers violations.
type Report struct {
	sentinel error
	errs     []error
}

// New returns an empty report whose violations wrap sentinel (none when
// sentinel is nil).
func New(sentinel error) *Report { return &Report{sentinel: sentinel} }

// Bad records one violation; format may use %w.
func (r *Report) Bad(format string, args ...any) {
	if r.sentinel != nil {
		format = "%w: " + format
		args = append([]any{r.sentinel}, args...)
	}
	r.errs = append(r.errs, fmt.Errorf(format, args...))
}

// Err joins the violations; nil when there were none.
func (r *Report) Err() error { return errors.Join(r.errs...) }
