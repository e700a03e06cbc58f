package mooncake

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"unsafe"

	"github.com/ecmooncake/ecmooncake/core/config"
)

// region is registered memory: an address (never a Go pointer) and a size.
type region struct {
	addr uintptr
	n    uint64
}

// engineConfig says how to create one TransferEngine.
type engineConfig struct {
	Metadata   string // P2PHANDSHAKE, http(s)://... or etcd://...; "" means P2PHANDSHAKE
	ServerName string // local_server_name; "" picks one
	Host       string // where peers reach this engine
	Port       int    // rpc_port; Mooncake picks its own in both modes we allow
	Log        *slog.Logger
	Protocol   string
}

// engine is one TransferEngine: the process object's (a consumer shard's,
// or a producer's) single engine, with the memory it registered.
type engine struct {
	lib     *library
	h       unsafe.Pointer
	proto   string
	segment string // the name peers pass to openSegment

	// hold keeps the port whose number makes up the default segment name
	// in HTTP metadata mode, so that no other engine on this host can
	// take the same name while this one lives.
	hold net.Listener
	log  *slog.Logger

	mu        sync.Mutex
	regs      []region // registered and not yet unregistered
	destroyed bool
}

func newEngine(lib *library, c engineConfig) (*engine, error) {
	// An unknown scheme aborts the process inside Mooncake: check first.
	if err := config.MooncakeMetadata(c.Metadata); err != nil {
		return nil, err
	}
	metadata := c.Metadata
	if metadata == "" {
		metadata = config.P2PHandshake
	}
	if strings.HasPrefix(metadata, config.EtcdScheme) && !lib.etcd {
		return nil, fmt.Errorf("%w: mooncake_metadata %q needs an engine with Mooncake's etcd client (%s), and %s has none (Mooncake aborts the process on etcd:// without it): use a pip wheel, which carries libetcd_wrapper.so, or a source build with -DUSE_ETCD=ON",
			ErrUnavailable, metadata, etcdClientSymbol, lib.describe())
	}
	p2p := metadata == config.P2PHandshake
	name := c.ServerName
	var hold net.Listener
	switch {
	case p2p && name == "":
		// Mooncake takes the host part and appends the port it binds.
		name = c.Host
	case name == "":
		var err error
		if hold, err = net.Listen("tcp", net.JoinHostPort(c.Host, "0")); err != nil {
			return nil, fmt.Errorf("mooncake: reserve a port on %s for the segment name: %w", c.Host, err)
		}
		name = hold.Addr().String()
	}
	h := lib.create(metadata, name, c.Host, uint64(c.Port))
	if h == nil {
		if hold != nil {
			hold.Close()
		}
		return nil, fmt.Errorf("%w: createTransferEngine(metadata %q, name %q, host %q) returned NULL; the engine's log says why (an unreachable metadata server, say)",
			ErrEngine, metadata, name, c.Host)
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	e := &engine{lib: lib, h: h, proto: c.Protocol, hold: hold, log: c.Log}
	if !lib.install(h, c.Protocol) {
		e.destroy()
		return nil, fmt.Errorf("%w: installTransport(%q) returned NULL: this engine cannot run %s here (not built in, or no device for it); set mooncake_protocol to one it can",
			ErrEngine, c.Protocol, c.Protocol)
	}
	e.segment = name
	if p2p {
		ipport, rc := lib.localIPAndPort(h)
		err := errnoCall("getLocalIpAndPort", rc)
		if err == nil && ipport == "" {
			err = errors.New("getLocalIpAndPort gave an empty name")
		}
		if err != nil {
			e.destroy()
			return nil, fmt.Errorf("mooncake: the engine's segment name: %w", err)
		}
		e.segment = ipport
	}
	return e, nil
}

// register registers memory once, for the engine's whole life.
func (e *engine) register(regs []region, location string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.destroyed {
		return fmt.Errorf("mooncake: register on a destroyed engine")
	}
	if err := errnoCall("registerLocalMemoryBatch", e.lib.registerBatch(e.h, regs, location)); err != nil {
		return fmt.Errorf("mooncake: register %d region(s) at %s: %w", len(regs), location, err)
	}
	e.regs = append(e.regs, regs...)
	return nil
}

// unregisterLocked unregisters everything registered, exactly once: the
// list is forgotten whatever the engine answers, so a retry can never
// unregister an address that something else registered since.
func (e *engine) unregisterLocked() error {
	if len(e.regs) == 0 {
		return nil
	}
	regs := e.regs
	e.regs = nil
	return errnoCall("unregisterLocalMemoryBatch", e.lib.unregisterBatch(e.h, regs))
}

// openSegment opens a peer's segment; noCache makes the engine fetch its
// descriptor again instead of trusting the one it cached.
func (e *engine) openSegment(name string, noCache bool) (int32, error) {
	fn := "openSegment"
	if noCache {
		fn = "openSegmentNoCache"
	}
	id := e.lib.openSegment(e.h, name, noCache)
	if id < 0 {
		return 0, fmt.Errorf("mooncake: segment %q: %w", name, errnoCall(fn, int(id)))
	}
	return id, nil
}

// destroy unregisters the engine's memory and destroys it; idempotent.
// The caller guarantees that no batch of the engine is in flight.
//
// An unregister the engine refuses here is logged, not returned: destroy
// runs at shutdown, the memory is about to go either way, and in HTTP
// metadata mode Mooncake publishes the change to a metadata server that
// may well have stopped first (-200), which is no fault of the caller's.
func (e *engine) destroy() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.destroyed {
		return nil
	}
	e.destroyed = true
	if err := e.unregisterLocked(); err != nil {
		e.log.Warn("mooncake: unregister refused while shutting down; destroying the engine anyway",
			"segment", e.segment, "cause", err)
	}
	e.lib.destroy(e.h)
	if e.hold != nil {
		e.hold.Close()
	}
	return nil
}
