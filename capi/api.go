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
	return marshal(o.stats())
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

// open decodes an object's settings, opens it with them and hands back its
// handle; nothing is opened when the settings are refused.
func open[C any, T closer](k *kind[T], raw []byte, decode func([]byte) (C, error), start func(C) (T, error)) (uint64, error) {
	setup()
	cfg, err := decode(raw)
	if err != nil {
		return 0, err
	}
	v, err := start(cfg)
	if err != nil {
		return 0, err
	}
	return k.add(v), nil
}

// invalidIfRefused makes a decoder's refusal an invalid-argument status, for
// decoders whose errors carry none of their own.
func invalidIfRefused[C any](decode func([]byte) (C, error)) func([]byte) (C, error) {
	return func(raw []byte) (C, error) {
		cfg, err := decode(raw)
		if err != nil {
			return cfg, statusErr(StatusInvalid, "%v", err)
		}
		return cfg, nil
	}
}

// lookupWith returns the object of kind k behind h, and the argument of
// the call named what decoded from raw as an I.
func lookupWith[I any, T closer](k *kind[T], h uint64, what string, raw []byte) (T, I, error) {
	var in I
	o, err := k.get(h)
	if err != nil {
		return o, in, err
	}
	if err := unmarshal(what, raw, &in); err != nil {
		return o, in, err
	}
	return o, in, nil
}

// itemsReply encodes {"items": [...]}, one item a request item, made by
// item from its index and its error text ("" when it succeeded).
func itemsReply[I any](errs []error, item func(i int, errText string) I) ([]byte, error) {
	out := make([]I, len(errs))
	for i, e := range errs {
		var text string
		if e != nil {
			text = e.Error()
		}
		out[i] = item(i, text)
	}
	return marshal(map[string]any{"items": out})
}

type transferIDsIn struct {
	TransferIDs []string `json:"transfer_ids"`
}

// consumer ------------------------------------------------------------------

var consumers = &kind[*node.Consumer]{"consumer", func(c *node.Consumer) any { return c.Stats() }}

// ConsumerOpen opens a consumer shard over the caller's slab.
func ConsumerOpen(raw []byte, mem []byte) (uint64, error) {
	return open(consumers, raw, config.DecodeConsumer, func(cfg config.Consumer) (*node.Consumer, error) {
		return node.OpenConsumer(cfg, mem, node.Options{})
	})
}

// ConsumerInfo returns the shard's endpoints.
func ConsumerInfo(h uint64) ([]byte, error) {
	c, err := consumers.get(h)
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
	c, in, err := lookupWith[hashesIn](consumers, h, "acquire", raw)
	if err != nil {
		return nil, err
	}
	return marshal(map[string]any{"items": c.Acquire(in.MMHashes)})
}

// ConsumerRelease unpins items.
func ConsumerRelease(h uint64, raw []byte) ([]byte, error) {
	c, in, err := lookupWith[hashesIn](consumers, h, "release", raw)
	if err != nil {
		return nil, err
	}
	type item struct {
		MMHash string `json:"mm_hash"`
		Error  string `json:"error,omitempty"`
	}
	return itemsReply(c.Release(in.MMHashes), func(i int, errText string) item { return item{in.MMHashes[i], errText} })
}

// producer ------------------------------------------------------------------

var producers = &kind[*node.Producer]{"producer", func(p *node.Producer) any { return p.Stats() }}

// ProducerOpen opens a producer.
func ProducerOpen(raw []byte) (uint64, error) {
	return open(producers, raw, config.DecodeProducer, func(cfg config.Producer) (*node.Producer, error) {
		return node.OpenProducer(cfg, node.Options{})
	})
}

// ProducerCancel cancels pushes.
func ProducerCancel(h uint64, raw []byte) error {
	p, in, err := lookupWith[transferIDsIn](producers, h, "cancel", raw)
	if err != nil {
		return err
	}
	p.Cancel(in.TransferIDs)
	return nil
}

// ProducerPoll returns outcomes since the last poll.
func ProducerPoll(h uint64, timeoutMs int32) ([]byte, error) {
	p, err := producers.get(h)
	if err != nil {
		return nil, err
	}
	return marshal(p.Poll(time.Duration(max(timeoutMs, 0)) * time.Millisecond))
}

// scheduler -----------------------------------------------------------------

var schedulers = &kind[*scheduler.Scheduler]{"scheduler", func(s *scheduler.Scheduler) any { return s.Stats() }}

// SchedulerOpen opens a consumer scheduler.
func SchedulerOpen(raw []byte) (uint64, error) {
	return open(schedulers, raw, config.DecodeScheduler, func(cfg config.Scheduler) (*scheduler.Scheduler, error) {
		return node.OpenScheduler(cfg, node.Options{})
	})
}

// SchedulerStep applies one scheduler step.
func SchedulerStep(h uint64, raw []byte) ([]byte, error) {
	s, in, err := lookupWith[scheduler.StepIn](schedulers, h, "step", raw)
	if err != nil {
		return nil, err
	}
	return marshal(s.Step(in))
}

// SchedulerHas answers has_cache_item.
func SchedulerHas(h uint64, mmHash string) (bool, error) {
	s, err := schedulers.get(h)
	if err != nil {
		return false, err
	}
	return s.Has(mmHash), nil
}

// SchedulerPoll applies the same-host shards' events that have arrived,
// on the calling thread, and returns how many.
func SchedulerPoll(h uint64) (int, error) {
	s, err := schedulers.get(h)
	if err != nil {
		return 0, err
	}
	return s.Poll(), nil
}

// SchedulerWatch makes the scheduler store its generation into *counter
// whenever its table changes, until it is closed.
func SchedulerWatch(h uint64, counter *uint64) error {
	s, err := schedulers.get(h)
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
	s, in, err := lookupWith[transferIDsIn](schedulers, h, "wait", raw)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(max(timeoutMs, 0))*time.Millisecond)
	defer cancel()
	return marshal(s.Wait(ctx, in.TransferIDs))
}
