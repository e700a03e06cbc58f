package gotests

import (
	"bytes"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/fsm/reserve"
	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/node"
	"github.com/ecmooncake/ecmooncake/core/producer"
	"github.com/ecmooncake/ecmooncake/core/scheduler"
)

// The soak's size is set from the command line or the environment, so
// that CI runs the short default and a longer run needs no code change:
//
//	go test -run TestSoak ./tests/go/ -soak.n=20000 -soak.max=4194304
//	ECM_SOAK_N=20000 go test -run TestSoak ./tests/go/
var (
	soakN       = flag.Int("soak.n", envInt("ECM_SOAK_N", 2000), "requests the soak drives (env ECM_SOAK_N)")
	soakMax     = flag.Int("soak.max", envInt("ECM_SOAK_MAX", 256<<10), "largest item in bytes; the smallest is 4 KiB (env ECM_SOAK_MAX)")
	soakSqueeze = flag.Float64("soak.squeeze", 1, "divides the slab, sized for every distinct byte of the run, by this (evictions above 1)")
	soakShm     = flag.Bool("soak.shm", os.Getenv("ECM_SOAK_SHM") != "", "over the shm data plane (env ECM_SOAK_SHM)")
	soakCredit  = flag.Bool("soak.credit", os.Getenv("ECM_SOAK_CREDIT") != "", "over shm with the standing credit on at both ends (env ECM_SOAK_CREDIT)")
	soakSeed    = flag.Uint64("soak.seed", uint64(envInt("ECM_SOAK_SEED", 0)), "seed of the soak's choices; 0 picks one and logs it (env ECM_SOAK_SEED)")
)

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// A long stream of requests through the real producer → shards →
// scheduler path, driven as vLLM's connector drives it: the proxy mints
// transfer ids and sends each image to the encoder (the producer's pushes
// and sources), the consumer's engine registers and ensures each request,
// loads what has_cache_item offers on every TP shard, holds it in its
// encoder cache while requests use it, frees it afterwards, and finishes
// every request. Images repeat across requests in flight; requests abort at
// every stage; a shard restarts half way. Requests that fail retryably are
// retried once with fresh transfer ids, as the proxy would.
//
// Afterwards nothing may be left behind that no lease or deadline would
// end: no request or record in flight in the scheduler's table, no region
// being written or pinned on any shard, slab bytes in use equal to the
// resident copies' bytes, and every item the scheduler still offers
// loadable, bit-exact, from every shard.
func TestSoak(t *testing.T) {
	seed := *soakSeed
	if seed == 0 {
		seed = rand.Uint64()
	}
	n := *soakN
	if testing.Short() {
		n = min(n, 300)
	}
	cfg := soakConfig{
		requests: n, minBytes: 4 << 10, maxBytes: max(*soakMax, 8<<10),
		live: 32, repeat: 0.3, window: 24,
		// Short waits so that what a lease legitimately holds (a copy
		// pushed for a request the consumer never saw) is back within
		// seconds. The lease must outlast the push wait, as lease_s (300 s)
		// outlasts push_wait_timeout_s (60 s) by default: a region is
		// reserved before the encoder runs and the producer waits up to the
		// push wait for its output, and a ready copy waits for a request's
		// other items for as long. A lease shorter than that fails requests
		// that nothing went wrong for.
		lease: 10 * time.Second, pushWait: 5 * time.Second,
	}
	// By default the slab holds every distinct byte the run pushes, so no
	// resident copy is evicted; -soak.squeeze=4 gives it a quarter of that,
	// so that evictions go on throughout (see TestEvictedResidentCopyIsNotOffered).
	mean := float64(cfg.maxBytes-cfg.minBytes) / math.Log(float64(cfg.maxBytes)/float64(cfg.minBytes))
	slabBytes := int(float64(cfg.requests)*1.6*mean/max(*soakSqueeze, 1)) &^ 4095
	slabBytes = max(slabBytes, 4*cfg.maxBytes, 8<<20)
	t.Logf("soak: seed %d, %d requests, items %d B to %d B, slab %d MiB per shard (-soak.seed=%d repeats this run)",
		seed, cfg.requests, cfg.minBytes, cfg.maxBytes, slabBytes>>20, seed)

	o := clusterOpts{tp: 2, slabBytes: slabBytes, lease: cfg.lease, pushWait: cfg.pushWait, quiet: true}
	o.shm = *soakShm || *soakCredit // the standing credit rides only the one-sided planes
	if *soakCredit {
		o.credit = uint64(slabBytes / 8)
	}
	c := newCluster(t, o)
	s := newSoak(t, c, cfg, seed)
	start := time.Now()
	s.run()
	s.settle()
	s.report(time.Since(start))
	s.checkEnd()
	if n := len(s.fig.details); n > 0 {
		t.Errorf("soak: %d attempts failed that no injected fault touched (by reason %v); each is logged above as unexplained", n, s.fig.unexplained)
	}
}

