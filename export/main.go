// Command export is the C ABI of libecmooncake.so: only //export functions,
// each a thin conversion of C types into a call of package capi. The
// contract is include/ecmooncake.h; tests/python/test_abi.py fails when the
// two drift apart.
//
// Our header is not included here: cgo writes its own prototypes for the
// exported functions, without const, and the two would conflict in the
// generated C. The types below match the header's one for one.
package main

/*
#include <stdint.h>
#include <stdlib.h>

// Pointers that may be GPU addresses cross as uintptr_t, so that a GPU
// address never sits in a Go pointer; host ones become pointers here.
static void *ecm_host_ptr(uintptr_t p) { return (void *)p; }
*/
import "C"

import (
	"unsafe"

	"github.com/ecmooncake/ecmooncake/capi"
)

func main() {}

// finish runs f under capi.Guard and writes the error text for C.
func finish(errOut **C.char, f func() error) C.int {
	code, msg := capi.Guard(f)
	if errOut != nil {
		*errOut = nil
		if code != capi.StatusOK {
			*errOut = C.CString(msg)
		}
	}
	return C.int(code)
}

func goBytes(s *C.char) []byte {
	if s == nil {
		return nil
	}
	return []byte(C.GoString(s))
}

func goString(s *C.char) string {
	if s == nil {
		return ""
	}
	return C.GoString(s)
}

// memory views caller-owned memory without copying. The pointer comes from
// C, so the Go garbage collector neither moves nor frees it.
func memory(p unsafe.Pointer, n C.uint64_t) []byte {
	if p == nil || n == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(p), int(n))
}

// putJSON hands JSON to C; the caller frees it with ecm_free.
func putJSON(out **C.char, b []byte, err error) error {
	if err != nil {
		return err
	}
	if out != nil {
		*out = C.CString(string(b))
	}
	return nil
}

//export ecm_abi_version
func ecm_abi_version(out *C.int32_t, errOut **C.char) C.int {
	return finish(errOut, func() error { *out = C.int32_t(capi.ABIVersion); return nil })
}

//export ecm_free
func ecm_free(p *C.char) { C.free(unsafe.Pointer(p)) }

//export ecm_configure
func ecm_configure(cfg *C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { return capi.Configure(goBytes(cfg)) })
}

//export ecm_gpu_info
func ecm_gpu_info(out **C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { b, err := capi.GPUInfo(); return putJSON(out, b, err) })
}

//export ecm_stats
func ecm_stats(h C.uint64_t, out **C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { b, err := capi.Stats(uint64(h)); return putJSON(out, b, err) })
}

//export ecm_close
func ecm_close(h C.uint64_t, errOut **C.char) C.int {
	return finish(errOut, func() error { return capi.Close(uint64(h)) })
}

//export ecm_consumer_open
func ecm_consumer_open(cfg *C.char, slab unsafe.Pointer, n C.uint64_t, out *C.uint64_t, errOut **C.char) C.int {
	return finish(errOut, func() error {
		h, err := capi.ConsumerOpen(goBytes(cfg), memory(slab, n))
		*out = C.uint64_t(h)
		return err
	})
}

//export ecm_consumer_open_device
func ecm_consumer_open_device(cfg *C.char, slab C.uintptr_t, n C.uint64_t, device C.int32_t, out *C.uint64_t, errOut **C.char) C.int {
	return finish(errOut, func() error {
		h, err := capi.ConsumerOpenDevice(goBytes(cfg), uintptr(slab), uint64(n), int(device))
		*out = C.uint64_t(h)
		return err
	})
}

//export ecm_consumer_info
func ecm_consumer_info(h C.uint64_t, out **C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { b, err := capi.ConsumerInfo(uint64(h)); return putJSON(out, b, err) })
}

//export ecm_consumer_acquire
func ecm_consumer_acquire(h C.uint64_t, in *C.char, out **C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { b, err := capi.ConsumerAcquire(uint64(h), goBytes(in)); return putJSON(out, b, err) })
}

//export ecm_consumer_release
func ecm_consumer_release(h C.uint64_t, in *C.char, out **C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { b, err := capi.ConsumerRelease(uint64(h), goBytes(in)); return putJSON(out, b, err) })
}

//export ecm_producer_open
func ecm_producer_open(cfg *C.char, out *C.uint64_t, errOut **C.char) C.int {
	return finish(errOut, func() error { h, err := capi.ProducerOpen(goBytes(cfg)); *out = C.uint64_t(h); return err })
}

//export ecm_producer_submit
func ecm_producer_submit(h C.uint64_t, in *C.char, out **C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { b, err := capi.ProducerSubmit(uint64(h), goBytes(in)); return putJSON(out, b, err) })
}

