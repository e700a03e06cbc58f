package push

import (
	"errors"
	"fmt"
	"math/rand"
	"slices"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/internal/fsmtest"
	"github.com/stretchr/testify/require"
)

// TestRandomModel drives a Manager with random calls from a fixed seed,
// playing the runtime: it performs what Ready returns and reports outcomes
// late, out of order, with errors, or never (deadlines). After every step
// it checks the manager's invariants and, from the outside, that a source
// is never released while a write reading it is out, that every effect is
// emitted once, and that nothing is left once all work has drained.
func TestRandomModel(t *testing.T) {
	var windowWaits, completesFailed, extended uint64
	fsmtest.Seeds(t, func(t *testing.T, rng *rand.Rand) {
		md := newModel(t, rng)
		md.run(2000)
		s := md.m.Stats()
		require.NotZero(t, s.Ended[Done], "the run should finish pushes")
		require.NotZero(t, s.Ended[Failed], "the run should fail pushes")
		require.NotZero(t, s.Ended[Cancelled], "the run should cancel pushes")
		require.NotZero(t, s.Collisions, "the run should exercise collisions")
		// Which write the model reports first is drawn from a map, so a
		// seed's run varies a little: these are counted over every seed.
		windowWaits += s.WindowWaits
		completesFailed += s.CompletesFailed
		extended += s.WaitsExtended
	})
	require.NotZero(t, windowWaits, "the runs should fill the complete window")
	require.NotZero(t, completesFailed, "the runs should fail completes")
	require.NotZero(t, extended, "the runs should make writes wait past their source deadline for a follower")
}

// FuzzModel runs the same model with the fuzzer's bytes choosing every
// call, so that coverage guidance can steer towards rare interleavings.
func FuzzModel(f *testing.F) {
	fsmtest.FuzzModel(f, "push", func(t *testing.T, rng *rand.Rand, steps int) { newModel(t, rng).run(steps) })
}

type pairKey struct{ tid, dest string }

// modelWindow is small, so that the model's completes often wait for a
// place.
const modelWindow = 1

type model struct {
	t   *testing.T
	rng *rand.Rand
	m   *Manager
	now time.Time

	pushes   map[string]Push // every accepted push
	reserves []pairKey       // reservations sent and not yet answered
	granted  map[pairKey]Grant
	writes   map[pairKey]SourceID // writes out
	complete []pairKey            // completes out
	cancels  []pairKey            // cancels out, not yet answered
	sources  map[SourceID]string  // held by the manager: id → mm_hash
	released map[SourceID]bool
	done     map[string]bool
	seen     map[string]bool // effects emitted, to catch repeats
	nextSrc  SourceID
	nextRes  ids.ResID
}

// newModel's SourceWait is short beside how often a content's source comes
// (about every 8 s of model time): writes then often wait past it, some for
// a follower that joined late (Stats.WaitsExtended), and some fail.
func newModel(t *testing.T, rng *rand.Rand) *model {
	return &model{
		t:   t,
		rng: rng,
		m: New(Config{ReserveWait: 20 * time.Second, SourceWait: 5 * time.Second, WriteWait: 20 * time.Second, NotifyWait: 15 * time.Second, MaxTombstones: 1 << 20,
			CompleteWindow: modelWindow}),
		now:      base,
		pushes:   map[string]Push{},
		granted:  map[pairKey]Grant{},
		writes:   map[pairKey]SourceID{},
		sources:  map[SourceID]string{},
		released: map[SourceID]bool{},
		done:     map[string]bool{},
		seen:     map[string]bool{},
	}
}

func sizeOf(hash string) uint64 { return uint64(100 * (hash[1] - '0' + 1)) }

func (md *model) run(steps int) {
	t := md.t
	for step := 0; step < steps; step++ {
		md.now = md.now.Add(time.Duration(md.rng.Intn(400)) * time.Millisecond)
		where := md.step(step)
		require.NoError(t, md.m.CheckInvariants(), where)
		if !md.m.Pending() {
			require.Empty(t, md.writes, "%s: idle with writes out", where)
			require.Empty(t, md.sources, "%s: idle holding sources", where)
		}
	}
	md.drain()
}