type soakConfig struct {
	requests           int
	minBytes, maxBytes int
	live               int     // requests in flight at most
	repeat             float64 // share of items that show an image already seen
	window             int     // repeats pick among this many most recent images
	lease, pushWait    time.Duration
}

// abortPlan is how a request ends when it is not allowed to complete.
type abortPlan uint8

const (
	planComplete        abortPlan = iota
	planAbortWaiting              // the client goes away while the items are on their way
	planAbortBeforeLoad           // it goes away once they are there, before they are loaded
	planUnseen                    // the proxy aborts after encoding: the consumer never sees it
	planEncoderAborted            // the encoder request is aborted before its outputs exist
	planOutputLost                // the encoder never hands over its outputs: the pushes time out
	numPlans
)

var planNames = [numPlans]string{"complete", "abort_waiting", "abort_before_load", "unseen", "encoder_aborted", "output_lost"}

func (p abortPlan) String() string { return planNames[p] }

// pickPlan draws a plan: most requests complete, a fifth end early in one
// of the ways a deployment sees.
func pickPlan(rng *rand.Rand) abortPlan {
	switch x := rng.Float64(); {
	case x < 0.06:
		return planAbortWaiting
	case x < 0.12:
		return planAbortBeforeLoad
	case x < 0.16:
		return planUnseen
	case x < 0.19:
		return planEncoderAborted
	case x < 0.20:
		return planOutputLost
	}
	return planComplete
}

type soakImage struct {
	hash string
	data []byte
	uses int // live requests showing it
}

// reqState is where one request stands in the consumer's engine.
type reqState uint8

const (
	reqPending reqState = iota // sent to the encoder; the consumer has not seen it yet
	reqWaiting                 // registered; ensure_cache_available says not yet
	reqLoading                 // scheduled; its items are being loaded
	reqRunning                 // every item in the encoder cache
)

type soakReq struct {
	id      string
	base    int // index of the client's request; a retry keeps it
	attempt int
	plan    abortPlan
	images  []*soakImage
	tids    []string

	state      reqState
	registered bool // Expect went to the scheduler
	sourced    bool
	admitted   time.Time
	expectAt   int // step at which the consumer sees it
	sourceAt   int // step at which the encoder's outputs exist
	abortAt    int // planAbortWaiting: step at which the client goes away
	runUntil   int
	have       map[string]bool // images in the encoder cache for it
	startStep  int
	outcome    string
	// faults names the injected faults that touched this attempt: a
	// failure of it is theirs, not ours.
	faults []string
	// sinceRestart is how long after the shard restart the attempt
	// started, for one that started inside restartWindow.
	sinceRestart time.Duration
}

// cacheEntry is one mm_hash in the engine's encoder cache: pinned on the
// shard incarnations that were loaded from, used by users.
type cacheEntry struct {
	pinned []*node.Consumer
	users  map[string]bool
}

// soakFigures is what the run counts.
type soakFigures struct {
	admitted, retries, completed, aborted, failedFinal int
	byPlan                                             [numPlans]int
	failures                                           map[string]int // attempt failures, by reason class
	failureSample                                      map[string]string
	sharedInFlight, repeats, items, loads, served      int
	loadedBytes                                        uint64
	restarts, steps                                    int
	restartedAt                                        time.Time
	// lateLoadFailures are loads that failed on a shard more than a
	// second after the restart, when the scheduler had long seen it.
	lateLoadFailures []string
	// lastRestartFailure is, of the attempts that started after the
	// restart and failed with the restart as their fault, the latest
	// start (time after the restart): how close to restartWindow's edge
	// the restart still costs requests.
	lastRestartFailure time.Duration
	loadFailures       map[string]int
	neverExpected      int // every image was in the encoder cache already
	// Attempt failures split by cause: an injected fault that touched the
	// attempt, or none (unexplained: our own bug, which fails the soak).
	byFault     map[string]map[string]int
	unexplained map[string]int
	details     []string // one line per unexplained failure, for the log
}

type soak struct {
	t    *testing.T
	c    *cluster
	cfg  soakConfig
	rng  *rand.Rand
	step int

	next   int // base index of the next client request
	images []*soakImage
	byHash map[string]*soakImage
	live   map[string]*soakReq
	cache  map[string]*cacheEntry
	// plans are loads decided from this step's ensure answers, made with
	// the next step: mm_hash → requests waiting for it.
	plans map[string]map[string]bool
	// Carried into the next step, as the connector's build does.
	reports  []scheduler.LoadedIn
	freed    []string
	finished []string

	fig soakFigures

	prodMu    sync.Mutex
	prodDone  int
	prodFail  map[string]int
	prodEg    map[string]string
	prodByTID map[string][]string // producer failures of each transfer, "dest: reason"

	byTID    map[string]*soakReq
	hashTIDs map[string][]string // every transfer id pushed for an mm_hash, in order
	t0       time.Time
	stopPoll chan struct{}
	polled   chan struct{}
}

