/* The part of the CUDA driver API that ecmooncake uses, declared here so
 * that no CUDA header is needed to build; the library is opened with dlopen
 * at run time. Types and constants follow cuda.h (CUDA 12 and 13). */
#ifndef ECM_CUDA_SHIM_H
#define ECM_CUDA_SHIM_H

#include <stddef.h>
#include <stdint.h>

/* Nothing here is part of the library's ABI: keep it out of the exported
 * symbols of libecmooncake.so. */
#pragma GCC visibility push(hidden)

typedef int ecm_CUresult;
typedef int ecm_CUdevice;
typedef void *ecm_CUcontext;
typedef void *ecm_CUstream;
typedef void *ecm_CUevent;
typedef unsigned long long ecm_CUdeviceptr;
typedef struct {
	char reserved[64];
} ecm_CUipcMemHandle;

#define ECM_CUDA_SUCCESS 0
#define ECM_CUDA_ERROR_NOT_READY 600
#define ECM_CUDA_ERROR_NOT_SUPPORTED 801
#define ECM_CU_MEMHOSTREGISTER_DEVICEMAP 0x2
#define ECM_CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 92
#define ECM_CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1 93
#define ECM_CU_STREAM_NON_BLOCKING 0x1
#define ECM_CU_EVENT_BLOCKING_SYNC 0x1
#define ECM_CU_EVENT_DISABLE_TIMING 0x2
#define ECM_CU_MEMHOSTALLOC_PORTABLE 0x1
#define ECM_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1
#define ECM_CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define ECM_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define ECM_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR 11
#define ECM_CU_POINTER_ATTRIBUTE_RANGE_SIZE 12
#define ECM_CU_MEMORYTYPE_DEVICE 2

/* Opens the library at path and resolves every symbol. Returns 0, or -1
 * with a message in err (dlerror's text or the missing symbol). */
int ecm_cu_load(const char *path, char *err, size_t errlen);

/* Each wrapper calls the driver function of the same name through the
 * pointer ecm_cu_load resolved. */
ecm_CUresult ecm_cuInit(unsigned flags);
ecm_CUresult ecm_cuDriverGetVersion(int *v);
ecm_CUresult ecm_cuDeviceGetCount(int *n);
ecm_CUresult ecm_cuDeviceGet(ecm_CUdevice *d, int ordinal);
ecm_CUresult ecm_cuDeviceGetName(char *name, int len, ecm_CUdevice d);
ecm_CUresult ecm_cuDevicePrimaryCtxRetain(ecm_CUcontext *c, ecm_CUdevice d);
ecm_CUresult ecm_cuCtxSetCurrent(ecm_CUcontext c);
ecm_CUresult ecm_cuStreamCreate(ecm_CUstream *s, unsigned flags);
ecm_CUresult ecm_cuEventCreate(ecm_CUevent *e, unsigned flags);
ecm_CUresult ecm_cuEventDestroy(ecm_CUevent e);
ecm_CUresult ecm_cuEventRecord(ecm_CUevent e, ecm_CUstream s);
/* Records on a stream named by its handle's value (PyTorch's cuda_stream). */
ecm_CUresult ecm_cuEventRecordOn(ecm_CUevent e, uintptr_t s);
ecm_CUresult ecm_cuMemHostAlloc(void **p, size_t n, unsigned flags);
ecm_CUresult ecm_cuMemFreeHost(void *p);
ecm_CUresult ecm_cuMemGetAddressRange(ecm_CUdeviceptr *base, size_t *size, ecm_CUdeviceptr p);
/* Memory type, device ordinal and the allocation [base, base+size) that
 * holds p, in one driver call. Host memory the driver does not know reads
 * as memory type 0. */
ecm_CUresult ecm_cu_pointer_info(ecm_CUdeviceptr p, unsigned *mem_type, int *ordinal, ecm_CUdeviceptr *base, size_t *size);
/* One pointer's attributes, as ecm_cu_pointer_info reads them. */
typedef struct {
	ecm_CUdeviceptr p;
	unsigned mem_type;
	int ordinal;
	ecm_CUdeviceptr base;
	size_t size;
	ecm_CUresult status;
} ecm_pointer_info;
/* ecm_cu_pointer_info for n pointers in one call: a batch's sources are
 * checked with one crossing from Go. */