func (md *model) step(step int) string {
	t, rng, m := md.t, md.rng, md.m
	pick := func(prefix string, n int) string { return fmt.Sprintf("%s%d", prefix, rng.Intn(n)) }
	// Transfer ids come from a window that slides with the steps, so that
	// new pushes keep arriving while recent ones are repeated or collide.
	window := step / 40
	pickTransfer := func() (string, int) {
		n := window + rng.Intn(8)
		return fmt.Sprint("t", n), n
	}
	switch op := rng.Intn(100); {
	case op < 15:
		tid, n := pickTransfer()
		hash := fmt.Sprint("h", n%4)
		var dests []string
		for _, d := range rng.Perm(3)[:1+rng.Intn(3)] {
			dests = append(dests, fmt.Sprint("d", d))
		}
		if old, ok := md.pushes[tid]; ok && rng.Intn(4) != 0 {
			dests = slices.Clone(old.Dests)
			rng.Shuffle(len(dests), func(i, j int) { dests[i], dests[j] = dests[j], dests[i] })
		}
		p := Push{TransferID: tid, MMHash: hash, NBytes: sizeOf(hash), Dests: dests}
		where := fmt.Sprintf("step %d: add %+v", step, p)
		err := m.Add(p, md.now)
		if old, ok := md.pushes[tid]; ok && !samePush(old, p) {
			require.ErrorIs(t, err, ErrCollision, where)
		} else {
			require.NoError(t, err, where)
			if !ok {
				md.pushes[tid] = p
			}
		}
		return where
	case op < 35:
		where := fmt.Sprintf("step %d: ready", step)
		md.apply(where, m.Ready(md.now))
		return where
	case op < 50:
		if len(md.reserves) == 0 {
			return "nothing to grant"
		}
		i := rng.Intn(len(md.reserves))
		k := md.reserves[i]
		if rng.Intn(5) != 0 {
			md.reserves = slices.Delete(md.reserves, i, i+1)
		}
		var g Grant
		switch rng.Intn(10) {
		case 0:
			g = Grant{Err: "pool full"}
		case 1:
			g = Grant{Kind: KindFollow}
		case 2:
			g = Grant{Kind: KindCached}
		default:
			md.nextRes++
			g = Grant{Kind: KindWrite, Res: md.nextRes, Token: tokenFor(md.nextRes), NBytes: md.pushes[k.tid].NBytes}
		}
		if g.Res != 0 {
			if _, dup := md.granted[k]; !dup {
				md.granted[k] = g
			}
		}
		m.Granted(k.tid, k.dest, g, md.now)
		return fmt.Sprintf("step %d: grant %v %+v", step, k, g)
	case op < 60:
		hash := pick("h", 4)
		md.nextSrc++
		where := fmt.Sprintf("step %d: source %s %d", step, hash, md.nextSrc)
		require.NoError(t, m.SourceReady(hash, md.nextSrc, sizeOf(hash), md.now), where)
		md.sources[md.nextSrc] = hash
		return where
	case op < 72:
		for k := range md.writes {
			var err error
			if rng.Intn(6) == 0 {
				err = errors.New("reset")
			}
			delete(md.writes, k)
			// Some planes complete in-band (TCP), the others by message.
			if inBand := rng.Intn(2) == 0; inBand {
				m.WriteDoneInBand(k.tid, k.dest, err, md.now)
				return fmt.Sprintf("step %d: write done in-band %v err=%v", step, k, err)
			}
			m.WriteDone(k.tid, k.dest, err, md.now)
			return fmt.Sprintf("step %d: write done %v err=%v", step, k, err)
		}
		return "no write out"
	case op < 82:
		if len(md.complete) == 0 {
			return "no complete out"
		}
		i := rng.Intn(len(md.complete))
		k := md.complete[i]
		md.complete = slices.Delete(md.complete, i, i+1)
		var err error
		if rng.Intn(8) == 0 {
			err = errors.New("gone")
		}
		m.CompleteDone(k.tid, k.dest, err, md.now)
		return fmt.Sprintf("step %d: complete done %v err=%v", step, k, err)
	case op < 86:
		if len(md.cancels) == 0 {
			return "no cancel out"
		}
		i := rng.Intn(len(md.cancels))
		k := md.cancels[i]
		md.cancels = slices.Delete(md.cancels, i, i+1)
		m.CancelDone(k.tid, k.dest, md.now)
		return fmt.Sprintf("step %d: cancel done %v", step, k)
	case op < 90:
		tid, _ := pickTransfer()
		m.Cancel(tid, md.now)
		return fmt.Sprintf("step %d: cancel %s", step, tid)
	default:
		m.Tick(md.now)
		if at, ok := m.NextDeadline(); ok {
			require.True(t, at.After(md.now), "step %d: deadline %v not after a tick at %v", step, at, md.now)
		}
		return fmt.Sprintf("step %d: tick", step)
	}
}