func newSoak(t *testing.T, c *cluster, cfg soakConfig, seed uint64) *soak {
	s := &soak{
		t: t, c: c, cfg: cfg, rng: rand.New(rand.NewPCG(seed, seed^0x5ca1ab1e)),
		byHash: map[string]*soakImage{}, live: map[string]*soakReq{}, cache: map[string]*cacheEntry{},
		plans:    map[string]map[string]bool{},
		prodFail: map[string]int{}, prodEg: map[string]string{}, prodByTID: map[string][]string{},
		byTID: map[string]*soakReq{}, hashTIDs: map[string][]string{}, t0: time.Now(),
		stopPoll: make(chan struct{}), polled: make(chan struct{}),
	}
	s.fig.failures, s.fig.failureSample, s.fig.loadFailures = map[string]int{}, map[string]string{}, map[string]int{}
	s.fig.byFault, s.fig.unexplained = map[string]map[string]int{}, map[string]int{}
	go s.pollProducer()
	return s
}

// pollProducer takes the producer's outcomes, as the encoder's connector
// does each step; the soak only counts them.
func (s *soak) pollProducer() {
	defer close(s.polled)
	for {
		select {
		case <-s.stopPoll:
			return
		default:
		}
		o := s.c.prod.Poll(50 * time.Millisecond)
		s.prodMu.Lock()
		s.prodDone += len(o.Done)
		for _, f := range o.Failed {
			class := reasonClass(f.Reason)
			s.prodFail[class]++
			if _, ok := s.prodEg[class]; !ok {
				s.prodEg[class] = f.Reason
			}
			s.prodByTID[f.TransferID] = append(s.prodByTID[f.TransferID], fmt.Sprintf("%s@%s: %s", f.Dest, s.ms(), f.Reason))
		}
		s.prodMu.Unlock()
	}
}

// run drives the engine loop until every client request has ended.
func (s *soak) run() {
	restartAt := s.cfg.requests / 2
	deadline := time.Now().Add(time.Duration(s.cfg.requests)*50*time.Millisecond + 4*s.cfg.pushWait)
	for s.next < s.cfg.requests || len(s.live) > 0 {
		if time.Now().After(deadline) {
			s.t.Fatalf("soak: %d requests still live after %d steps:\n%s", len(s.live), s.step, s.dumpLive())
		}
		if s.fig.restarts == 0 && s.next >= restartAt {
			// Between two steps, with requests at every stage in flight.
			s.c.restart(1)
			s.fig.restarts++
			s.fig.restartedAt = time.Now()
			for _, r := range s.live {
				r.faults = append(r.faults, "shard restart")
			}
		}
		s.admit()
		s.engineStep()
		s.step++
		time.Sleep(time.Millisecond)
	}
	// The last finishes and frees reach the table with one more step.
	s.engineStep()
	s.fig.steps = s.step
}

// admit starts client requests while there is room in flight.
func (s *soak) admit() {
	for s.next < s.cfg.requests && len(s.live) < s.cfg.live {
		base := s.next
		s.next++
		k := 1 + s.rng.IntN(3)
		var imgs []*soakImage
		for len(imgs) < k {
			img := s.pickImage()
			if !slices.Contains(imgs, img) {
				imgs = append(imgs, img)
			}
		}
		s.start(base, 0, pickPlan(s.rng), imgs)
	}
}

// pickImage shows a recent image again with probability repeat, so that
// requests in flight share images; otherwise a new one.
func (s *soak) pickImage() *soakImage {
	if len(s.images) > 0 && s.rng.Float64() < s.cfg.repeat {
		w := min(s.cfg.window, len(s.images))
		s.fig.repeats++
		return s.images[len(s.images)-1-s.rng.IntN(w)]
	}
	lo, hi := math.Log(float64(s.cfg.minBytes)), math.Log(float64(s.cfg.maxBytes))
	size := int(math.Exp(lo+s.rng.Float64()*(hi-lo))) + s.rng.IntN(256) // rarely a multiple of the slab's alignment
	size = min(size, s.cfg.maxBytes)
	data := make([]byte, size)
	fill := rand.NewChaCha8([32]byte{byte(len(s.images)), byte(len(s.images) >> 8), byte(len(s.images) >> 16), byte(s.rng.Uint32())})
	_, _ = fill.Read(data)
	img := &soakImage{hash: fmt.Sprintf("mm-soak-%d", len(s.images)), data: data}
	s.images = append(s.images, img)
	s.byHash[img.hash] = img
	return img
}

