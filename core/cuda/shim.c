#include "shim.h"

#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* CUstreamBatchMemOpParams (cuda.h), its writeValue member: the union is
 * 48 bytes, operation at 0, address at 8, value64 at 16, flags at 24. */
struct mem_op {
	unsigned operation;
	ecm_CUdeviceptr address;
	uint64_t value64;
	unsigned flags;
	ecm_CUdeviceptr alias;
	uint64_t pad;
};
_Static_assert(sizeof(struct mem_op) == 48, "CUstreamBatchMemOpParams is 48 bytes");
#define ECM_CU_STREAM_MEM_OP_WRITE_VALUE_64 5
/* cuStreamBatchMemOp takes fewer than 256 operations a call. */
#define ECM_MEM_OPS_PER_CALL 255

/* CUmemcpyAttributes (cuda.h): srcAccessOrder, two CUmemLocation hints
 * (type, id), flags. */
struct memcpy_attrs {
	int src_access_order;
	int src_loc_type, src_loc_id;
	int dst_loc_type, dst_loc_id;
	unsigned flags;
};
_Static_assert(sizeof(struct memcpy_attrs) == 24, "CUmemcpyAttributes is 24 bytes");
#define ECM_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM 1

struct cu_table {
	ecm_CUresult (*cuInit)(unsigned);
	ecm_CUresult (*cuDriverGetVersion)(int *);
	ecm_CUresult (*cuDeviceGetCount)(int *);
	ecm_CUresult (*cuDeviceGet)(ecm_CUdevice *, int);
	ecm_CUresult (*cuDeviceGetName)(char *, int, ecm_CUdevice);
	ecm_CUresult (*cuDevicePrimaryCtxRetain)(ecm_CUcontext *, ecm_CUdevice);
	ecm_CUresult (*cuCtxSetCurrent)(ecm_CUcontext);
	ecm_CUresult (*cuStreamCreate)(ecm_CUstream *, unsigned);
	ecm_CUresult (*cuStreamWaitEvent)(ecm_CUstream, ecm_CUevent, unsigned);
	ecm_CUresult (*cuEventCreate)(ecm_CUevent *, unsigned);
	ecm_CUresult (*cuEventDestroy)(ecm_CUevent);
	ecm_CUresult (*cuEventRecord)(ecm_CUevent, ecm_CUstream);
	ecm_CUresult (*cuEventSynchronize)(ecm_CUevent);
	ecm_CUresult (*cuEventQuery)(ecm_CUevent);
	ecm_CUresult (*cuMemcpyAsync)(ecm_CUdeviceptr, ecm_CUdeviceptr, size_t, ecm_CUstream);
	ecm_CUresult (*cuMemcpyHtoDAsync)(ecm_CUdeviceptr, const void *, size_t, ecm_CUstream);
	ecm_CUresult (*cuMemcpyDtoHAsync)(void *, ecm_CUdeviceptr, size_t, ecm_CUstream);
	ecm_CUresult (*cuMemHostAlloc)(void **, size_t, unsigned);
	ecm_CUresult (*cuMemFreeHost)(void *);
	ecm_CUresult (*cuMemGetAddressRange)(ecm_CUdeviceptr *, size_t *, ecm_CUdeviceptr);
	ecm_CUresult (*cuPointerGetAttributes)(unsigned, int *, void **, ecm_CUdeviceptr);
	ecm_CUresult (*cuIpcGetMemHandle)(ecm_CUipcMemHandle *, ecm_CUdeviceptr);
	ecm_CUresult (*cuIpcOpenMemHandle)(ecm_CUdeviceptr *, ecm_CUipcMemHandle, unsigned);
	ecm_CUresult (*cuIpcCloseMemHandle)(ecm_CUdeviceptr);
	ecm_CUresult (*cuMemAlloc)(ecm_CUdeviceptr *, size_t);
	ecm_CUresult (*cuMemFree)(ecm_CUdeviceptr);
	ecm_CUresult (*cuGetErrorName)(ecm_CUresult, const char **);
	ecm_CUresult (*cuGetErrorString)(ecm_CUresult, const char **);
	/* Optional: NULL when the driver lacks it (timings then say so). */
	ecm_CUresult (*cuEventElapsedTime)(float *, ecm_CUevent, ecm_CUevent);
	/* Optional: ready words (see ecm_cu_value_writes). */
	ecm_CUresult (*cuDeviceGetAttribute)(int *, int, ecm_CUdevice);
	ecm_CUresult (*cuMemHostRegister)(void *, size_t, unsigned);
	ecm_CUresult (*cuMemHostUnregister)(void *);
	ecm_CUresult (*cuMemHostGetDevicePointer)(ecm_CUdeviceptr *, void *, unsigned);
	ecm_CUresult (*cuStreamWriteValue64)(ecm_CUstream, ecm_CUdeviceptr, uint64_t, unsigned);
	/* The v1 entry point, used only when the driver has no _v2: it needs
	 * the device attributes that say stream memory operations are on. */
	ecm_CUresult (*cuStreamWriteValue64V1)(ecm_CUstream, ecm_CUdeviceptr, uint64_t, unsigned);
	/* Optional: a batch's words in one call, with the same _v2 / v1 choice. */
	ecm_CUresult (*cuStreamBatchMemOp)(ecm_CUstream, unsigned, struct mem_op *, unsigned);
	ecm_CUresult (*cuStreamBatchMemOpV1)(ecm_CUstream, unsigned, struct mem_op *, unsigned);
	/* Optional (CUDA 12.8+): a batch's copies in one call. The unversioned
	 * symbol keeps 12.8's signature, failIdx included, on later drivers. */
	ecm_CUresult (*cuMemcpyBatchAsync)(ecm_CUdeviceptr *, ecm_CUdeviceptr *, size_t *, size_t, struct memcpy_attrs *, size_t *,
	                                   size_t, size_t *, ecm_CUstream);
};

