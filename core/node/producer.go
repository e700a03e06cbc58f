package node

import (
	"errors"
	"fmt"
	"slices"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/fsm/push"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/producer"
	"github.com/ecmooncake/ecmooncake/core/trace"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/cudaipc"
	"github.com/ecmooncake/ecmooncake/core/transport/mooncake"
	"github.com/ecmooncake/ecmooncake/core/transport/route"
	"github.com/ecmooncake/ecmooncake/core/transport/shm"
	"github.com/ecmooncake/ecmooncake/core/transport/staged"
	"github.com/ecmooncake/ecmooncake/core/transport/tcp"
)

// Producer is a producer and the GPUs its sources may live on.
type Producer struct {
	*producer.Producer
	devs gpu.Devices
}

// OpenProducer opens a producer whose data plane is the configured network
// transport (TCP stages GPU sources through page-locked memory), routed
// per shard: cuda_ipc to shards on this host when this process has a GPU.
func OpenProducer(cfg config.Producer, opt Options) (*Producer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	tr, devs, err := producerTransport(cfg, opt)
	if err != nil {
		return nil, err
	}
	p, err := producer.Open(cfg, producer.Options{Transport: tr, Log: opt.log(), Links: opt.links()})
	if err != nil {
		return nil, err
	}
	return &Producer{Producer: p, devs: devs}, nil
}

func producerTransport(cfg config.Producer, opt Options) (transport.Transport, gpu.Devices, error) {
	log := opt.log()
	devs, gpuErr := opt.devices()
	network, err := producerNetwork(cfg, opt, devs)
	if err != nil {
		return nil, nil, err
	}
	if stage, chunk := hostOnly(network, cfg); stage {
		network = staged.New(staged.Config{Inner: network, Devices: devs, StagingBytes: cfg.Staging(), ChunkBytes: chunk, Logger: log})
	}
	rc := route.Config{Network: network, Host: ids.HostIdentity(cfg.Host), Overrides: cfg.TransportOverrides, Logger: log}
	switch {
	case cfg.Local() == "":
		rc.LocalOff = "local_transport is none"
	case gpuErr != nil:
		rc.LocalOff = fmt.Sprintf("%s is unavailable: %v", cfg.Local(), gpuErr)
	default:
		rc.Local = cudaipc.New(cudaipc.Config{Devices: devs, DialTimeout: cfg.ControlTimeout(), Logger: log})
	}
	return route.New(rc), devs, nil
}

// hostOnly reports whether network reads host memory only, so that its
// device sources stage through page-locked host buffers in the library
// first, in chunks of chunk bytes (0: staged's default): TCP and shm
// always, mooncake when its engine cannot register GPU memory (a CUDA
// build of it stages on the GPU itself).
func hostOnly(network transport.Transport, cfg config.Producer) (stage bool, chunk int) {
	switch network.Name() {
	case "tcp":
		return true, cfg.TCPChunkBytes
	case shm.Name:
		return true, 0
	case mooncake.Name:
		if m, ok := network.(*mooncake.Transport); ok {
			gpuOK, _ := m.RegistersGPU()
			return !gpuOK, int(mooncake.DefaultChunkBytes)
		}
	}
	return false, 0
}

// producerNetwork is the producer's network data plane.
func producerNetwork(cfg config.Producer, opt Options, devs gpu.Devices) (transport.Transport, error) {
	if opt.Network != nil {
		return opt.Network, nil
	}
	log := opt.log()
	switch cfg.Transport {
	case "tcp":
		secret, err := cfg.LoadSecret()
		if err != nil {
			return nil, err
		}
		return tcp.NewTCP(tcp.TCPConfig{Conns: cfg.TCPConns, ChunkSize: cfg.TCPChunkBytes, DialTimeout: cfg.ControlTimeout(),
			Secret: tcp.Secret(secret), Logger: log}), nil
	case mooncake.Name:
		mc := mooncake.FromProducer(cfg, log)
		mc.Devices = devs
		return newMooncake(mc)
	case shm.Name:
		return shm.New(shm.Config{Host: ids.HostIdentity(cfg.Host), Logger: log}), nil
	}
	return nil, unknownTransport(cfg.Transport)
}