// start sends one attempt of a request to the encoder: the proxy mints a
// transfer id per image, the encoder's scheduler announces the pushes at
// once and its worker hands the outputs over a few steps later.
func (s *soak) start(base, attempt int, plan abortPlan, imgs []*soakImage) {
	r := &soakReq{
		id: fmt.Sprintf("req-%d", base), base: base, attempt: attempt, plan: plan, images: imgs,
		admitted: time.Now(), expectAt: s.step + s.rng.IntN(4), sourceAt: s.step + s.rng.IntN(5),
		have: map[string]bool{}, startStep: s.step,
	}
	if plan == planOutputLost {
		r.faults = append(r.faults, "output lost")
	}
	if !s.fig.restartedAt.IsZero() && time.Since(s.fig.restartedAt) < restartWindow {
		// Its pushes may still meet connections to the incarnation that is
		// gone.
		r.faults = append(r.faults, "shard restart")
		r.sinceRestart = time.Since(s.fig.restartedAt)
	}
	if attempt > 0 {
		r.id += fmt.Sprintf("-retry%d", attempt)
		s.fig.retries++
	} else {
		s.fig.admitted++
		s.fig.byPlan[plan]++
	}
	r.abortAt = r.expectAt + s.rng.IntN(3)
	pushes := make([]producer.Push, len(imgs))
	for i, img := range imgs {
		if img.uses > 0 {
			s.fig.sharedInFlight++
		}
		img.uses++
		tid := fmt.Sprintf("tx-%d-%d-%d", base, attempt, i)
		r.tids = append(r.tids, tid)
		s.byTID[tid] = r
		s.hashTIDs[img.hash] = append(s.hashTIDs[img.hash], tid)
		pushes[i] = producer.Push{TransferID: tid, MMHash: img.hash, NBytes: uint64(len(img.data)), Consumer: s.c.consumer,
			Meta: fmt.Sprintf(`{"dtype":"uint8","shape":[%d]}`, len(img.data))}
	}
	s.fig.items += len(imgs)
	for _, err := range s.c.prod.Submit(pushes) {
		require.NoError(s.t, err)
	}
	s.live[r.id] = r
}

// handSources gives the producer the encoder outputs that exist by now.
func (s *soak) handSources() {
	var srcs []producer.Source
	var cancel []string
	for _, r := range s.sortedLive() {
		if r.sourced || r.sourceAt > s.step {
			continue
		}
		switch r.plan {
		case planOutputLost:
			continue
		case planEncoderAborted:
			// The encoder's finish drops the pushes of a request whose
			// outputs never came.
			cancel = append(cancel, r.tids...)
			r.sourced = true
			s.end(r, "aborted")
			continue
		}
		r.sourced = true
		for _, img := range r.images {
			srcs = append(srcs, producer.Source{MMHash: img.hash, Mem: img.data})
		}
		if r.plan == planUnseen {
			// The proxy hears the encoder finish and drops the request.
			s.end(r, "aborted")
		}
	}
	if len(cancel) > 0 {
		s.c.prod.Cancel(cancel)
	}
	if len(srcs) > 0 {
		_, errs := s.c.prod.Sources(srcs)
		for _, err := range errs {
			require.NoError(s.t, err)
		}
	}
}

// engineStep is one step of the consumer's engine: what the connector's
// ensure_cache_available, has_cache_item and build_connector_meta tell the
// scheduler, and the worker's start_load_caches for the loads it hands out.
func (s *soak) engineStep() {
	s.handSources()
	in := scheduler.StepIn{Loaded: s.reports, Freed: s.freed, Finished: s.finished}
	s.reports, s.freed, s.finished = nil, nil, nil
	var ensured []*soakReq
	for _, r := range s.sortedLive() {
		switch {
		case r.state == reqPending && r.expectAt <= s.step && r.plan != planUnseen && r.plan != planEncoderAborted:
			if len(s.remaining(r)) == 0 {
				// Every image is in the encoder cache: the connector asks
				// the scheduler nothing and the request never registers.
				s.fig.neverExpected++
				s.useCached(r)
				continue
			}
			items := make([]sched.Expected, len(r.images))
			for i, img := range r.images {
				items[i] = sched.Expected{TransferID: r.tids[i], MMHash: img.hash}
			}
			in.Expect = append(in.Expect, scheduler.ExpectIn{RequestID: r.id, Items: items})
			r.registered, r.state = true, reqWaiting
			fallthrough
		case r.state == reqWaiting:
			in.Ensure = append(in.Ensure, r.id)
			in.Has = append(in.Has, s.remaining(r)...)
			ensured = append(ensured, r)
		}
	}
	for h := range s.plans {
		in.Load = append(in.Load, h)
	}
	sort.Strings(in.Load)
	out := s.c.sched.Step(in)

	for rid, reason := range out.ExpectErrors {
		if r := s.live[rid]; r != nil {
			s.fail(r, sched.Failure{Reason: "refused: " + reason, Retryable: true})
		}
	}
	for _, f := range out.Failures {
		if r := s.live[f.RequestID]; r != nil && r.state != reqRunning {
			s.fail(r, f)
		}
	}
	s.workerLoad(out.Load)
	for _, r := range ensured {
		if s.live[r.id] != r || r.state != reqWaiting {
			continue
		}
		e := out.Ensure[r.id]
		switch {
		case len(e.Failed) > 0:
			s.fail(r, e.Failed[0])
		case e.Ready && r.plan == planAbortBeforeLoad:
			s.end(r, "aborted")
		case e.Ready:
			s.schedule(r, out.Has)
		}
	}
	for _, r := range s.sortedLive() {
		switch {
		case r.plan == planAbortWaiting && r.state != reqRunning && r.state != reqPending && s.step >= r.abortAt:
			if !r.sourced {
				s.c.prod.Cancel(r.tids)
				r.sourced = true
			}
			s.end(r, "aborted")
		case r.state == reqLoading && len(r.have) == len(r.images):
			r.state, r.runUntil = reqRunning, s.step+1+s.rng.IntN(4)
		case r.state == reqRunning && s.step >= r.runUntil:
			s.end(r, "completed")
		}
	}
}