static struct cu_table cu;

/* The stream value writes ecm_cu_value_writes chose: _v2 where the driver
 * has it, else v1 on a device whose attributes allow it; batch_mem_op is
 * NULL where the driver has no batch entry point of that version. */
static ecm_CUresult (*write_value64)(ecm_CUstream, ecm_CUdeviceptr, uint64_t, unsigned);
static ecm_CUresult (*batch_mem_op)(ecm_CUstream, unsigned, struct mem_op *, unsigned);

/* The exported names: where cuda.h maps a name to a _v2 entry point, the
 * _v2 symbol is the one with the signature above. */
static const struct {
	const char *name;
	size_t offset;
} symbols[] = {
	{"cuInit", offsetof(struct cu_table, cuInit)},
	{"cuDriverGetVersion", offsetof(struct cu_table, cuDriverGetVersion)},
	{"cuDeviceGetCount", offsetof(struct cu_table, cuDeviceGetCount)},
	{"cuDeviceGet", offsetof(struct cu_table, cuDeviceGet)},
	{"cuDeviceGetName", offsetof(struct cu_table, cuDeviceGetName)},
	{"cuDevicePrimaryCtxRetain", offsetof(struct cu_table, cuDevicePrimaryCtxRetain)},
	{"cuCtxSetCurrent", offsetof(struct cu_table, cuCtxSetCurrent)},
	{"cuStreamCreate", offsetof(struct cu_table, cuStreamCreate)},
	{"cuStreamWaitEvent", offsetof(struct cu_table, cuStreamWaitEvent)},
	{"cuEventCreate", offsetof(struct cu_table, cuEventCreate)},
	{"cuEventDestroy_v2", offsetof(struct cu_table, cuEventDestroy)},
	{"cuEventRecord", offsetof(struct cu_table, cuEventRecord)},
	{"cuEventSynchronize", offsetof(struct cu_table, cuEventSynchronize)},
	{"cuEventQuery", offsetof(struct cu_table, cuEventQuery)},
	{"cuMemcpyAsync", offsetof(struct cu_table, cuMemcpyAsync)},
	{"cuMemcpyHtoDAsync_v2", offsetof(struct cu_table, cuMemcpyHtoDAsync)},
	{"cuMemcpyDtoHAsync_v2", offsetof(struct cu_table, cuMemcpyDtoHAsync)},
	{"cuMemHostAlloc", offsetof(struct cu_table, cuMemHostAlloc)},
	{"cuMemFreeHost", offsetof(struct cu_table, cuMemFreeHost)},
	{"cuMemGetAddressRange_v2", offsetof(struct cu_table, cuMemGetAddressRange)},
	{"cuPointerGetAttributes", offsetof(struct cu_table, cuPointerGetAttributes)},
	{"cuIpcGetMemHandle", offsetof(struct cu_table, cuIpcGetMemHandle)},
	{"cuIpcOpenMemHandle_v2", offsetof(struct cu_table, cuIpcOpenMemHandle)},
	{"cuIpcCloseMemHandle", offsetof(struct cu_table, cuIpcCloseMemHandle)},
	{"cuMemAlloc_v2", offsetof(struct cu_table, cuMemAlloc)},
	{"cuMemFree_v2", offsetof(struct cu_table, cuMemFree)},
	{"cuGetErrorName", offsetof(struct cu_table, cuGetErrorName)},
	{"cuGetErrorString", offsetof(struct cu_table, cuGetErrorString)},
};

