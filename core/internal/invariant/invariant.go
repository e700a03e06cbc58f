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

// IllegalMoves records the n illegal moves a machine was asked to make, a
// violation unless n is zero: the machine counts them rather than panic,
// and any is a bug. It returns r, to go with New on one line.
func (r *Report) IllegalMoves(n uint64) *Report {
	if n > 0 {
		r.Bad("%d illegal moves attempted", n)
	}
	return r
}

// Err joins the violations; nil when there were none.
func (r *Report) Err() error { return errors.Join(r.errs...) }
