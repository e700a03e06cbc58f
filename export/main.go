package main

/*
#include <stdint.h>
#include <stdlib.h>

// Pointers that may be GPU addresses cross as uintptr_t, so that a GPU
// address never sits in a Go pointer; host ones become pointers here.
static void *ecm_host_ptr(uintptr_t p) { return (void *)p; }

// gate.c includes the public header, so that the compiler checks each
// gated definition against the contract.
#cgo CFLAGS: -I${SRCDIR}/../include
*/
import "C"

import (
	"math"
	"unsafe"

	"github.com/ecmooncake/ecmooncake/capi"
)

func main() {}

// finish runs f under capi.Guard and writes the error text for C (a
// forked child never gets here: gate.c refuses it before the runtime).
// Each f checks its pointers and counts before it does any work: an
// object opened for a caller that cannot receive its handle is one nobody
// can close.
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

// memory views caller-owned memory without copying, once capi.Span has
// checked it. The pointer comes from C, so the Go garbage collector
// neither moves nor frees it.
func memory(fn, what string, p unsafe.Pointer, n C.uint64_t) ([]byte, error) {
	if err := capi.Span(fn, what, uintptr(p), uint64(n)); err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, nil
	}
	return unsafe.Slice((*byte)(p), int(n)), nil
}

// finishOut runs f once out is known to be writable (param names it in
// the refusal) and stores its answer, made C by conv, in *out; *out is
// zero whenever f fails.
func finishOut[T, R any](errOut **C.char, fn, param string, out *T, f func() (R, error), conv func(R) T) C.int {
	return finish(errOut, func() error {
		if err := capi.NotNil(fn, param, out != nil); err != nil {
			return err
		}
		var zero T
		*out = zero
		r, err := f()
		if err != nil {
			return err
		}
		*out = conv(r)
		return nil
	})
}

// cText is text for C, freed by the caller with ecm_free.
func cText(b []byte) *C.char { return C.CString(string(b)) }

// finishJSON runs f, whose answer is JSON for *out (the caller frees it
// with ecm_free), once out is known to be writable.
func finishJSON(errOut **C.char, fn string, out **C.char, f func() ([]byte, error)) C.int {
	return finishOut(errOut, fn, "out_json", out, f, cText)
}

// finishHandle runs f, which opens an object, once out is known to be
// writable.
func finishHandle(errOut **C.char, fn string, out *C.uint64_t, f func() (uint64, error)) C.int {
	return finishOut(errOut, fn, "out", out, f, func(h uint64) C.uint64_t { return C.uint64_t(h) })
}

//export ecmgo_abi_version
func ecmgo_abi_version(out *C.int32_t, errOut **C.char) C.int {
	return finishOut(errOut, "ecm_abi_version", "out_version", out,
		func() (int32, error) { return capi.ABIVersion, nil }, func(v int32) C.int32_t { return C.int32_t(v) })
}

//export ecmgo_configure
func ecmgo_configure(cfg *C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { return capi.Configure(goBytes(cfg)) })
}

//export ecmgo_gpu_info
func ecmgo_gpu_info(out **C.char, errOut **C.char) C.int {
	return finishJSON(errOut, "ecm_gpu_info", out, capi.GPUInfo)
}

//export ecmgo_mooncake_info
func ecmgo_mooncake_info(cfg *C.char, out **C.char, errOut **C.char) C.int {
	return finishJSON(errOut, "ecm_mooncake_info", out, func() ([]byte, error) { return capi.MooncakeInfo(goBytes(cfg)) })
}

//export ecmgo_stats
func ecmgo_stats(h C.uint64_t, out **C.char, errOut **C.char) C.int {
	return finishJSON(errOut, "ecm_stats", out, func() ([]byte, error) { return capi.Stats(uint64(h)) })
}

//export ecmgo_trace
func ecmgo_trace(in *C.char, out **C.char, errOut **C.char) C.int {
	return finishJSON(errOut, "ecm_trace", out, func() ([]byte, error) { return capi.Trace(goBytes(in)) })
}

//export ecmgo_close
func ecmgo_close(h C.uint64_t, errOut **C.char) C.int {
	return finish(errOut, func() error { return capi.Close(uint64(h)) })
}

//export ecmgo_consumer_open
func ecmgo_consumer_open(cfg *C.char, slab unsafe.Pointer, n C.uint64_t, out *C.uint64_t, errOut **C.char) C.int {
	const fn = "ecm_consumer_open"
	return finishHandle(errOut, fn, out, func() (uint64, error) {
		mem, err := memory(fn, "slab", slab, n)
		if err != nil {
			return 0, err
		}
		return capi.ConsumerOpen(goBytes(cfg), mem)
	})
}