/* Symbols a driver may lack without the library becoming unusable; the
 * first name found wins. */
static const struct {
	const char *names[2];
	size_t offset;
} optional_symbols[] = {
	{{"cuEventElapsedTime_v2", "cuEventElapsedTime"}, offsetof(struct cu_table, cuEventElapsedTime)},
	{{"cuDeviceGetAttribute", NULL}, offsetof(struct cu_table, cuDeviceGetAttribute)},
	{{"cuMemHostRegister_v2", "cuMemHostRegister"}, offsetof(struct cu_table, cuMemHostRegister)},
	{{"cuMemHostUnregister", NULL}, offsetof(struct cu_table, cuMemHostUnregister)},
	{{"cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"}, offsetof(struct cu_table, cuMemHostGetDevicePointer)},
	{{"cuStreamWriteValue64_v2", NULL}, offsetof(struct cu_table, cuStreamWriteValue64)},
	{{"cuStreamWriteValue64", NULL}, offsetof(struct cu_table, cuStreamWriteValue64V1)},
	{{"cuStreamBatchMemOp_v2", NULL}, offsetof(struct cu_table, cuStreamBatchMemOp)},
	{{"cuStreamBatchMemOp", NULL}, offsetof(struct cu_table, cuStreamBatchMemOpV1)},
	{{"cuMemcpyBatchAsync", NULL}, offsetof(struct cu_table, cuMemcpyBatchAsync)},
};

int ecm_cu_load(const char *path, char *err, size_t errlen) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char *why = dlerror();
		snprintf(err, errlen, "%s", why ? why : "dlopen failed");
		return -1;
	}
	/* Resolved into a copy first: a library that lacks a symbol must not
	 * spoil a table an earlier load filled. */
	char *table = (char *)&cu;
	void *resolved[sizeof(symbols) / sizeof(symbols[0])];
	for (size_t i = 0; i < sizeof(symbols) / sizeof(symbols[0]); i++) {
		resolved[i] = dlsym(h, symbols[i].name);
		if (resolved[i] == NULL) {
			snprintf(err, errlen, "%s lacks %s (a driver older than CUDA 11?)", path, symbols[i].name);
			dlclose(h);
			return -1;
		}
	}
	for (size_t i = 0; i < sizeof(symbols) / sizeof(symbols[0]); i++) {
		memcpy(table + symbols[i].offset, &resolved[i], sizeof(void *));
	}
	for (size_t i = 0; i < sizeof(optional_symbols) / sizeof(optional_symbols[0]); i++) {
		void *p = NULL;
		for (size_t k = 0; p == NULL && k < 2 && optional_symbols[i].names[k] != NULL; k++) {
			p = dlsym(h, optional_symbols[i].names[k]);
		}
		memcpy(table + optional_symbols[i].offset, &p, sizeof(void *));
	}
	/* The handle stays open for the life of the process: the table points
	 * into it. */
	return 0;
}

