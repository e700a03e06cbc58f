package mooncake

import (
	"errors"
	"fmt"
)

// CallError is a failed call of the TransferEngine C API: the function
// and the code it returned, in that function's convention.
type CallError struct {
	Func string
	Code int
	// OffConvention: the code has the sign the function's convention
	// does not use (an engine of another version, or a bug in it).
	OffConvention bool
}

func (e *CallError) Error() string {
	odd := ""
	if e.OffConvention {
		odd = "; a sign this function does not use"
	}
	return fmt.Sprintf("mooncake: %s returned %d (%s%s)", e.Func, e.Code, codeName(e.Code), odd)
}

// Unwrap lets errors.Is(err, ErrEngine) match any call error.
func (e *CallError) Unwrap() error { return ErrEngine }

// Sentinel errors; callers test them with errors.Is.
var (
	// ErrUnavailable: the library cannot be loaded or lacks a function.
	// Every other transport keeps working; choosing this one fails.
	ErrUnavailable = errors.New("mooncake transport unavailable")
	// ErrProtocol: the consumer's engine speaks another protocol than
	// ours; nothing is written.
	ErrProtocol = errors.New("mooncake protocol mismatch")
	// ErrEngine: a call of the C API failed; the error is a *CallError.
	ErrEngine = errors.New("mooncake engine call failed")
)

// Mooncake's functions come in two conventions. submitTransfer,
// getTransferStatus and freeBatchID return a Status code: 0 or positive.
// The other int functions return 0 or a negative code of error.h. The
// magnitudes name the same causes in both.
var codeNames = map[int]string{
	1:   "invalid argument",
	2:   "too many requests",
	3:   "address not registered",
	4:   "batch busy",
	6:   "device not found",
	7:   "address overlapped",
	8:   "transport not supported",
	100: "dns failure",
	101: "dns or socket failure",
	102: "socket failure",
	103: "malformed json",
	104: "handshake rejected",
	105: "malformed response",
	200: "metadata error",
	201: "endpoint error",
	202: "context error",
	203: "endpoint not found",
	204: "endpoint id mismatch",
	300: "numa error",
	301: "clock error",
	302: "out of memory",
	303: "not implemented",
}

// codeBusy is freeBatchID's "a task is still running".
const codeBusy = 4

func codeName(code int) string {
	abs := code
	if abs < 0 {
		abs = -abs
	}
	if n, ok := codeNames[abs]; ok {
		return n
	}
	return "unknown code"
}

// statusCall decodes a function of the positive convention.
func statusCall(fn string, rc int) error {
	if rc == 0 {
		return nil
	}
	return &CallError{Func: fn, Code: rc, OffConvention: rc < 0}
}

// errnoCall decodes a function of the negative convention.
func errnoCall(fn string, rc int) error {
	if rc == 0 {
		return nil
	}
	return &CallError{Func: fn, Code: rc, OffConvention: rc > 0}
}

// Task states of getTransferStatus, and their names in the engine's enum.
const (
	taskWaiting = iota
	taskPending
	taskInvalid
	taskCanceled
	taskCompleted
	taskTimeout
	taskFailed
)

var taskStateNames = [...]string{
	taskWaiting:   "WAITING",
	taskPending:   "PENDING",
	taskInvalid:   "INVALID",
	taskCanceled:  "CANCELED",
	taskCompleted: "COMPLETED",
	taskTimeout:   "TIMEOUT",
	taskFailed:    "FAILED",
}

func taskStateName(s int) string {
	if s >= 0 && s < len(taskStateNames) {
		return taskStateNames[s]
	}
	return fmt.Sprintf("state %d", s)
}

// taskDone reports whether a task can change no more: the engine no longer
// reads its source.
func taskDone(s int) bool { return s != taskWaiting && s != taskPending }
