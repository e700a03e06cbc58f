package node

import (
	"errors"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/consumer"
	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/metadata"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/cudaipc"
	"github.com/ecmooncake/ecmooncake/core/transport/mooncake"
	"github.com/ecmooncake/ecmooncake/core/transport/route"
	"github.com/ecmooncake/ecmooncake/core/transport/shm"
	"github.com/ecmooncake/ecmooncake/core/transport/staged"
	"github.com/ecmooncake/ecmooncake/core/transport/tcp"
)

// Consumer is one consumer shard and what it started for itself: the
// Mooncake metadata store its engine uses, when it serves that store.
type Consumer struct {
	*consumer.Shard
	meta *metadata.Server
}

// Close closes the shard, then the metadata store its engine used.
func (c *Consumer) Close() error {
	err := c.Shard.Close()
	if c.meta != nil {
		err = errors.Join(err, c.meta.Close())
	}
	return err
}

// OpenConsumer opens a consumer shard over mem, a receive slab in host
// memory that the caller owns and keeps until Close returns.
func OpenConsumer(cfg config.Consumer, mem []byte, opt Options) (*Consumer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if len(mem) == 0 {
		return nil, kindf(config.ErrInvalid, "consumer: slab is empty (pointer and nbytes must describe the receive buffer)")
	}
	// The store first: a TransferEngine in HTTP-metadata mode may ask it
	// for its peers as soon as it starts.
	meta, err := startMetadata(cfg, opt)
	if err != nil {
		return nil, err
	}
	tr, err := consumerNetwork(cfg, opt)
	if err != nil {
		closeMeta(meta)
		return nil, err
	}
	return openShard(cfg, slab.HostMemory(mem), tr, meta, opt)
}

// OpenConsumerDevice opens a consumer shard over a receive slab in GPU
// memory: [addr, addr+n) on the device of ordinal. The shard offers the
// configured network transport (TCP staged through page-locked memory) and
// cuda_ipc for producers on the same host.
func OpenConsumerDevice(cfg config.Consumer, addr uintptr, n uint64, ordinal int, opt Options) (*Consumer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if ordinal < 0 {
		return nil, kindf(config.ErrInvalid, "consumer: device %d is not a GPU ordinal (host slabs go through ecm_consumer_open)", ordinal)
	}
	if addr == 0 || n == 0 {
		return nil, kindf(config.ErrInvalid, "consumer: slab is empty (pointer and nbytes must describe the receive buffer)")
	}
	dev, err := device(opt, "consumer: receive slab", ordinal)
	if err != nil {
		return nil, err
	}
	if err := gpu.CheckDevice(dev, addr, n); err != nil {
		return nil, kindf(config.ErrInvalid, "consumer: receive slab of %d bytes at %#x: %v", n, addr, err)
	}
	mem := slab.DeviceMemory(addr, n, dev.Name())
	network, err := consumerNetwork(cfg, opt)
	if err != nil {
		return nil, err
	}
	tr := network
	if network.Name() == "tcp" {
		// TCP reaches the slab through page-locked staging; producers on
		// this host may use cuda_ipc instead. A one-sided network transport
		// (mooncake) registers the slab itself and is offered alone.
		log := opt.log()
		tr = route.New(route.Config{
			Network: staged.New(staged.Config{Inner: network, Slab: mem, SlabDevice: dev, StagingBytes: cfg.Staging(), Logger: log}),
			Local:   cudaipc.New(cudaipc.Config{Slab: mem, SlabDevice: dev, Logger: log}),
			Host:    ids.HostIdentity(cfg.Host), Logger: log,
		})
	}
	meta, err := startMetadata(cfg, opt)
	if err != nil {
		return nil, err
	}
	return openShard(cfg, mem, tr, meta, opt)
}

// openShard starts the shard, which then owns meta.
func openShard(cfg config.Consumer, mem slab.Memory, tr transport.Transport, meta *metadata.Server, opt Options) (*Consumer, error) {
	s, err := consumer.Open(cfg, mem, consumer.Options{Transport: tr, Log: opt.log(), Links: opt.links()})
	if err != nil {
		closeMeta(meta)
		return nil, err
	}
	return &Consumer{Shard: s, meta: meta}, nil
}

func closeMeta(meta *metadata.Server) {
	if meta != nil {
		_ = meta.Close()
	}
}

// consumerNetwork is the network data plane a consumer shard listens on.
func consumerNetwork(cfg config.Consumer, opt Options) (transport.Transport, error) {
	if opt.Network != nil {
		return opt.Network, nil
	}
	log := opt.log()
	switch cfg.Transport {
	case mooncake.Name:
		return newMooncake(mooncake.FromConsumer(cfg, log))
	case shm.Name:
		return shm.New(shm.Config{Host: ids.HostIdentity(cfg.Host), SlabFD: cfg.SlabFD, MaxConns: cfg.MaxDataConns, Logger: log}), nil
	case "tcp":
		// The data plane admits writers holding the same secret as the
		// control plane (or, without one, a live grant).
		secret, err := cfg.LoadSecret()
		if err != nil {
			return nil, err
		}
		return tcp.NewTCP(tcp.TCPConfig{
			MaxConns: cfg.MaxDataConns, IdleTimeout: cfg.DataIdleTimeout(), FrameTimeout: cfg.DataFrameTimeout(),
			HandshakeTimeout: cfg.DataHandshakeTimeout(), Secret: tcp.Secret(secret), Logger: log,
		}), nil
	}
	return nil, unknownTransport(cfg.Transport)
}

// startMetadata serves the Mooncake metadata store a consumer asked for,
// or finds the one another shard of this host already serves there (then
// it returns nil: that shard owns it).
func startMetadata(cfg config.Consumer, opt Options) (*metadata.Server, error) {
	if cfg.MooncakeMetadataServer == "" {
		return nil, nil
	}
	return metadata.Ensure(metadata.Config{Addr: cfg.MooncakeMetadataServer, Token: cfg.MooncakeMetadataToken, Open: cfg.MooncakeMetadataOpen, Logger: opt.log()})
}

// device opens one GPU; "no GPU here" is ErrUnavailable.
func device(opt Options, what string, ordinal int) (gpu.Device, error) {
	devs, _ := opt.devices()
	dev, err := devs.Device(ordinal)
	if err != nil {
		return nil, kindf(ErrUnavailable, "%s on %s: %v", what, gpu.Name(ordinal), err)
	}
	return dev, nil
}