ecm_CUresult ecm_cuInit(unsigned f) { return cu.cuInit(f); }
ecm_CUresult ecm_cuDriverGetVersion(int *v) { return cu.cuDriverGetVersion(v); }
ecm_CUresult ecm_cuDeviceGetCount(int *n) { return cu.cuDeviceGetCount(n); }
ecm_CUresult ecm_cuDeviceGet(ecm_CUdevice *d, int o) { return cu.cuDeviceGet(d, o); }
ecm_CUresult ecm_cuDeviceGetName(char *s, int n, ecm_CUdevice d) { return cu.cuDeviceGetName(s, n, d); }
ecm_CUresult ecm_cuDevicePrimaryCtxRetain(ecm_CUcontext *c, ecm_CUdevice d) { return cu.cuDevicePrimaryCtxRetain(c, d); }
ecm_CUresult ecm_cuCtxSetCurrent(ecm_CUcontext c) { return cu.cuCtxSetCurrent(c); }
ecm_CUresult ecm_cuStreamCreate(ecm_CUstream *s, unsigned f) { return cu.cuStreamCreate(s, f); }
ecm_CUresult ecm_cuEventCreate(ecm_CUevent *e, unsigned f) { return cu.cuEventCreate(e, f); }
ecm_CUresult ecm_cuEventDestroy(ecm_CUevent e) { return cu.cuEventDestroy(e); }
ecm_CUresult ecm_cuEventRecord(ecm_CUevent e, ecm_CUstream s) { return cu.cuEventRecord(e, s); }
ecm_CUresult ecm_cuEventRecordOn(ecm_CUevent e, uintptr_t s) { return cu.cuEventRecord(e, (ecm_CUstream)s); }
ecm_CUresult ecm_cuMemHostAlloc(void **p, size_t n, unsigned f) { return cu.cuMemHostAlloc(p, n, f); }
ecm_CUresult ecm_cuMemFreeHost(void *p) { return cu.cuMemFreeHost(p); }
ecm_CUresult ecm_cuMemGetAddressRange(ecm_CUdeviceptr *b, size_t *s, ecm_CUdeviceptr p) { return cu.cuMemGetAddressRange(b, s, p); }
ecm_CUresult ecm_cu_pointer_info(ecm_CUdeviceptr p, unsigned *mem_type, int *ordinal, ecm_CUdeviceptr *base, size_t *size) {
	int attrs[] = {ECM_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ECM_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
	               ECM_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ECM_CU_POINTER_ATTRIBUTE_RANGE_SIZE};
	void *data[] = {mem_type, ordinal, base, size};
	*mem_type = 0;
	*ordinal = -1;
	*base = 0;
	*size = 0;
	return cu.cuPointerGetAttributes(4, attrs, data, p);
}
void ecm_cu_pointers_info(ecm_pointer_info *ps, int n) {
	for (int i = 0; i < n; i++) {
		ps[i].status = ecm_cu_pointer_info(ps[i].p, &ps[i].mem_type, &ps[i].ordinal, &ps[i].base, &ps[i].size);
	}
}
ecm_CUresult ecm_cuIpcGetMemHandle(ecm_CUipcMemHandle *h, ecm_CUdeviceptr p) { return cu.cuIpcGetMemHandle(h, p); }
ecm_CUresult ecm_cuIpcOpenMemHandle(ecm_CUdeviceptr *p, const ecm_CUipcMemHandle *h, unsigned f) { return cu.cuIpcOpenMemHandle(p, *h, f); }
ecm_CUresult ecm_cuIpcCloseMemHandle(ecm_CUdeviceptr p) { return cu.cuIpcCloseMemHandle(p); }
ecm_CUresult ecm_cuMemAlloc(ecm_CUdeviceptr *p, size_t n) { return cu.cuMemAlloc(p, n); }
ecm_CUresult ecm_cuMemFree(ecm_CUdeviceptr p) { return cu.cuMemFree(p); }