//export ecmgo_consumer_open_device
func ecmgo_consumer_open_device(cfg *C.char, slab C.uintptr_t, n C.uint64_t, device C.int32_t, out *C.uint64_t, errOut **C.char) C.int {
	const fn = "ecm_consumer_open_device"
	return finishHandle(errOut, fn, out, func() (uint64, error) {
		if err := capi.Span(fn, "slab", uintptr(slab), uint64(n)); err != nil {
			return 0, err
		}
		return capi.ConsumerOpenDevice(goBytes(cfg), uintptr(slab), uint64(n), int(device))
	})
}

//export ecmgo_consumer_info
func ecmgo_consumer_info(h C.uint64_t, out **C.char, errOut **C.char) C.int {
	return finishJSON(errOut, "ecm_consumer_info", out, func() ([]byte, error) { return capi.ConsumerInfo(uint64(h)) })
}

//export ecmgo_consumer_acquire
func ecmgo_consumer_acquire(h C.uint64_t, in *C.char, out **C.char, errOut **C.char) C.int {
	return finishJSON(errOut, "ecm_consumer_acquire", out, func() ([]byte, error) { return capi.ConsumerAcquire(uint64(h), goBytes(in)) })
}

//export ecmgo_consumer_release
func ecmgo_consumer_release(h C.uint64_t, in *C.char, out **C.char, errOut **C.char) C.int {
	return finishJSON(errOut, "ecm_consumer_release", out, func() ([]byte, error) { return capi.ConsumerRelease(uint64(h), goBytes(in)) })
}

//export ecmgo_producer_open
func ecmgo_producer_open(cfg *C.char, out *C.uint64_t, errOut **C.char) C.int {
	return finishHandle(errOut, "ecm_producer_open", out, func() (uint64, error) { return capi.ProducerOpen(goBytes(cfg)) })
}

// packed views a packed batch of n records that the caller owns; the
// decoder bounds its length and checks every record against it.
func packed(fn string, n C.uint64_t, in unsafe.Pointer, inLen C.uint64_t) (int, []byte, error) {
	k, err := capi.Count(fn, uint64(n))
	if err != nil {
		return 0, nil, err
	}
	b, err := memory(fn, "in", in, inLen)
	return k, b, err
}

//export ecmgo_producer_submit_packed
func ecmgo_producer_submit_packed(h C.uint64_t, n C.uint64_t, in unsafe.Pointer, inLen C.uint64_t, out **C.char, errOut **C.char) C.int {
	const fn = "ecm_producer_submit_packed"
	return finish(errOut, func() error {
		if err := capi.NotNil(fn, "out_json", out != nil); err != nil {
			return err
		}
		*out = nil
		k, b, err := packed(fn, n, in, inLen)
		if err != nil {
			return err
		}
		reasons, err := capi.ProducerSubmitPacked(uint64(h), k, b)
		if err != nil || reasons == nil {
			return err
		}
		*out = cText(reasons)
		return nil
	})
}

//export ecmgo_producer_sources_packed
func ecmgo_producer_sources_packed(h C.uint64_t, n C.uint64_t, in unsafe.Pointer, inLen C.uint64_t, out *C.uint64_t, errOut **C.char) C.int {
	const fn = "ecm_producer_sources_packed"
	return finish(errOut, func() error {
		k, b, err := packed(fn, n, in, inLen)
		if err != nil || k == 0 {
			return err
		}
		if err := capi.NotNil(fn, "out_sources", out != nil); err != nil {
			return err
		}
		outs := unsafe.Slice(out, k)
		for i := range outs {
			outs[i] = 0
		}
		recs, err := capi.DecodeSources(fn, k, b)
		if err != nil {
			return err
		}
		srcs := make([]capi.DeviceSource, k)
		for i, r := range recs {
			srcs[i] = capi.DeviceSource{MMHash: r.MMHash, Ordinal: int(r.Device)}
			if r.Device < 0 {
				// Span was checked by the decoder; host memory is viewed, not copied.
				if r.N > 0 {
					srcs[i].Mem = unsafe.Slice((*byte)(C.ecm_host_ptr(C.uintptr_t(r.Ptr))), int(r.N))
				}
			} else {
				srcs[i].Addr, srcs[i].N, srcs[i].Stream = r.Ptr, r.N, r.Stream
			}
		}
		ids, err := capi.ProducerSourcesDevice(uint64(h), srcs)
		for i := range outs {
			outs[i] = C.uint64_t(ids[i])
		}
		return err
	})
}