// remaining lists the request's images not in the encoder cache.
func (s *soak) remaining(r *soakReq) []string {
	var out []string
	for _, img := range r.images {
		if s.cache[img.hash] == nil {
			out = append(out, img.hash)
		}
	}
	return out
}

// useCached runs a request whose images are all in the encoder cache.
func (s *soak) useCached(r *soakReq) {
	for _, img := range r.images {
		s.cache[img.hash].users[r.id] = true
		r.have[img.hash] = true
	}
	r.state, r.runUntil = reqRunning, s.step+1+s.rng.IntN(4)
}

// schedule is vLLM allocating a ready request: images in the encoder
// cache are used as they are, the others are loaded with the next step
// (update_state_after_alloc for what has_cache_item said yes to).
func (s *soak) schedule(r *soakReq, has map[string]bool) {
	r.state = reqLoading
	for _, img := range r.images {
		if e := s.cache[img.hash]; e != nil {
			e.users[r.id] = true
			r.have[img.hash] = true
			continue
		}
		if !has[img.hash] {
			s.t.Errorf("soak: ensure said %s is ready, has_cache_item said no for %s", r.id, img.hash)
		}
		p := s.plans[img.hash]
		if p == nil {
			p = map[string]bool{}
			s.plans[img.hash] = p
		}
		p[r.id] = true
	}
}

// workerLoad is start_load_caches on every TP shard: acquire, check the
// bytes, and report the outcome with the next step; a load that fails on
// any shard fails the requests that waited for it.
func (s *soak) workerLoad(loads []scheduler.LoadOut) {
	for _, lo := range loads {
		waiting := s.plans[lo.MMHash]
		delete(s.plans, lo.MMHash)
		var users []*soakReq
		for rid := range waiting {
			if r := s.live[rid]; r != nil {
				users = append(users, r)
			}
		}
		sort.Slice(users, func(i, j int) bool { return users[i].id < users[j].id })
		if lo.Error != "" || lo.TransferID == "" {
			for _, r := range users {
				s.fail(r, sched.Failure{TransferID: lo.TransferID, MMHash: lo.MMHash, Reason: "load cannot start: " + lo.Error, Retryable: true})
			}
			continue
		}
		s.fig.loads++
		pinned, reason := s.acquire(lo.MMHash)
		if reason != "" {
			s.fig.loadFailures[reasonClass(reason)]++
			if s.fig.restartedAt.IsZero() || time.Since(s.fig.restartedAt) > time.Second {
				s.fig.lateLoadFailures = append(s.fig.lateLoadFailures, lo.TransferID+": "+reason)
			}
			s.reports = append(s.reports, scheduler.LoadedIn{TransferID: lo.TransferID, Reason: reason})
			for _, r := range users {
				s.fail(r, sched.Failure{TransferID: lo.TransferID, MMHash: lo.MMHash, Reason: "load failed: " + reason, Retryable: true})
			}
			continue
		}
		s.reports = append(s.reports, scheduler.LoadedIn{TransferID: lo.TransferID, OK: true})
		e := &cacheEntry{pinned: pinned, users: map[string]bool{}}
		s.cache[lo.MMHash] = e
		for _, r := range users {
			e.users[r.id] = true
			r.have[lo.MMHash] = true
		}
		if len(users) == 0 {
			// Every request that wanted it ended this step: vLLM frees it.
			s.free(lo.MMHash)
		}
	}
}

// acquire pins the item on every shard and checks its bytes; on a
// failure it unpins what it pinned and says why.
func (s *soak) acquire(h string) ([]*node.Consumer, string) {
	img := s.byHash[h]
	var pinned []*node.Consumer
	reason := ""
	for r, sh := range s.c.shards {
		got := sh.Acquire([]string{h})[0]
		if got.Error != "" {
			reason = fmt.Sprintf("shard %d: %s", r, got.Error)
			break
		}
		pinned = append(pinned, sh)
		region := s.c.slabs[r][got.Offset : got.Offset+got.NBytes]
		if !bytes.Equal(img.data, region) || got.Meta != fmt.Sprintf(`{"dtype":"uint8","shape":[%d]}`, len(img.data)) {
			s.t.Errorf("soak: shard %d holds other bytes for %s (%d bytes, %d expected, meta %s)", r, h, got.NBytes, len(img.data), got.Meta)
			reason = fmt.Sprintf("shard %d: bytes differ", r)
			break
		}
		s.fig.loadedBytes += got.NBytes
	}
	if reason != "" {
		s.release(h, pinned)
		return nil, reason
	}
	return pinned, ""
}

