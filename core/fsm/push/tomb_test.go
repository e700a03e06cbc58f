package push

import (
	"fmt"
	"reflect"
	"runtime"
	"runtime/metrics"
	"testing"

	"github.com/stretchr/testify/require"
)

// hasPointers reports whether a value of t holds anything the collector
// follows.
func hasPointers(t reflect.Type) bool {
	switch t.Kind() {
	case reflect.Pointer, reflect.UnsafePointer, reflect.String, reflect.Slice, reflect.Map,
		reflect.Chan, reflect.Func, reflect.Interface:
		return true
	case reflect.Array:
		return t.Len() > 0 && hasPointers(t.Elem())
	case reflect.Struct:
		for i := range t.NumField() {
			if hasPointers(t.Field(i).Type) {
				return true
			}
		}
	}
	return false
}

// A producer remembers up to MaxTombstones ended pushes, 65,536 by
// default: their map and queue hold no pointer, so that the collector,
// which runs every few thousand batches, never scans them.
func TestTombstonesHoldNoPointers(t *testing.T) {
	m := New(Config{})
	tombs := reflect.TypeOf(m.tombs.byKey)
	require.False(t, hasPointers(tombs.Key()), "tombstone key %s", tombs.Key())
	require.False(t, hasPointers(tombs.Elem()), "tombstone %s", tombs.Elem())
	queue := reflect.TypeOf(m.tombs.queue).Elem()
	require.False(t, hasPointers(queue), "tombstone queue of %s", queue)
}

// fillTombs ends n pushes of two shards each, every one answered.
func fillTombs(tb testing.TB, m *Manager, n int) {
	tb.Helper()
	dests := []string{"10.0.0.1:7000", "10.0.0.2:7000"}
	for i := range n {
		tid := fmt.Sprintf("req-%d-0123456789abcdef", i)
		require.NoError(tb, m.Add(Push{TransferID: tid, MMHash: fmt.Sprintf("%064x", i), NBytes: 4096,
			Meta: `{"dtype":"bfloat16","shape":[1,2048]}`, Dests: dests}, base))
		m.Ready(base)
		for _, d := range dests {
			m.Granted(tid, d, Grant{Kind: KindCached}, base)
		}
		m.Ready(base)
	}
}

// BenchmarkTombstoneHeap reports what 65,536 tombstones cost the
// collector: the live heap they add, its objects, and the bytes a
// collection scans.
func BenchmarkTombstoneHeap(b *testing.B) {
	samples := []metrics.Sample{{Name: "/gc/scan/heap:bytes"}}
	var before, after runtime.MemStats
	var scan uint64
	for range b.N {
		runtime.GC()
		runtime.ReadMemStats(&before)
		m := New(Config{})
		fillTombs(b, m, DefaultMaxTombstones)
		runtime.GC()
		runtime.ReadMemStats(&after)
		metrics.Read(samples)
		scan = samples[0].Value.Uint64()
		require.Equal(b, DefaultMaxTombstones, m.Stats().Tombstones)
		runtime.KeepAlive(m)
	}
	b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/1e6, "heap-MB")
	b.ReportMetric(float64(after.HeapObjects-before.HeapObjects), "heap-objects")
	b.ReportMetric(float64(scan)/1e6, "scanned-MB")
}

// endPush adds a push to dests and ends it, every shard answering cached.
func endPush(t *testing.T, m *Manager, tid string, dests ...string) {
	t.Helper()
	require.NoError(t, m.Add(Push{TransferID: tid, MMHash: "h-" + tid, NBytes: 100, Dests: dests}, base))
	m.Ready(base)
	for _, d := range dests {
		m.Granted(tid, d, Grant{Kind: KindCached}, base)
	}
	m.Ready(base)
	require.NoError(t, m.CheckInvariants())
}

// Tombstones name their destination lists by number: a list is kept once
// however many tombstones name it, and forgotten with the last of them; a
// push to more shards than a tombstone keeps inline still reports every
// shard's state.
func TestTombstoneDestinationLists(t *testing.T) {
	m := New(Config{MaxTombstones: 3})
	six := []string{"d1", "d2", "d3", "d4", "d5", "d6"}
	endPush(t, m, "wide", six...)
	st, ok := m.Status("wide")
	require.True(t, ok)
	require.Len(t, st, len(six))
	for _, d := range six {
		require.Equal(t, Done, st[d], d)
	}
	// Two more of one list, then lists that push them all out.
	endPush(t, m, "a1", "d1", "d2")
	endPush(t, m, "a2", "d1", "d2")
	require.Len(t, m.tombs.dests.ids, 2, "two lists, one named twice")
	for i := range 5 {
		endPush(t, m, fmt.Sprintf("b%d", i), fmt.Sprintf("e%d", i))
	}
	require.Len(t, m.tombs.dests.ids, 3, "only the lists of the 3 tombstones kept")
	_, ok = m.Status("wide")
	require.False(t, ok)
	require.Empty(t, m.tombs.more, "the wide push's states went with its tombstone")
	// A list whose destinations run together differently is another list.
	endPush(t, m, "c1", "x\x01y")
	endPush(t, m, "c2", "x", "y")
	st, _ = m.Status("c2")
	require.Equal(t, map[string]State{"x": Done, "y": Done}, st)
}

// A transfer that ends under the key of a tombstone already kept (another
// transfer_id with the same 64-bit key, or the same one) replaces it, and
// the queue still holds each key once.
func TestTombstoneKeyTakenAgain(t *testing.T) {
	m := New(Config{MaxTombstones: 4})
	endPush(t, m, "t1", "d1")
	endPush(t, m, "t2", "d2")
	twin := &transfer{push: Push{TransferID: "t1", MMHash: "other", NBytes: 7, Dests: []string{"d3"}}}
	twin.recs = []*rec{{tr: twin, dest: "d3", state: Failed}}
	m.retire(twin)
	require.NoError(t, m.CheckInvariants())
	require.Len(t, m.tombs.queue, 2)
	st, ok := m.Status("t1")
	require.True(t, ok)
	require.Equal(t, map[string]State{"d3": Failed}, st)
	require.ErrorIs(t, m.Add(Push{TransferID: "t1", MMHash: "h-t1", NBytes: 100, Dests: []string{"d1"}}, base), ErrCollision)
}
