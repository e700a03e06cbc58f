package capi

import (
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/consumer"
	"github.com/ecmooncake/ecmooncake/core/cuda"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/producer"
	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/cudaipc"
	"github.com/ecmooncake/ecmooncake/core/transport/route"
	"github.com/ecmooncake/ecmooncake/core/transport/staged"
)

// devices is this process's GPUs: the CUDA driver, opened on first use,
// or a Devices that says why there are none.
func devices() gpu.Devices {
	drv, err := cuda.Default()
	if err != nil {
		return gpu.Unavailable{Err: err}
	}
	return drv
}

// device opens one GPU, mapping "no GPU here" to StatusUnavailable.
func device(what string, ordinal int) (gpu.Device, error) {
	dev, err := devices().Device(ordinal)
	if err != nil {
		return nil, statusErr(StatusUnavailable, "%s on %s: %v", what, gpu.Name(ordinal), err)
	}
	return dev, nil
}

// GPUInfo says whether this process can use GPU memory, and if not why.
func GPUInfo() ([]byte, error) {
	setup()
	out := struct {
		Available     bool   `json:"available"`
		Reason        string `json:"reason,omitempty"`
		DriverVersion int    `json:"driver_version,omitempty"`
		Devices       int    `json:"devices"`
	}{}
	drv, err := cuda.Default()
	if err != nil {
		out.Reason = err.Error()
	} else {
		out.Available, out.DriverVersion, out.Devices = true, drv.Version(), drv.Count()
	}
	return marshal(out)
}

// hostIdentity is what a producer compares with a shard's reported host;
// it matches the consumer's default (the hostname).
func hostIdentity(configured string) string {
	if configured != "" {
		return configured
	}
	if h, err := os.Hostname(); err == nil {
		return h
	}
	return "unknown"
}

// ConsumerOpenDevice opens a consumer shard over a receive slab in GPU
// memory: [addr, addr+n) on the device of ordinal. The shard offers the
// configured network transport (TCP staged through page-locked memory) and
// cuda_ipc for producers on the same host.
func ConsumerOpenDevice(raw []byte, addr uintptr, n uint64, ordinal int) (uint64, error) {
	setup()
	cfg, err := config.DecodeConsumer(raw)
	if err != nil {
		return 0, err
	}
	if ordinal < 0 {
		return 0, statusErr(StatusInvalid, "consumer: device %d is not a GPU ordinal (host slabs go through ecm_consumer_open)", ordinal)
	}
	if addr == 0 || n == 0 {
		return 0, statusErr(StatusInvalid, "consumer: slab is empty (pointer and nbytes must describe the receive buffer)")
	}
	dev, err := device("consumer: receive slab", ordinal)
	if err != nil {
		return 0, err
	}
	if err := dev.CheckDevice(addr, n); err != nil {
		return 0, statusErr(StatusInvalid, "consumer: receive slab of %d bytes at %#x: %v", n, addr, err)
	}
	mem := slab.DeviceMemory(addr, n, dev.Name())
	network, err := consumerTransport(cfg)
	if err != nil {
		return 0, err
	}
	tr := network
	if network.Name() == "tcp" {
		// TCP reaches the slab through page-locked staging; producers on
		// this host may use cuda_ipc instead. A one-sided network transport
		// (mooncake) registers the slab itself and is offered alone.
		tr = route.New(route.Config{
			Network: staged.New(staged.Config{Inner: network, Slab: mem, SlabDevice: dev, StagingBytes: cfg.Staging(), Logger: slog.Default()}),
			Local:   cudaipc.New(cudaipc.Config{Slab: mem, SlabDevice: dev, Logger: slog.Default()}),
			Host:    hostIdentity(cfg.Host), Logger: slog.Default(),
		})
	}
	meta, err := startMetadata(cfg)
	if err != nil {
		return 0, err
	}
	s, err := consumer.Open(cfg, mem, consumer.Options{Transport: tr, Log: slog.Default()})
	if err != nil {
		if meta != nil {
			meta.Close()
		}
		return 0, err
	}
	return handles.add(&consumerObj{Shard: s, meta: meta}), nil
}