// release unpins on the incarnations that were loaded from; a shard that
// restarted since never pinned the item.
func (s *soak) release(h string, pinned []*node.Consumer) {
	for _, sh := range pinned {
		if !slices.Contains(s.c.shards, sh) {
			continue
		}
		for _, err := range sh.Release([]string{h}) {
			require.NoError(s.t, err, "release %s", h)
		}
	}
}

// free drops the item from the encoder cache: the worker unpins it and
// the scheduler hears free_encoder_mm_hashes with the next step.
func (s *soak) free(h string) {
	e := s.cache[h]
	delete(s.cache, h)
	s.release(h, e.pinned)
	s.freed = append(s.freed, h)
}

func (s *soak) fail(r *soakReq, f sched.Failure) {
	class := reasonClass(f.Reason)
	s.fig.failures[class]++
	if _, ok := s.fig.failureSample[class]; !ok {
		s.fig.failureSample[class] = f.Reason
	}
	if fault := s.attribute(r, f, class); fault != "" {
		if s.fig.byFault[fault] == nil {
			s.fig.byFault[fault] = map[string]int{}
		}
		s.fig.byFault[fault][class]++
		if fault == "shard restart" {
			s.fig.lastRestartFailure = max(s.fig.lastRestartFailure, r.sinceRestart)
		}
	} else {
		s.fig.unexplained[class]++
		s.fig.details = append(s.fig.details, s.history(r, f))
	}
	s.end(r, "failed")
	if f.Retryable && r.attempt == 0 {
		s.start(r.base, 1, planComplete, r.images)
	} else {
		s.fig.failedFinal++
	}
}

// end is request_finished: the scheduler hears it with the next step,
// and the images it alone used leave the encoder cache.
func (s *soak) end(r *soakReq, outcome string) {
	delete(s.live, r.id)
	r.outcome = fmt.Sprintf("%s@%s", outcome, s.ms())
	switch outcome {
	case "completed":
		s.fig.completed++
		s.fig.served += len(r.images)
	case "aborted":
		s.fig.aborted++
	}
	if r.registered {
		s.finished = append(s.finished, r.id)
	}
	for _, img := range r.images {
		img.uses--
		if p := s.plans[img.hash]; p != nil {
			delete(p, r.id)
		}
		e := s.cache[img.hash]
		if e == nil || !e.users[r.id] {
			continue
		}
		delete(e.users, r.id)
		if len(e.users) == 0 {
			s.free(img.hash)
		}
	}
}

// restartWindow is how long after a shard restart a new attempt counts as
// touched by it: the producer may still hold connections to the
// incarnation that is gone, and the scheduler learns of the new one from
// its first event.
const restartWindow = time.Second

// attribute names the injected fault that caused r's failure f, or ""
// when none did: one that touched r itself; the restarted shard named
// as gone or silent; or, for a follower failed by its writer's abandon, a
// fault that touched the push of its content that abandoned (an output
// lost, say: that push waited for a source until its deadline).
func (s *soak) attribute(r *soakReq, f sched.Failure, class string) string {
	if len(r.faults) > 0 {
		return r.faults[0]
	}
	if (class == "shard restarted" || class == "shard lost") && s.fig.restarts > 0 && strings.Contains(f.Reason, "shard 1 ") {
		return "shard restart"
	}
	if class != "abandoned" || f.MMHash == "" {
		return ""
	}
	s.prodMu.Lock()
	defer s.prodMu.Unlock()
	for _, tid := range s.hashTIDs[f.MMHash] {
		if o := s.byTID[tid]; o != r && len(o.faults) > 0 && len(s.prodByTID[tid]) > 0 {
			return o.faults[0] + ", its writer's"
		}
	}
	return ""
}

// history is one unexplained failure with what the soak knows of every
// push of its content: whose request it was, how that ended, and what the
// producer reported for it.
func (s *soak) history(r *soakReq, f sched.Failure) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s (plan %s, step %d→%d, at %s) tid %s mm_hash %s: %s", r.id, r.plan, r.startStep, s.step, s.ms(), f.TransferID, f.MMHash, f.Reason)
	if !s.fig.restartedAt.IsZero() {
		fmt.Fprintf(&b, " (%s after the shard restart)", time.Since(s.fig.restartedAt).Round(time.Millisecond))
	}
	hashes := []string{f.MMHash}
	if f.MMHash == "" {
		hashes = nil
		for _, img := range r.images {
			hashes = append(hashes, img.hash)
		}
	}
	s.prodMu.Lock()
	defer s.prodMu.Unlock()
	for _, h := range hashes {
		for _, tid := range s.hashTIDs[h] {
			o := s.byTID[tid]
			fmt.Fprintf(&b, "\n      %s %s: %s plan %s step %d sourced %v faults %v outcome %q producer %v",
				h, tid, o.id, o.plan, o.startStep, o.sourced, o.faults, o.outcome, s.prodByTID[tid])
			fmt.Fprintf(&b, "\n        now: %s", s.whereNow(tid))
		}
	}
	return b.String()
}

