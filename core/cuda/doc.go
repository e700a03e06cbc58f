// Package cuda is the real gpu.Device: the CUDA driver API, opened with
// dlopen("libcuda.so.1") at run time, so that building needs no CUDA
// toolkit and a host without a driver still runs everything else. There,
// Open fails with an error that wraps gpu.ErrUnavailable and says why.
//
// It covers what the transports need and nothing more: primary contexts,
// streams, events, copies, pointer attributes, page-locked host memory,
// IPC memory handles, and words a stream stores into registered host
// memory after a batch's copies.
//
// # Threads and contexts
//
// A CUDA context is current per OS thread, and goroutines move between
// threads; so every driver call runs inside Device.with, which locks the
// goroutine to its thread and makes the device's primary context current
// there first. The primary context is the one PyTorch uses too, so events
// recorded on PyTorch's streams and memory it allocated are valid here.
//
// # Copies
//
// Each device has two non-blocking streams of its own, one per direction
// of PCIe traffic, so a device-to-host copy never queues behind a
// host-to-device one. A copy is queued behind the events it must follow
// (cuStreamWaitEvent: the GPU waits, no thread does), then an event is
// recorded and waited for, all inside one C call: host memory is touched
// only while that call runs, which is what cgo's pointer rules ask. The
// wait polls the event for a few hundred microseconds, then sleeps: a
// sleeping thread wakes long after a short copy has ended, and a long copy
// should not keep spinning a core that PyTorch wants.
//
// A batch of device-to-device copies (CopyDeviceTimed) queues every
// source's wait first, then runs its copies between two timing events, so
// that its caller learns the GPU's own time apart from the host's wait
// (gpu.CopyTiming); cuEventElapsedTime is resolved if the driver has it,
// and its absence only leaves the GPU time unknown. It touches no host
// memory, so it is queued and waited for in two C calls: batches of
// concurrent writers queue one after the other (a mutex held only while
// queueing), and then each waits for its own event.
//
// # Recorded events
//
// RecordEvent records an event on a caller's stream (an encoder's output
// is read only after it). A closed one goes back to its device and is
// recorded again by a later RecordEvent instead of a new cuEventCreate:
// re-recording overwrites what the event captured, and no one waits on a
// closed event (a stream that waited took its state when the wait was
// queued). A device keeps at most maxRecorded closed events; one closed
// past that is destroyed.
//
// # Ready words
//
// QueueCopyThen (gpu.ValueWriter) queues, after a batch's copies and
// before its done event, one cuStreamWriteValue64 per word (flags 0, so a
// memory barrier orders the copies' bytes before the word) into host
// memory registered with RegisterHost: cuMemHostRegister with DEVICEMAP in
// the device's context, then cuMemHostGetDevicePointer, undone by
// cuMemHostUnregister. cuda_ipc's producer uses it to tell the shard that
// the copies landed. It returns once the batch is queued; the host's wait
// for its done event is the returned Pending's (CopyDeviceThen does both),
// so that the thread that queued it need not be the one that waits. Every one of these symbols is optional: the _v2
// entry points where the driver has them; the v1 cuStreamWriteValue64
// only on a device whose CAN_USE_STREAM_MEM_OPS_V1 and
// CAN_USE_64_BIT_STREAM_MEM_OPS_V1 attributes are set. Without them
// RegisterHost fails, touching nothing, and cuda_ipc completes by message.
//
// Devices, their contexts and streams live for the life of the process:
// a library loaded into a vLLM worker never unloads.
package cuda