// apply plays the runtime for one Ready and checks it from the outside.
func (md *model) apply(where string, rd Effects) {
	t := md.t
	once := func(kind string, k pairKey, extra ...any) {
		key := fmt.Sprint(kind, k, extra)
		require.False(t, md.seen[key], "%s: %s emitted twice", where, key)
		md.seen[key] = true
	}
	for d, items := range rd.Reserves {
		for _, it := range items {
			k := pairKey{it.TransferID, d}
			once("reserve", k)
			require.Equal(t, md.pushes[it.TransferID].NBytes, it.NBytes, where)
			md.reserves = append(md.reserves, k)
		}
	}
	for d, ws := range rd.Writes {
		for _, w := range ws {
			k := pairKey{w.TransferID, d}
			once("write", k)
			g := md.granted[k]
			require.Equal(t, g.Res, w.Res, where)
			require.True(t, g.Token.Equal(w.Token), where)
			require.Equal(t, md.pushes[w.TransferID].MMHash, md.sources[w.Src], "%s: write reads source %d not held for its content", where, w.Src)
			md.writes[k] = w.Src
		}
	}
	for d, cs := range rd.Completes {
		for _, c := range cs {
			k := pairKey{c.TransferID, d}
			once("complete", k)
			require.Equal(t, md.granted[k].Res, c.Res, where)
			md.complete = append(md.complete, k)
		}
	}
	for d, cs := range rd.Cancels {
		for _, c := range cs {
			k := pairKey{c.TransferID, d}
			once("cancel", k, c.Res)
			require.Equal(t, md.granted[k].Res, c.Res, "%s: cancel of %v names another reservation", where, k)
			require.True(t, md.granted[k].Token.Equal(c.Token), where)
			md.cancels = append(md.cancels, k)
		}
	}
	for _, src := range rd.Releases {
		require.False(t, md.released[src], "%s: source %d released twice", where, src)
		_, held := md.sources[src]
		require.True(t, held, "%s: source %d released but never held", where, src)
		for k, s := range md.writes {
			require.NotEqual(t, src, s, "%s: source %d released while write %v reads it", where, src, k)
		}
		md.released[src] = true
		delete(md.sources, src)
	}
	for _, tid := range rd.Done {
		require.False(t, md.done[tid], "%s: %s done twice", where, tid)
		md.done[tid] = true
	}
	md.checkWindow(where)
	md.checkSourcesNeeded(where)
}

// checkWindow: no destination ever has more completes out (handed out,
// no outcome reported, the record still waiting for one) than the window.
func (md *model) checkWindow(where string) {
	out := map[string]int{}
	for _, k := range md.complete {
		if st, _ := md.m.Status(k.tid); st[k.dest] == Notifying {
			out[k.dest]++
		}
	}
	for d, n := range out {
		require.LessOrEqual(md.t, n, modelWindow, "%s: %d completes out to %s", where, n, d)
	}
}

// checkSourcesNeeded: after a Ready, every source still held is one that
// a push may still write or a write still reads; a push whose bytes landed
// (its complete queued or out, acknowledged or not) keeps none.
func (md *model) checkSourcesNeeded(where string) {
	needed := map[string]bool{}
	for k := range md.writes {
		needed[md.pushes[k.tid].MMHash] = true
	}
	for tid, p := range md.pushes {
		st, _ := md.m.Status(tid)
		for _, s := range st {
			if s == Reserving || s == WaitingInputs || s == Writing || s == CancelPending {
				needed[p.MMHash] = true
			}
		}
	}
	for src, h := range md.sources {
		require.True(md.t, needed[h], "%s: source %d of %s held after Ready, though no push needs it", where, src, h)
	}
}

// drain answers everything still out, cancels everything, lets every
// deadline pass and checks that the manager ends idle with every source
// handed back.
func (md *model) drain() {
	t, m := md.t, md.m
	for tid := range md.pushes {
		m.Cancel(tid, md.now)
	}
	for round := 0; round < 10 && m.Pending(); round++ {
		for k := range md.writes {
			delete(md.writes, k)
			m.WriteDone(k.tid, k.dest, nil, md.now)
		}
		for _, k := range md.complete {
			m.CompleteDone(k.tid, k.dest, nil, md.now)
		}
		md.complete = nil
		for _, k := range md.cancels {
			m.CancelDone(k.tid, k.dest, md.now)
		}
		md.cancels = nil
		md.now = md.now.Add(time.Minute)
		md.apply(fmt.Sprintf("drain %d", round), m.Ready(md.now))
		require.NoError(t, m.CheckInvariants())
	}
	require.False(t, m.Pending(), "work left after draining")
	require.Zero(t, m.Stats().CancelsOut, "cancels left unanswered after draining")
	require.Empty(t, md.sources, "sources never released")
}