//export ecm_producer_sources
func ecm_producer_sources(h C.uint64_t, n C.uint64_t, hashes **C.char, ptrs *unsafe.Pointer, nbytes *C.uint64_t, out *C.uint64_t, errOut **C.char) C.int {
	return finish(errOut, func() error {
		k := int(n)
		srcs := make([]capi.Source, k)
		hs, ps, ns := unsafe.Slice(hashes, k), unsafe.Slice(ptrs, k), unsafe.Slice(nbytes, k)
		for i := range srcs {
			srcs[i] = capi.Source{MMHash: goString(hs[i]), Mem: memory(ps[i], ns[i])}
		}
		ids, err := capi.ProducerSources(uint64(h), srcs)
		outs := unsafe.Slice(out, k)
		for i := range outs {
			outs[i] = C.uint64_t(ids[i])
		}
		return err
	})
}

//export ecm_producer_sources_device
func ecm_producer_sources_device(h C.uint64_t, n C.uint64_t, hashes **C.char, ptrs *C.uintptr_t, nbytes *C.uint64_t, devices *C.int32_t, streams *C.uint64_t, out *C.uint64_t, errOut **C.char) C.int {
	return finish(errOut, func() error {
		k := int(n)
		srcs := make([]capi.DeviceSource, k)
		hs, ps, ns := unsafe.Slice(hashes, k), unsafe.Slice(ptrs, k), unsafe.Slice(nbytes, k)
		ds, ss := unsafe.Slice(devices, k), unsafe.Slice(streams, k)
		for i := range srcs {
			srcs[i] = capi.DeviceSource{MMHash: goString(hs[i]), Ordinal: int(ds[i])}
			if ds[i] < 0 {
				srcs[i].Mem = memory(C.ecm_host_ptr(ps[i]), ns[i])
			} else {
				srcs[i].Addr, srcs[i].N, srcs[i].Stream = uintptr(ps[i]), uint64(ns[i]), uintptr(ss[i])
			}
		}
		ids, err := capi.ProducerSourcesDevice(uint64(h), srcs)
		outs := unsafe.Slice(out, k)
		for i := range outs {
			outs[i] = C.uint64_t(ids[i])
		}
		return err
	})
}

//export ecm_producer_cancel
func ecm_producer_cancel(h C.uint64_t, in *C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { return capi.ProducerCancel(uint64(h), goBytes(in)) })
}

//export ecm_producer_poll
func ecm_producer_poll(h C.uint64_t, timeoutMs C.int32_t, out **C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { b, err := capi.ProducerPoll(uint64(h), int32(timeoutMs)); return putJSON(out, b, err) })
}

//export ecm_scheduler_open
func ecm_scheduler_open(cfg *C.char, out *C.uint64_t, errOut **C.char) C.int {
	return finish(errOut, func() error { h, err := capi.SchedulerOpen(goBytes(cfg)); *out = C.uint64_t(h); return err })
}

//export ecm_scheduler_step
func ecm_scheduler_step(h C.uint64_t, in *C.char, out **C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { b, err := capi.SchedulerStep(uint64(h), goBytes(in)); return putJSON(out, b, err) })
}

//export ecm_scheduler_has
func ecm_scheduler_has(h C.uint64_t, mmHash *C.char, out *C.int32_t, errOut **C.char) C.int {
	return finish(errOut, func() error {
		ok, err := capi.SchedulerHas(uint64(h), goString(mmHash))
		*out = 0
		if ok {
			*out = 1
		}
		return err
	})
}

//export ecm_scheduler_wait
func ecm_scheduler_wait(h C.uint64_t, in *C.char, timeoutMs C.int32_t, out **C.char, errOut **C.char) C.int {
	return finish(errOut, func() error {
		b, err := capi.SchedulerWait(uint64(h), goBytes(in), int32(timeoutMs))
		return putJSON(out, b, err)
	})
}

//export ecm_bench_tcp_loopback
func ecm_bench_tcp_loopback(in *C.char, out **C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { b, err := capi.BenchTCPLoopback(goBytes(in)); return putJSON(out, b, err) })
}

//export ecm_proxy_open
func ecm_proxy_open(cfg *C.char, out *C.uint64_t, errOut **C.char) C.int {
	return finish(errOut, func() error { h, err := capi.ProxyOpen(goBytes(cfg)); *out = C.uint64_t(h); return err })
}

//export ecm_registrar_open
func ecm_registrar_open(cfg *C.char, out *C.uint64_t, errOut **C.char) C.int {
	return finish(errOut, func() error { h, err := capi.RegistrarOpen(goBytes(cfg)); *out = C.uint64_t(h); return err })
}

//export ecm_metrics_text
func ecm_metrics_text(out **C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { b, err := capi.MetricsText(); return putJSON(out, b, err) })
}

//export ecm_metadata_server_open
func ecm_metadata_server_open(cfg *C.char, out *C.uint64_t, errOut **C.char) C.int {
	return finish(errOut, func() error { h, err := capi.MetadataServerOpen(goBytes(cfg)); *out = C.uint64_t(h); return err })
}
