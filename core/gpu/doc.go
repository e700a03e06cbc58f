// Package gpu is what the data plane needs from a GPU, as small
// interfaces, with an in-memory fake beside them so that every transport
// that touches device memory can be tested on a machine without one.
//
// The real implementation is package cuda (the CUDA driver API, loaded at
// run time); the fake is FakeHost, a "host" of fake GPUs whose device
// memory is ordinary Go memory behind fake addresses.
//
// # Addresses
//
// Device memory is named by its address (a uintptr), never by a Go
// pointer: a GPU address must not become one. Host memory is passed as a
// []byte. A copy that touches an address outside a live allocation fails
// in the fake, which is how tests catch a transport that writes past a
// reservation.
//
// # Ordering
//
// An Event marks the point in a stream (PyTorch's, say) after which a
// source is complete. Copies that read a source take it as After and are
// ordered behind it on the GPU, so the caller never blocks the thread that
// produced it. Every copy method returns only once its copy has completed:
// a destination is never published before its bytes are there.
//
// # IPC
//
// ExportIPC describes device memory so that another process on the same
// host can open it (OpenIPC) and copy into it. A Mapping stays valid until
// closed, even after the exporter exits, so holders close mappings as soon
// as they learn that the exporter went away.
package gpu