// whereNow is where a transfer stands, as the producer and each shard see
// it at this moment: a history's clue to which side a push got stuck on.
func (s *soak) whereNow(tid string) string {
	var parts []string
	if st, ok := s.c.prod.Status(tid); ok {
		dests := make([]string, 0, len(st))
		for d, state := range st {
			dests = append(dests, fmt.Sprintf("%s=%s", d, state))
		}
		sort.Strings(dests)
		parts = append(parts, "producer "+strings.Join(dests, " "))
	} else {
		parts = append(parts, "producer: unknown")
	}
	for i, sh := range s.c.shards {
		if st, ok := sh.Status(tid); ok {
			parts = append(parts, fmt.Sprintf("shard %d %s %s done %v%s", i, st.Kind, st.State, st.Done, reasonSuffix(st.Reason)))
		} else {
			parts = append(parts, fmt.Sprintf("shard %d: unknown", i))
		}
	}
	return strings.Join(parts, "; ")
}

func reasonSuffix(reason string) string {
	if reason == "" {
		return ""
	}
	return " (" + reason + ")"
}

// ms is the time since the soak began, for histories.
func (s *soak) ms() string { return time.Since(s.t0).Round(time.Millisecond).String() }

func (s *soak) sortedLive() []*soakReq {
	out := make([]*soakReq, 0, len(s.live))
	for _, r := range s.live {
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].base != out[j].base {
			return out[i].base < out[j].base
		}
		return out[i].attempt < out[j].attempt
	})
	return out
}

func (s *soak) dumpLive() string {
	var b strings.Builder
	for _, r := range s.sortedLive() {
		fmt.Fprintf(&b, "  %s plan=%s state=%d registered=%v sourced=%v have=%d/%d age=%s tids=%v\n",
			r.id, r.plan, r.state, r.registered, r.sourced, len(r.have), len(r.images), time.Since(r.admitted).Round(time.Millisecond), r.tids)
	}
	return b.String()
}

// settle waits, bounded, for what legitimately outlives the requests to
// end: the producer's last outcomes, copies held by a lease (pushed for a
// request the consumer never saw), early events held for the push wait.
// It only waits; checkEnd says what is wrong if something never ends.
func (s *soak) settle() {
	deadline := time.Now().Add(2*s.cfg.pushWait + 2*s.cfg.lease + 10*time.Second)
	for !s.settled() && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	close(s.stopPoll)
	<-s.polled
}

func (s *soak) settled() bool {
	if st := s.c.prod.Stats(); st.Sources > 0 || st.Pending {
		return false
	}
	for _, sh := range s.c.shards {
		st := sh.Stats().Table
		if st.Regions[reserve.Writing]+st.Pending > 0 || st.Pinned > 0 || st.Regions[reserve.Ready] != st.Residents {
			return false
		}
	}
	ts := s.c.sched.Stats().Table
	inFlight := 0
	for st, n := range ts.Records {
		if st != sched.Resident {
			inFlight += n
		}
	}
	return ts.EarlyEvents == 0 && ts.Requests == 0 && inFlight == 0
}

func (s *soak) report(wall time.Duration) {
	f := s.fig
	s.t.Logf("soak: %d requests (%d retries), %d steps, %s wall", f.admitted, f.retries, f.steps, wall.Round(time.Millisecond))
	s.t.Logf("soak: plans %v", plansFigure(f.byPlan))
	s.t.Logf("soak: completed %d, aborted %d, failed after retry %d; %d items (%d repeats, %d shared with a request in flight), %d served, %d never registered",
		f.completed, f.aborted, f.failedFinal, f.items, f.repeats, f.sharedInFlight, f.served, f.neverExpected)
	s.t.Logf("soak: %d loads, %d MiB loaded and checked; load failures %v, %d of them not right after the restart %v",
		f.loads, f.loadedBytes>>20, f.loadFailures, len(f.lateLoadFailures), f.lateLoadFailures[:min(len(f.lateLoadFailures), 5)])
	s.t.Logf("soak: shard restarts %d; attempt failures by reason %v; the latest attempt the restart failed started %s after it (window %s)",
		f.restarts, f.failures, f.lastRestartFailure.Round(time.Millisecond), restartWindow)
	for _, k := range sortedKeys(f.byFault) {
		s.t.Logf("soak:   caused by %s: %v", k, f.byFault[k])
	}
	s.t.Logf("soak:   caused by no injected fault: %v", f.unexplained)
	for _, d := range f.details {
		s.t.Logf("soak:   unexplained: %s", d)
	}
	for _, k := range sortedKeys(f.failureSample) {
		s.t.Logf("soak:   %s, e.g. %q", k, f.failureSample[k])
	}
	s.prodMu.Lock()
	s.t.Logf("soak: producer: %d pushes done, failed by reason %v; %d waits for a source extended for a push that follows",
		s.prodDone, s.prodFail, s.c.prod.Stats().Push.WaitsExtended)
	if s.c.o.credit > 0 {
		cs := s.c.prod.Stats().Credit
		s.t.Logf("soak: credit: %d batches took their regions from a window, %d reserved; %d claims refused (reserved again), %d wasted",
			cs.Batches, cs.Fallbacks, cs.Refused, cs.Wasted)
	}
	for _, k := range sortedKeys(s.prodEg) {
		s.t.Logf("soak:   %s, e.g. %q", k, s.prodEg[k])
	}
	s.prodMu.Unlock()
	ts := s.c.sched.Stats()
	s.t.Logf("soak: scheduler table: live records %v, ended %v, requests %d, early events %d (dropped %d), ignored events %d, ignored reports %d, resynced %d",
		ts.Table.Records, ts.Table.Ended, ts.Table.Requests, ts.Table.EarlyEvents, ts.Table.EarlyDropped, ts.Table.IgnoredEvents, ts.Table.IgnoredReports, ts.Resynced)
	for r, sh := range s.c.shards {
		st := sh.Stats()
		tb := st.Table
		s.t.Logf("soak: shard %d: regions %v, residents %d (%d B), in use %d B of %d, pinned %d, transfers %d, completed %d, cancelled %d, expired %d (evictions %d), rejected writes %+v",
			r, regionsFigure(tb.Regions), tb.Residents, tb.ResidentBytes, st.InUse, st.Size, tb.Pinned, tb.Transfers, tb.Completed, tb.Cancelled, tb.Expired, tb.Evictions, tb.RejectedWrites)
	}
}