void ecm_cu_pointers_info(ecm_pointer_info *ps, int n);
ecm_CUresult ecm_cuIpcGetMemHandle(ecm_CUipcMemHandle *h, ecm_CUdeviceptr p);
ecm_CUresult ecm_cuIpcOpenMemHandle(ecm_CUdeviceptr *p, const ecm_CUipcMemHandle *h, unsigned flags);
ecm_CUresult ecm_cuIpcCloseMemHandle(ecm_CUdeviceptr p);
ecm_CUresult ecm_cuMemAlloc(ecm_CUdeviceptr *p, size_t n);
ecm_CUresult ecm_cuMemFree(ecm_CUdeviceptr p);

/* "NAME (description)" for a result code; never NULL. */
const char *ecm_cu_error_name(ecm_CUresult r);
const char *ecm_cu_error_string(ecm_CUresult r);

/* One device-to-device copy of a batch. */
typedef struct {
	ecm_CUdeviceptr dst, src;
	uint64_t n;
	ecm_CUevent after; /* NULL: no wait */
} ecm_copy;

/* One ready word of a batch: an 8-byte store of value at addr (a device
 * pointer of registered host memory), queued after the batch's copies. */
typedef struct {
	ecm_CUdeviceptr addr;
	uint64_t value;
} ecm_value_write;

/* Whether this driver and device d can store ready words: 1, or 0 with
 * *why saying what is missing. Picks cuStreamWriteValue64_v2, else the v1
 * entry point where d's attributes allow it. Call before any batch that
 * carries writes. */
int ecm_cu_value_writes(ecm_CUdevice d, const char **why);
/* Registers [p, p+n) (page-aligned) with the current context, mapped for
 * the device (CU_MEMHOSTREGISTER_DEVICEMAP), and returns the device's
 * address of p; undone on failure. */
ecm_CUresult ecm_cu_host_register(void *p, size_t n, ecm_CUdeviceptr *dev, const char **failed);
ecm_CUresult ecm_cu_host_unregister(void *p);

/* The copy helpers queue their work on stream s behind the events they
 * are given, record done on s, and wait for done, all in one call: host
 * memory is touched only while the call runs. On failure *failed names
 * the driver function that failed.
 *
 * A batch of device-to-device copies, which touches no host memory, is
 * queued and waited for in two calls, so that the caller can keep other
 * batches from interleaving with its queueing: ecm_cu_copy_batch_queue
 * queues every wait first, then records start, the copies and done (both
 * events keep time), with the nw ready words stored after the copies and
 * before done (flags 0: fenced after them), and says how long queueing took
 * (queue_ns[0]) and, of that, the stream's waits for the sources' events
 * (queue_ns[1]) and the start event with the copies (queue_ns[2]); ecm_cu_wait_timed
 * waits for done and reports the wait and the GPU's milliseconds from
 * start to done (negative when the driver cannot say). */
ecm_CUresult ecm_cu_copy_batch_queue(ecm_CUstream s, ecm_CUevent start, ecm_CUevent done, const ecm_copy *ops, int n,
                                     const ecm_value_write *writes, int nw, int64_t queue_ns[3], const char **failed);
ecm_CUresult ecm_cu_wait_timed(ecm_CUevent start, ecm_CUevent done, int64_t *wait_ns, float *gpu_ms, const char **failed);
/* One device-to-host copy of a batch. */
typedef struct {
	void *dst;
	ecm_CUdeviceptr src;
	uint64_t n;
	ecm_CUevent after; /* NULL: no wait */
} ecm_host_copy;

/* ecm_cu_copy_dtoh_batch queues the n copies (each behind its event) and
 * waits for them once. When queueing op i fails, *failed_at is i, the ops
 * before it still run and are waited for, and those after it are not
 * queued; when the record or the wait fails, *failed_at is -1 and no op's
 * outcome is known. */
ecm_CUresult ecm_cu_copy_dtoh_batch(ecm_CUstream s, ecm_CUevent done, const ecm_host_copy *ops, int n, int *failed_at, const char **failed);
ecm_CUresult ecm_cu_copy_htod(ecm_CUstream s, ecm_CUevent done, ecm_CUdeviceptr dst, const void *src, size_t n, const char **failed);

#pragma GCC visibility pop

#endif
