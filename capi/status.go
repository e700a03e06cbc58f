package capi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/node"
)

// Status mirrors the ECM_* codes of include/ecmooncake.h.
type Status int

// The status codes; keep in step with the header.
const (
	StatusOK          Status = 0
	StatusInvalid     Status = 1
	StatusHandle      Status = 2
	StatusState       Status = 3
	StatusIO          Status = 4
	StatusTimeout     Status = 5
	StatusInternal    Status = 6
	StatusUnavailable Status = 7
)

// ABIVersion is ECM_ABI_VERSION.
const ABIVersion = 3

// Error carries a status code across the boundary.
type Error struct {
	Code Status
	Err  error
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

func statusErr(code Status, format string, args ...any) error {
	return &Error{Code: code, Err: fmt.Errorf(format, args...)}
}

// Classify picks the status for an error.
func Classify(err error) Status {
	var e *Error
	switch {
	case err == nil:
		return StatusOK
	case errors.As(err, &e):
		return e.Code
	case errors.Is(err, node.ErrUnavailable):
		return StatusUnavailable
	case errors.Is(err, node.ErrState):
		return StatusState
	case errors.Is(err, config.ErrInvalid):
		return StatusInvalid
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded):
		return StatusTimeout
	default:
		return StatusIO
	}
}

// Guard runs f and converts its error or panic into a status and a message.
func Guard(f func() error) (code Status, msg string) {
	defer func() {
		if r := recover(); r != nil {
			slog.Error("ecmooncake: recovered panic at the C boundary", "panic", r, "stack", string(debug.Stack()))
			code, msg = StatusInternal, fmt.Sprintf("internal error (recovered panic): %v", r)
		}
	}()
	if err := f(); err != nil {
		return Classify(err), err.Error()
	}
	return StatusOK, ""
}
