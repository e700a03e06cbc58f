// Package mooncake is the `mooncake` data plane: encoder outputs written
// by one-sided RDMA (or whichever protocol the engines install) through
// Mooncake TransferEngine's C API, transfer_engine_c.h.
//
// # Loading
//
// There is no build-time or import-time dependency on Mooncake. New loads
// libtransfer_engine.so with dlopen from Config.Library (the settings key
// mooncake_library, which Python fills from ECMOONCAKE_MOONCAKE_LIBRARY
// when the key is absent; Go reads no environment), else from the loader's
// default search path, and resolves every C function it calls up front.
// A missing library or symbol is one error wrapping ErrUnavailable that
// names what is missing and the path tried; the C boundary turns it into
// ECM_ERR_UNAVAILABLE. Small C trampolines call the resolved pointers.
//
// A Mooncake pip wheel exports no C API: Config.Library then names
// ecmooncake's shim (package directory shim/) and Config.Engine the wheel's
// engine.so. The shim decides whether it can carry the wheel (CheckWheel):
// every C++ symbol it calls present, and the layouts of the wheel's
// release range (Transport::TransferRequest differs between 0.3.12.post1,
// 0.3.13 and 0.3.14); a version newer than the checked ones loads with a
// warning logged once per process, an older one or a missing symbol is
// refused with the fix. Probe reports what a doctor needs: the wheel and
// version, whether the engine is a CUDA build and whether it has the etcd
// client.
//
// # Engines
//
// Each process object owns one engine, created when first needed: a
// consumer shard's when it listens, a producer's at its first write. It is
// created with auto_discover=0 and then the configured protocol
// (mooncake_protocol, "rdma" by default) is installed explicitly, so both
// ends run what the settings say and not what the engine guesses. The
// metadata string is checked before it reaches Mooncake, which aborts the
// whole process on a scheme it was not built with: only P2PHANDSHAKE (the
// default, no service), http(s)://host:port/path (see package metadata
// for a store) and etcd://host:port[,host:port...] pass, the last only to
// an engine that has Mooncake's etcd client (every pip wheel does).
//
// # Consumer side
//
// Listen registers the shard's whole slab once (registerLocalMemoryBatch,
// location "*" so that the engine finds the memory's NUMA node) and
// unregisters it exactly once when the receiver closes. Its address, which
// the shard publishes in its peers reply, is a descriptor:
//
//	mooncake://<segment>?base=<slab address>&epoch=<hex>&len=<slab bytes>&proto=<protocol>
//
// The receiver is a transport.Direct: the shard puts RemoteAddr(region's
// slab offset) into each write grant and holds the region's write open
// from grant to complete or abandon (see transport.Direct), because a
// one-sided write never asks the consumer where it may land.
//
// # Producer side
//
// The Writer checks the descriptor before any write: a consumer engine of
// another protocol is refused with ErrProtocol (also at lookup, through
// transport.AddrChecker), and every target must lie inside the slab the
// descriptor names. Segments are opened once per peer and reopened with
// openSegmentNoCache when the descriptor's epoch changes (the shard
// restarted: its cached descriptor would point at the old memory) or after
// a task to it failed.
//
// Sources are caller memory (numpy arrays, torch tensors) that an engine
// can only read once registered. The writer copies them into a staging
// slab that it registers once, rather than registering sources:
//   - registering is slow (pinning pages, creating memory regions), and
//     encoder outputs are fresh allocations, so a registration cache
//     keyed by address would miss on nearly every item: that is
//     registering per item per push;
//   - a cached registration outlives the memory it covers: the caller frees
//     an array, the allocator maps new pages at the same address, and the
//     cached region still names the old pages: silent wrong bytes;
//   - the engine cannot cancel a task, so a write past its deadline still
//     reads its source; from staging, the caller's buffer can be released
//     the moment Write returns, as the transport contract requires.
//
// A source in GPU memory (WriteItem.Dev) goes the same way on its own
// device, when the engine is a CUDA build, which registers GPU memory
// (Transport.RegistersGPU reads that from whether the engine library links
// the CUDA runtime): the writer allocates a staging slab on each device its
// sources come from, registers it once with location "cuda:N", and fills it
// by device-to-device copies ordered after the source's readiness event.
// An engine that is no CUDA build refuses device sources
// (transport.ErrDeviceMemory): the producer wraps it in package staged,
// which hands it host memory, and a shard refuses to register a GPU slab
// with it.
//
// The copy is pipelined with the transfer: items are cut into chunks of
// Config.ChunkBytes, and chunk k+1 is copied while chunk k is on the wire,
// so the copy costs throughput only when memcpy is slower than the link.
//
// # Writes
//
// One Write is one batch: one allocateBatchID per destination per producer
// step, chunks submitted in groups as they are staged, polled (one cgo
// crossing for all live tasks, with back-off) until every task is final.
// The batch id is always freed, on every error path, and only after every
// task it holds is final, because freeBatchID answers "busy" before that
// and there is no cancel: past ctx's deadline nothing more is submitted,
// but tasks already started are drained for up to Config.DrainTimeout. A
// task still unfinished after that leaves its batch id and staging held
// for good (counted as leaked) rather than freed under the engine.
//
// Both return-code conventions of the C API are decoded into *CallError
// naming the function and its code: submitTransfer, getTransferStatus and
// freeBatchID return 0 or a positive status; the other int functions 0 or
// a negative error. A failed task (FAILED, TIMEOUT, ...) fails its item
// with transport.ErrConnLost: part of it may have landed.
//
// # Invariants
//
//   - Every registration is undone exactly once, when its owner closes.
//   - A batch id is freed exactly once, and never while a task of it may
//     still run; staging is reused only after its task is final.
//   - When Write returns, no task of it reads the caller's Src (it never
//     did: tasks read staging).
//   - A write targets only [Addr+Off, Addr+Off+len) of a grant, inside the
//     slab the consumer published.
package mooncake
