package node

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/cuda"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// ErrUnavailable is wrapped by every error that means "this process cannot
// do that": a transport not in this build, a missing TransferEngine
// library, no GPU. The C boundary reports it as ECM_ERR_UNAVAILABLE.
var ErrUnavailable = errors.New("unavailable")

// ErrState is wrapped by an error that a different earlier call would
// have avoided (a second metrics port, say): ECM_ERR_STATE.
var ErrState = errors.New("conflicting state")

// Options carries what the caller chooses beyond the settings. The zero
// value is production: the data plane the settings name, this process's
// GPUs, the default logger.
type Options struct {
	Log *slog.Logger
	// Devices are this process's GPUs; nil opens the CUDA driver on first
	// use. A gpu.Unavailable says there are none, and why.
	Devices gpu.Devices
	// Network replaces the network data plane the settings name (its Name
	// must match them); the node still wraps it as it would its own:
	// staging through page-locked memory and a same-host plane beside it.
	Network transport.Transport
	// Control, when set, opens the control-plane links of each object in
	// place of ZeroMQ (one Links per object, which then owns it): an
	// in-memory control plane, say, or one that fails on purpose.
	Control func() control.Links
}

// links is a fresh Links from Control, or nil: the object opens ZeroMQ
// with the security its settings give.
func (o Options) links() control.Links {
	if o.Control == nil {
		return nil
	}
	return o.Control()
}

func (o Options) log() *slog.Logger {
	if o.Log == nil {
		return slog.Default()
	}
	return o.Log
}

// devices is opt.Devices, else this process's CUDA driver, else a Devices
// saying why there is none; err is that reason.
func (o Options) devices() (devs gpu.Devices, err error) {
	switch d := o.Devices.(type) {
	case nil:
		drv, err := cuda.Default()
		if err != nil {
			return gpu.Unavailable{Err: err}, err
		}
		return drv, nil
	case gpu.Unavailable:
		return d, d.Err
	default:
		return d, nil
	}
}

// kindError is an error of one kind (ErrUnavailable, config.ErrInvalid)
// whose text is its cause's alone.
type kindError struct {
	kind error
	err  error
}

func (e *kindError) Error() string        { return e.err.Error() }
func (e *kindError) Unwrap() error        { return e.err }
func (e *kindError) Is(target error) bool { return target == e.kind }

func kindf(kind error, format string, args ...any) error {
	return &kindError{kind: kind, err: fmt.Errorf(format, args...)}
}

// unknownTransport is the error for a transport name this build lacks.
func unknownTransport(name string) error {
	return kindf(ErrUnavailable, "transport %q is not available in this build", name)
}
