package capi

import (
	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/node"
)

// GPUInfo says whether this process can use GPU memory, and if not why.
func GPUInfo() ([]byte, error) {
	setup()
	return marshal(node.GPUs())
}

// ConsumerOpenDevice opens a consumer shard over a receive slab in GPU
// memory: [addr, addr+n) on the device of ordinal.
func ConsumerOpenDevice(raw []byte, addr uintptr, n uint64, ordinal int) (uint64, error) {
	return open(consumers, raw, config.DecodeConsumer, func(cfg config.Consumer) (*node.Consumer, error) {
		return node.OpenConsumerDevice(cfg, addr, n, ordinal, node.Options{})
	})
}

// DeviceSource is one encoder output handed over with its device
// (node.DeviceSource).
type DeviceSource = node.DeviceSource

// ProducerSourcesDevice hands over encoder outputs that may live on a GPU;
// ids[i] is 0 where item i was refused, and the error names every refused
// item.
func ProducerSourcesDevice(h uint64, srcs []DeviceSource) ([]uint64, error) {
	ids := make([]uint64, len(srcs))
	p, err := producers.get(h)
	if err != nil {
		return ids, err
	}
	got, err := p.SourcesDevice(srcs)
	for i, id := range got {
		ids[i] = uint64(id)
	}
	return ids, err
}
