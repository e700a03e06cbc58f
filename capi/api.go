package capi

import (
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/node"
	"github.com/ecmooncake/ecmooncake/core/producer"
	"github.com/ecmooncake/ecmooncake/core/scheduler"
)

var (
	logLevel  = new(slog.LevelVar)
	setupOnce sync.Once
)

// setup installs the defaults once: a small GOMAXPROCS so that many vLLM
// processes, each with this runtime inside, do not fight PyTorch for
// cores, and a stderr logger. No signal handlers: signals belong to Python.
func setup() {
	setupOnce.Do(func() {
		def := config.DefaultRuntime()
		if os.Getenv("GOMAXPROCS") == "" {
			runtime.GOMAXPROCS(def.GOMAXPROCS)
		}
		logLevel.Set(slog.LevelInfo)
		slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: logLevel})).With("lib", "ecmooncake"))
	})
}

// Configure applies process-wide settings.
func Configure(raw []byte) error {
	setup()
	r, err := config.DecodeRuntime(raw)
	if err != nil {
		return err
	}
	runtime.GOMAXPROCS(r.GOMAXPROCS)
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(r.LogLevel)); err != nil {
		return statusErr(StatusInvalid, "log_level %q: %v", r.LogLevel, err)
	}
	logLevel.Set(lv)
	return node.ServeMetrics(r, slog.Default())
}

// Stats returns the counters of any object as JSON.
func Stats(h uint64) ([]byte, error) {
	o, err := handles.get(h)
	if err != nil {
		return nil, err
	}
	return marshal(o.(interface{ stats() any }).stats())
}

// Close closes any object.
func Close(h uint64) error {
	o, err := handles.remove(h)
	if err != nil {
		return err
	}
	return o.Close()
}

func marshal(v any) ([]byte, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, statusErr(StatusInternal, "encode reply: %v", err)
	}
	return b, nil
}

func unmarshal(what string, raw []byte, into any) error {
	if err := json.Unmarshal(raw, into); err != nil {
		return statusErr(StatusInvalid, "%s: %v", what, err)
	}
	return nil
}

// consumer ------------------------------------------------------------------

type consumerObj struct{ *node.Consumer }

func (o *consumerObj) stats() any { return o.Stats() }

// ConsumerOpen opens a consumer shard over the caller's slab.
func ConsumerOpen(raw []byte, mem []byte) (uint64, error) {
	setup()
	cfg, err := config.DecodeConsumer(raw)
	if err != nil {
		return 0, err
	}
	c, err := node.OpenConsumer(cfg, mem, node.Options{})
	if err != nil {
		return 0, err
	}
	return handles.add(&consumerObj{c}), nil
}

// ConsumerInfo returns the shard's endpoints.
func ConsumerInfo(h uint64) ([]byte, error) {
	c, err := lookup[*consumerObj](h, "consumer")
	if err != nil {
		return nil, err
	}
	return marshal(c.Info())
}

type hashesIn struct {
	MMHashes []string `json:"mm_hashes"`
}

// ConsumerAcquire pins ready items.
func ConsumerAcquire(h uint64, raw []byte) ([]byte, error) {
	c, err := lookup[*consumerObj](h, "consumer")
	if err != nil {
		return nil, err
	}
	var in hashesIn
	if err := unmarshal("acquire", raw, &in); err != nil {
		return nil, err
	}
	return marshal(map[string]any{"items": c.Acquire(in.MMHashes)})
}

// ConsumerRelease unpins items.
func ConsumerRelease(h uint64, raw []byte) ([]byte, error) {
	c, err := lookup[*consumerObj](h, "consumer")
	if err != nil {
		return nil, err
	}
	var in hashesIn
	if err := unmarshal("release", raw, &in); err != nil {
		return nil, err
	}
	type item struct {
		MMHash string `json:"mm_hash"`
		Error  string `json:"error,omitempty"`
	}
	errs := c.Release(in.MMHashes)
	out := make([]item, len(errs))
	for i, e := range errs {
		out[i].MMHash = in.MMHashes[i]
		if e != nil {
			out[i].Error = e.Error()
		}
	}
	return marshal(map[string]any{"items": out})
}

// producer ------------------------------------------------------------------

type producerObj struct{ *node.Producer }