// producerTransport is the producer's data plane: the configured network
// transport (TCP stages GPU sources through page-locked memory), and
// cuda_ipc to shards on this host when this process has a GPU.
func producerTransport(cfg config.Producer) (transport.Transport, error) {
	network, err := newTransport(cfg.Transport, cfg)
	if err != nil {
		return nil, err
	}
	devs := devices()
	if network.Name() == "tcp" {
		network = staged.New(staged.Config{Inner: network, Devices: devs, StagingBytes: cfg.Staging(), ChunkBytes: cfg.TCPChunkBytes, Logger: slog.Default()})
	}
	rc := route.Config{Network: network, Host: hostIdentity(cfg.Host), Overrides: cfg.TransportOverrides, Logger: slog.Default()}
	switch _, err := cuda.Default(); {
	case cfg.Local() == "":
		rc.LocalOff = "local_transport is none"
	case err != nil:
		rc.LocalOff = fmt.Sprintf("%s is unavailable: %v", cfg.Local(), err)
	default:
		rc.Local = cudaipc.New(cudaipc.Config{Devices: devs, DialTimeout: cfg.ControlTimeout(), Logger: slog.Default()})
	}
	return route.New(rc), nil
}

// DeviceSource is one encoder output handed over with its device: host
// memory in Mem when Ordinal is negative, else N bytes of GPU memory at
// Addr, produced by work queued on Stream (a CUDA stream handle of this
// process; 0 is the legacy default stream).
type DeviceSource struct {
	MMHash  string
	Mem     []byte
	Addr    uintptr
	N       uint64
	Ordinal int
	Stream  uintptr
}

// ProducerSourcesDevice hands over encoder outputs that may live on a GPU.
// For the GPU sources of each stream one event is recorded on that stream
// now, so that the library reads their bytes only after the work queued
// there so far has completed, without the caller waiting for it.
func ProducerSourcesDevice(h uint64, srcs []DeviceSource) ([]uint64, error) {
	ids := make([]uint64, len(srcs))
	p, err := lookup[*producerObj](h, "producer")
	if err != nil {
		return ids, err
	}
	ready, bad, unavailable := readyEvents(srcs)
	var in []producer.Source
	var at []int // index in srcs of each entry of in
	for i, s := range srcs {
		switch {
		case s.Ordinal < 0:
			in, at = append(in, producer.Source{MMHash: s.MMHash, Mem: s.Mem}), append(at, i)
		case ready[i] != nil:
			dev := &transport.DeviceSrc{Addr: s.Addr, Len: s.N, Ordinal: s.Ordinal, Ready: ready[i]}
			in, at = append(in, producer.Source{MMHash: s.MMHash, Dev: dev}), append(at, i)
		}
	}
	got, errs := p.Sources(in)
	for j, i := range at {
		ids[i] = uint64(got[j])
		if errs[j] != nil {
			bad = append(bad, fmt.Errorf("item %d (%s): %w", i, srcs[i].MMHash, errs[j]))
			if ready[i] != nil {
				_ = ready[i].Close()
			}
		}
	}
	if len(bad) > 0 {
		code := StatusInvalid
		if unavailable == len(bad) {
			code = StatusUnavailable
		}
		return ids, statusErr(code, "%d of %d sources refused: %v", len(bad), len(srcs), errors.Join(bad...))
	}
	return ids, nil
}

// readyEvents checks every GPU source and records one event per (device,
// stream), shared by that stream's sources: ready[i] is source i's handle,
// nil for host sources and refused ones, which bad describes (unavailable
// of them for want of a GPU).
func readyEvents(srcs []DeviceSource) (ready []gpu.Event, bad []error, unavailable int) {
	type stream struct {
		ordinal int
		handle  uintptr
	}
	ready = make([]gpu.Event, len(srcs))
	groups := map[stream][]int{}
	var order []stream
	refuse := func(i int, err error) {
		if errors.Is(err, gpu.ErrUnavailable) {
			unavailable++
		}
		bad = append(bad, fmt.Errorf("item %d (%s): %w", i, srcs[i].MMHash, err))
	}
	for i, s := range srcs {
		if s.Ordinal < 0 {
			continue
		}
		dev, err := devices().Device(s.Ordinal)
		if err == nil && (s.Addr == 0 || s.N == 0) {
			err = fmt.Errorf("empty source on %s", dev.Name())
		}
		if err == nil {
			err = dev.CheckDevice(s.Addr, s.N)
		}
		if err != nil {
			refuse(i, err)
			continue
		}
		k := stream{s.Ordinal, s.Stream}
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], i)
	}
	for _, k := range order {
		idx := groups[k]
		dev, err := devices().Device(k.ordinal)
		var ev gpu.Event
		if err == nil {
			ev, err = dev.RecordEvent(k.handle)
		}
		if err != nil {
			for _, i := range idx {
				refuse(i, err)
			}
			continue
		}
		for j, handle := range gpu.Share(ev, len(idx)) {
			ready[idx[j]] = handle
		}
	}
	return ready, bad, unavailable
}