// ecm_noop is the floor that the hot calls are measured against: one
// crossing of the boundary with their argument count, and nothing else.
//
//export ecmgo_noop
func ecmgo_noop(h C.uint64_t, n C.uint64_t, in unsafe.Pointer, inLen C.uint64_t, out *C.uint64_t, errOut **C.char) C.int {
	if errOut != nil {
		*errOut = nil
	}
	return C.int(capi.StatusOK)
}

//export ecmgo_producer_cancel
func ecmgo_producer_cancel(h C.uint64_t, in *C.char, errOut **C.char) C.int {
	return finish(errOut, func() error { return capi.ProducerCancel(uint64(h), goBytes(in)) })
}

//export ecmgo_producer_poll
func ecmgo_producer_poll(h C.uint64_t, timeoutMs C.int32_t, out **C.char, errOut **C.char) C.int {
	return finishJSON(errOut, "ecm_producer_poll", out, func() ([]byte, error) { return capi.ProducerPoll(uint64(h), int32(timeoutMs)) })
}

//export ecmgo_scheduler_open
func ecmgo_scheduler_open(cfg *C.char, out *C.uint64_t, errOut **C.char) C.int {
	return finishHandle(errOut, "ecm_scheduler_open", out, func() (uint64, error) { return capi.SchedulerOpen(goBytes(cfg)) })
}

//export ecmgo_scheduler_step
func ecmgo_scheduler_step(h C.uint64_t, in *C.char, out **C.char, errOut **C.char) C.int {
	return finishJSON(errOut, "ecm_scheduler_step", out, func() ([]byte, error) { return capi.SchedulerStep(uint64(h), goBytes(in)) })
}

//export ecmgo_scheduler_has
func ecmgo_scheduler_has(h C.uint64_t, mmHash *C.char, out *C.int32_t, errOut **C.char) C.int {
	return finishOut(errOut, "ecm_scheduler_has", "out", out, func() (bool, error) { return capi.SchedulerHas(uint64(h), goString(mmHash)) },
		func(ok bool) C.int32_t {
			if ok {
				return 1
			}
			return 0
		})
}

//export ecmgo_scheduler_watch
func ecmgo_scheduler_watch(h C.uint64_t, counter *C.uint64_t, errOut **C.char) C.int {
	const fn = "ecm_scheduler_watch"
	return finish(errOut, func() error {
		if err := capi.NotNil(fn, "counter", counter != nil); err != nil {
			return err
		}
		return capi.SchedulerWatch(uint64(h), (*uint64)(unsafe.Pointer(counter)))
	})
}

//export ecmgo_scheduler_poll
func ecmgo_scheduler_poll(h C.uint64_t, out *C.int32_t, errOut **C.char) C.int {
	return finishOut(errOut, "ecm_scheduler_poll", "out", out, func() (int, error) { return capi.SchedulerPoll(uint64(h)) },
		func(n int) C.int32_t { return C.int32_t(min(n, math.MaxInt32)) })
}

//export ecmgo_scheduler_wait
func ecmgo_scheduler_wait(h C.uint64_t, in *C.char, timeoutMs C.int32_t, out **C.char, errOut **C.char) C.int {
	return finishJSON(errOut, "ecm_scheduler_wait", out, func() ([]byte, error) {
		return capi.SchedulerWait(uint64(h), goBytes(in), int32(timeoutMs))
	})
}

//export ecmgo_proxy_open
func ecmgo_proxy_open(cfg *C.char, out *C.uint64_t, errOut **C.char) C.int {
	return finishHandle(errOut, "ecm_proxy_open", out, func() (uint64, error) { return capi.ProxyOpen(goBytes(cfg)) })
}

//export ecmgo_registrar_open
func ecmgo_registrar_open(cfg *C.char, out *C.uint64_t, errOut **C.char) C.int {
	return finishHandle(errOut, "ecm_registrar_open", out, func() (uint64, error) { return capi.RegistrarOpen(goBytes(cfg)) })
}

//export ecmgo_metrics_text
func ecmgo_metrics_text(out **C.char, errOut **C.char) C.int {
	return finishOut(errOut, "ecm_metrics_text", "out_text", out, capi.MetricsText, cText)
}

//export ecmgo_metadata_server_open
func ecmgo_metadata_server_open(cfg *C.char, out *C.uint64_t, errOut **C.char) C.int {
	return finishHandle(errOut, "ecm_metadata_server_open", out, func() (uint64, error) { return capi.MetadataServerOpen(goBytes(cfg)) })
}