// DeviceSource is one encoder output with its device: host memory in Mem
// when Ordinal is negative, else N bytes of GPU memory at Addr, produced
// by work queued on Stream (a CUDA stream handle of this process; 0 is the
// legacy default stream).
type DeviceSource struct {
	MMHash  string
	Mem     []byte
	Addr    uintptr
	N       uint64
	Ordinal int
	Stream  uintptr
}

// SourcesDevice hands over encoder outputs that may live on a GPU. For the
// GPU sources of each stream one event is recorded on that stream now, so
// that the producer reads their bytes only after the work queued there so
// far has completed, without the caller waiting for it. ids[i] is 0 where
// item i was refused; the error names every refused item, and wraps
// ErrUnavailable when each was refused for want of a GPU.
func (p *Producer) SourcesDevice(srcs []DeviceSource) ([]push.SourceID, error) {
	trace.StampAll(trace.SourcesEntered, srcs, sourceKey)
	ids := make([]push.SourceID, len(srcs))
	var ready []gpu.Event
	var bad []error
	var unavailable int
	// A batch of host memory records no events: its per-stream grouping
	// would cost a map and a slice a call for nothing.
	if slices.ContainsFunc(srcs, func(s DeviceSource) bool { return s.Ordinal >= 0 }) {
		ready, bad, unavailable = p.readyEvents(srcs)
	}
	trace.StampAll(trace.SourcesChecked, srcs, sourceKey)
	in := make([]producer.Source, 0, len(srcs))
	at := make([]int, 0, len(srcs)) // index in srcs of each entry of in
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
		ids[i] = got[j]
		if errs[j] != nil {
			bad = append(bad, fmt.Errorf("item %d (%s): %w", i, srcs[i].MMHash, errs[j]))
			if ready != nil && ready[i] != nil {
				_ = ready[i].Close()
			}
		}
	}
	if len(bad) == 0 {
		return ids, nil
	}
	kind := config.ErrInvalid
	if unavailable == len(bad) {
		kind = ErrUnavailable
	}
	return ids, kindf(kind, "%d of %d sources refused: %v", len(bad), len(srcs), errors.Join(bad...))
}

func sourceKey(s DeviceSource) string { return s.MMHash }

// readyEvents checks every GPU source and records one event per (device,
// stream), shared by that stream's sources: ready[i] is source i's handle,
// nil for host sources and refused ones, which bad describes (unavailable
// of them for want of a GPU).
func (p *Producer) readyEvents(srcs []DeviceSource) (ready []gpu.Event, bad []error, unavailable int) {
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
	// Each device's sources are checked in one call (one crossing into the
	// driver for the batch, not one a source).
	type checks struct {
		dev   gpu.Device
		spans []gpu.Span
		at    []int // index in srcs of each span
	}
	var devices []*checks
	byOrdinal := map[int]*checks{}
	for i, s := range srcs {
		if s.Ordinal < 0 {
			continue
		}
		c := byOrdinal[s.Ordinal]
		if c == nil {
			dev, err := p.devs.Device(s.Ordinal)
			if err != nil {
				refuse(i, err)
				continue
			}
			c = &checks{dev: dev}
			byOrdinal[s.Ordinal] = c
			devices = append(devices, c)
		}
		if s.Addr == 0 || s.N == 0 {
			refuse(i, fmt.Errorf("empty source on %s", c.dev.Name()))
			continue
		}
		c.spans, c.at = append(c.spans, gpu.Span{Addr: s.Addr, N: s.N}), append(c.at, i)
	}
	checked := make([]bool, len(srcs))
	for _, c := range devices {
		for j, err := range c.dev.CheckDevices(c.spans) {
			if err != nil {
				refuse(c.at[j], err)
			} else {
				checked[c.at[j]] = true
			}
		}
	}
	for i, s := range srcs {
		if !checked[i] {
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
		// The device the checks found: a source reaches here only checked.
		ev, err := byOrdinal[k.ordinal].dev.RecordEvent(k.handle)
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