func (o *producerObj) stats() any { return o.Stats() }

// ProducerOpen opens a producer.
func ProducerOpen(raw []byte) (uint64, error) {
	setup()
	cfg, err := config.DecodeProducer(raw)
	if err != nil {
		return 0, err
	}
	p, err := node.OpenProducer(cfg, node.Options{})
	if err != nil {
		return 0, err
	}
	return handles.add(&producerObj{p}), nil
}

// ProducerSubmit announces pushes.
func ProducerSubmit(h uint64, raw []byte) ([]byte, error) {
	p, err := lookup[*producerObj](h, "producer")
	if err != nil {
		return nil, err
	}
	var in struct {
		Pushes []producer.Push `json:"pushes"`
	}
	if err := unmarshal("submit", raw, &in); err != nil {
		return nil, err
	}
	type item struct {
		TransferID string `json:"transfer_id"`
		Error      string `json:"error,omitempty"`
	}
	errs := p.Submit(in.Pushes)
	out := make([]item, len(errs))
	for i, e := range errs {
		out[i].TransferID = in.Pushes[i].TransferID
		if e != nil {
			out[i].Error = e.Error()
		}
	}
	return marshal(map[string]any{"items": out})
}

// ProducerCancel cancels pushes.
func ProducerCancel(h uint64, raw []byte) error {
	p, err := lookup[*producerObj](h, "producer")
	if err != nil {
		return err
	}
	var in struct {
		TransferIDs []string `json:"transfer_ids"`
	}
	if err := unmarshal("cancel", raw, &in); err != nil {
		return err
	}
	p.Cancel(in.TransferIDs)
	return nil
}

// ProducerPoll returns outcomes since the last poll.
func ProducerPoll(h uint64, timeoutMs int32) ([]byte, error) {
	p, err := lookup[*producerObj](h, "producer")
	if err != nil {
		return nil, err
	}
	return marshal(p.Poll(time.Duration(max(timeoutMs, 0)) * time.Millisecond))
}

// scheduler -----------------------------------------------------------------

type schedulerObj struct{ *scheduler.Scheduler }

func (o *schedulerObj) stats() any { return o.Stats() }

// SchedulerOpen opens a consumer scheduler.
func SchedulerOpen(raw []byte) (uint64, error) {
	setup()
	cfg, err := config.DecodeScheduler(raw)
	if err != nil {
		return 0, err
	}
	s, err := node.OpenScheduler(cfg, node.Options{})
	if err != nil {
		return 0, err
	}
	return handles.add(&schedulerObj{s}), nil
}

// SchedulerStep applies one scheduler step.
func SchedulerStep(h uint64, raw []byte) ([]byte, error) {
	s, err := lookup[*schedulerObj](h, "scheduler")
	if err != nil {
		return nil, err
	}
	var in scheduler.StepIn
	if err := unmarshal("step", raw, &in); err != nil {
		return nil, err
	}
	return marshal(s.Step(in))
}

// SchedulerHas answers has_cache_item.
func SchedulerHas(h uint64, mmHash string) (bool, error) {
	s, err := lookup[*schedulerObj](h, "scheduler")
	if err != nil {
		return false, err
	}
	return s.Has(mmHash), nil
}

// SchedulerWatch makes the scheduler store its generation into *counter
// whenever its table changes, until it is closed.
func SchedulerWatch(h uint64, counter *uint64) error {
	s, err := lookup[*schedulerObj](h, "scheduler")
	if err != nil {
		return err
	}
	if uintptr(unsafe.Pointer(counter))%8 != 0 {
		return statusErr(StatusInvalid, "ecm_scheduler_watch: counter at %p is not 8-byte aligned", counter)
	}
	s.Watch(counter)
	return nil
}

// SchedulerWait blocks until the transfers are decided or the timeout.
func SchedulerWait(h uint64, raw []byte, timeoutMs int32) ([]byte, error) {
	s, err := lookup[*schedulerObj](h, "scheduler")
	if err != nil {
		return nil, err
	}
	var in struct {
		TransferIDs []string `json:"transfer_ids"`
	}
	if err := unmarshal("wait", raw, &in); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(max(timeoutMs, 0))*time.Millisecond)
	defer cancel()
	return marshal(s.Wait(ctx, in.TransferIDs))
}