// checkEnd asserts the end state: nothing in flight anywhere, slab bytes
// in use are the resident copies', and whatever has_cache_item still says
// yes to is on every shard, bit-exact.
func (s *soak) checkEnd() {
	t := s.t
	st := s.c.prod.Stats()
	require.Zero(t, st.Sources, "sources the producer still holds")
	require.False(t, st.Pending, "the producer still has pushes pending")
	ts := s.c.sched.Stats().Table
	require.Zero(t, ts.Requests, "requests left in the scheduler's table")
	require.Zero(t, ts.EarlyEvents, "early events left in the scheduler's table")
	for st, n := range ts.Records {
		if st != sched.Resident {
			require.Zero(t, n, "scheduler records left %s", st)
		}
	}
	for r, sh := range s.c.shards {
		st := sh.Stats()
		tb := st.Table
		require.Zero(t, tb.Regions[reserve.Writing], "shard %d: regions being written", r)
		require.Zero(t, tb.Pending, "shard %d: regions waiting for writes", r)
		require.Zero(t, tb.WritesInFlight, "shard %d: writes in flight", r)
		require.Zero(t, tb.Pinned, "shard %d: pinned regions", r)
		require.Equal(t, tb.Residents, tb.Regions[reserve.Ready], "shard %d: ready regions that are not resident copies", r)
		require.Equal(t, tb.ResidentBytes+tb.Credit.WindowBytes, st.InUse, "shard %d: slab bytes in use beyond the resident copies and the credit windows", r)
		require.LessOrEqual(t, tb.Transfers, tb.Residents, "shard %d: transfers beyond the resident copies' writers", r)
	}
	offered := 0
	var lies []string
	for _, img := range s.images {
		if !s.c.sched.Has(img.hash) {
			continue
		}
		offered++
		if _, reason := s.acquire(img.hash); reason != "" {
			lies = append(lies, img.hash+" ("+reason+")")
			continue
		}
		s.release(img.hash, s.c.shards)
	}
	t.Logf("soak: has_cache_item says yes to %d images at the end, %d of them not on every shard", offered, len(lies))
	require.Empty(t, lies, "has_cache_item says yes to items a load cannot find")
}

// reasonClass buckets a failure reason for the figures.
func reasonClass(reason string) string {
	for _, k := range []struct{ needle, class string }{
		{"restarted", "shard restarted"},
		{"unreachable", "unreachable"},
		{"connection lost", "connection lost"},
		{"no encoder output", "source wait"},
		{"shard reports the reservation expired", "lease"},
		{"shard reports the reservation cancelled", "cancelled"},
		{"stopped answering", "shard lost"},
		{"did not arrive", "push wait"},
		{"lease", "lease"},
		{"refused", "refused"},
		{"collision", "collision"},
		{"load cannot start", "load cannot start"},
		{"unknown", "acquire unknown"},
		{"not ready", "acquire not ready"},
		{"bytes differ", "bytes differ"},
		{"abandon", "abandoned"},
		{"cancel", "cancelled"},
		{"source", "source wait"},
		{"gone", "gone"},
		{"timeout", "timeout"},
		{"deadline", "timeout"},
	} {
		if strings.Contains(reason, k.needle) {
			return k.class
		}
	}
	if len(reason) > 40 {
		return reason[:40]
	}
	return reason
}

func plansFigure(by [numPlans]int) map[string]int {
	out := map[string]int{}
	for p, n := range by {
		out[abortPlan(p).String()] = n
	}
	return out
}

func regionsFigure(by map[reserve.State]int) map[string]int {
	out := map[string]int{}
	for st, n := range by {
		if n > 0 {
			out[st.String()] = n
		}
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