const char *ecm_cu_error_name(ecm_CUresult r) {
	const char *s = NULL;
	if (cu.cuGetErrorName == NULL || cu.cuGetErrorName(r, &s) != ECM_CUDA_SUCCESS || s == NULL) {
		return "CUDA_ERROR_UNKNOWN_CODE";
	}
	return s;
}

const char *ecm_cu_error_string(ecm_CUresult r) {
	const char *s = NULL;
	if (cu.cuGetErrorString == NULL || cu.cuGetErrorString(r, &s) != ECM_CUDA_SUCCESS || s == NULL) {
		return "no description";
	}
	return s;
}

#define TRY(call, name)          \
	do {                         \
		ecm_CUresult r_ = (call); \
		if (r_ != ECM_CUDA_SUCCESS) { \
			*failed = (name);    \
			return r_;           \
		}                        \
	} while (0)

static int64_t now_ns(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* wait_done waits for a copy's event: polled for up to WAIT_SPIN_NS, then
 * a blocking wait. Most copies of one batch end within the spin, and a
 * sleeping thread wakes a hundred microseconds or more after the GPU
 * finished; a long copy costs only the spin in CPU before the thread
 * sleeps. */
#define WAIT_SPIN_NS 300000
static ecm_CUresult wait_done(ecm_CUevent done) {
	int64_t until = now_ns() + WAIT_SPIN_NS;
	do {
		ecm_CUresult r = cu.cuEventQuery(done);
		if (r != ECM_CUDA_ERROR_NOT_READY) {
			return r;
		}
	} while (now_ns() < until);
	return cu.cuEventSynchronize(done);
}

/* queue_copies queues n device copies on s: one cuMemcpyBatchAsync where
 * the driver has it (one driver entry instead of n), read in stream order
 * so that the waits queued before still hold; else one cuMemcpyAsync each. */
#define ECM_COPIES_PER_BATCH 64
static ecm_CUresult queue_copies(ecm_CUstream s, const ecm_copy *ops, int n, const char **failed) {
	if (cu.cuMemcpyBatchAsync == NULL || n < 2) {
		for (int i = 0; i < n; i++) {
			TRY(cu.cuMemcpyAsync(ops[i].dst, ops[i].src, (size_t)ops[i].n, s), "cuMemcpyAsync");
		}
		return ECM_CUDA_SUCCESS;
	}
	ecm_CUdeviceptr dsts[ECM_COPIES_PER_BATCH], srcs[ECM_COPIES_PER_BATCH];
	size_t sizes[ECM_COPIES_PER_BATCH];
	struct memcpy_attrs attrs = {.src_access_order = ECM_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM};
	size_t attrs_at = 0;
	for (int i = 0; i < n;) {
		size_t k = 0;
		for (; i < n && k < ECM_COPIES_PER_BATCH; i++) {
			if (ops[i].n == 0) {
				continue; /* a batch copy must move a byte */
			}
			dsts[k] = ops[i].dst;
			srcs[k] = ops[i].src;
			sizes[k] = (size_t)ops[i].n;
			k++;
		}
		if (k == 0) {
			continue;
		}
		size_t fail_at = 0;
		TRY(cu.cuMemcpyBatchAsync(dsts, srcs, sizes, k, &attrs, &attrs_at, 1, &fail_at, s), "cuMemcpyBatchAsync");
	}
	return ECM_CUDA_SUCCESS;
}

/* queue_words stores nw words on s after what is queued there: one
 * cuStreamBatchMemOp per 255 where the driver has it, else one
 * cuStreamWriteValue64 each. Flags 0 on every word: each store waits for
 * the work before it on the stream, and a memory barrier orders the
 * copies' bytes before the word. */
static ecm_CUresult queue_words(ecm_CUstream s, const ecm_value_write *writes, int nw, const char **failed) {
	if (nw > 0 && write_value64 == NULL) {
		*failed = "cuStreamWriteValue64 (missing)";
		return ECM_CUDA_ERROR_NOT_SUPPORTED;
	}
	if (batch_mem_op == NULL || nw < 2) {
		for (int i = 0; i < nw; i++) {
			TRY(write_value64(s, writes[i].addr, writes[i].value, 0), "cuStreamWriteValue64");
		}
		return ECM_CUDA_SUCCESS;
	}
	struct mem_op ops[ECM_MEM_OPS_PER_CALL];
	for (int i = 0; i < nw;) {
		unsigned k = 0;
		for (; i < nw && k < ECM_MEM_OPS_PER_CALL; i++, k++) {
			memset(&ops[k], 0, sizeof ops[k]);
			ops[k].operation = ECM_CU_STREAM_MEM_OP_WRITE_VALUE_64;
			ops[k].address = writes[i].addr;
			ops[k].value64 = writes[i].value;
		}
		TRY(batch_mem_op(s, k, ops, 0), "cuStreamBatchMemOp");
	}
	return ECM_CUDA_SUCCESS;
}

ecm_CUresult ecm_cu_copy_batch_queue(ecm_CUstream s, ecm_CUevent start, ecm_CUevent done, const ecm_copy *ops, int n,
                                     const ecm_value_write *writes, int nw, int64_t queue_ns[3], const char **failed) {
	int64_t t0 = now_ns();
	queue_ns[0] = queue_ns[1] = queue_ns[2] = 0;
	for (int i = 0; i < n; i++) {
		if (ops[i].after != NULL) {
			TRY(cu.cuStreamWaitEvent(s, ops[i].after, 0), "cuStreamWaitEvent");
		}
	}
	int64_t t1 = now_ns();
	TRY(cu.cuEventRecord(start, s), "cuEventRecord");
	ecm_CUresult r = queue_copies(s, ops, n, failed);
	if (r != ECM_CUDA_SUCCESS) {
		return r;
	}
	int64_t t2 = now_ns();
	r = queue_words(s, writes, nw, failed);
	if (r != ECM_CUDA_SUCCESS) {
		return r;
	}
	TRY(cu.cuEventRecord(done, s), "cuEventRecord");
	queue_ns[0] = now_ns() - t0;
	queue_ns[1] = t1 - t0;
	queue_ns[2] = t2 - t1;
	return ECM_CUDA_SUCCESS;
}

ecm_CUresult ecm_cu_wait_timed(ecm_CUevent start, ecm_CUevent done, int64_t *wait_ns, float *gpu_ms, const char **failed) {
	int64_t t0 = now_ns();
	*wait_ns = 0;
	*gpu_ms = -1;
	TRY(wait_done(done), "cuEventSynchronize");
	*wait_ns = now_ns() - t0;
	if (cu.cuEventElapsedTime != NULL) {
		float ms = -1;
		if (cu.cuEventElapsedTime(&ms, start, done) == ECM_CUDA_SUCCESS) {
			*gpu_ms = ms;
		}
	}
	return ECM_CUDA_SUCCESS;
}

int ecm_cu_value_writes(ecm_CUdevice d, const char **why) {
	if (cu.cuMemHostRegister == NULL || cu.cuMemHostUnregister == NULL || cu.cuMemHostGetDevicePointer == NULL) {
		*why = "the driver lacks cuMemHostRegister, cuMemHostUnregister or cuMemHostGetDevicePointer";
		return 0;
	}
	if (cu.cuStreamWriteValue64 != NULL) {
		write_value64 = cu.cuStreamWriteValue64;
		batch_mem_op = cu.cuStreamBatchMemOp;
		return 1;
	}
	if (cu.cuStreamWriteValue64V1 == NULL) {
		*why = "the driver lacks cuStreamWriteValue64";
		return 0;
	}
	int on = 0, wide = 0;
	if (cu.cuDeviceGetAttribute == NULL ||
	    cu.cuDeviceGetAttribute(&on, ECM_CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, d) != ECM_CUDA_SUCCESS ||
	    cu.cuDeviceGetAttribute(&wide, ECM_CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1, d) != ECM_CUDA_SUCCESS) {
		*why = "cannot read the device's stream memory operation attributes";
		return 0;
	}
	if (!on || !wide) {
		*why = "the device does not offer 64-bit stream memory operations (CAN_USE_STREAM_MEM_OPS_V1 and CAN_USE_64_BIT_STREAM_MEM_OPS_V1)";
		return 0;
	}
	write_value64 = cu.cuStreamWriteValue64V1;
	batch_mem_op = cu.cuStreamBatchMemOpV1;
	return 1;
}

ecm_CUresult ecm_cu_host_register(void *p, size_t n, ecm_CUdeviceptr *dev, const char **failed) {
	*dev = 0;
	TRY(cu.cuMemHostRegister(p, n, ECM_CU_MEMHOSTREGISTER_DEVICEMAP), "cuMemHostRegister");
	ecm_CUresult r = cu.cuMemHostGetDevicePointer(dev, p, 0);
	if (r != ECM_CUDA_SUCCESS) {
		cu.cuMemHostUnregister(p);
		*failed = "cuMemHostGetDevicePointer";
		return r;
	}
	return ECM_CUDA_SUCCESS;
}

ecm_CUresult ecm_cu_host_unregister(void *p) { return cu.cuMemHostUnregister(p); }

ecm_CUresult ecm_cu_copy_dtoh_batch(ecm_CUstream s, ecm_CUevent done, const ecm_host_copy *ops, int n, int *failed_at, const char **failed) {
	ecm_CUresult r = ECM_CUDA_SUCCESS;
	const char *what = NULL;
	*failed_at = -1;
	for (int i = 0; i < n; i++) {
		if (ops[i].after != NULL && (r = cu.cuStreamWaitEvent(s, ops[i].after, 0)) != ECM_CUDA_SUCCESS) {
			what = "cuStreamWaitEvent";
		} else if ((r = cu.cuMemcpyDtoHAsync(ops[i].dst, ops[i].src, ops[i].n, s)) != ECM_CUDA_SUCCESS) {
			what = "cuMemcpyDtoHAsync";
		}
		if (what != NULL) {
			*failed_at = i;
			break;
		}
	}
	/* The copies queued before a failing one still run: they are waited
	 * for, so that no host memory is written after this call returns. */
	ecm_CUresult w = cu.cuEventRecord(done, s);
	if (w == ECM_CUDA_SUCCESS) {
		w = wait_done(done);
	}
	if (w != ECM_CUDA_SUCCESS) {
		*failed_at = -1;
		*failed = "cuEventRecord or cuEventSynchronize";
		return w;
	}
	if (what != NULL) {
		*failed = what;
	}
	return r;
}

ecm_CUresult ecm_cu_copy_htod(ecm_CUstream s, ecm_CUevent done, ecm_CUdeviceptr dst, const void *src, size_t n, const char **failed) {
	TRY(cu.cuMemcpyHtoDAsync(dst, src, n, s), "cuMemcpyHtoDAsync");
	TRY(cu.cuEventRecord(done, s), "cuEventRecord");
	TRY(wait_done(done), "cuEventSynchronize");
	return ECM_CUDA_SUCCESS;
}
