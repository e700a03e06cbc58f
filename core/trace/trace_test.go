package trace

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

func TestOffRecordsNothingAndAllocatesNothing(t *testing.T) {
	Enable(0)
	t.Cleanup(func() { Enable(0) })
	allocs := testing.AllocsPerRun(1000, func() {
		Stamp(WriteEnqueued, "h")
		StampAll(Ready, []string{"a", "b"}, func(s string) string { return s })
	})
	if allocs != 0 {
		t.Fatalf("a stamp with tracing off allocated %v times", allocs)
	}
	if Enabled() || Capacity() != 0 {
		t.Fatal("tracing is on after Enable(0)")
	}
	if s := Drain(); len(s.Entries) != 0 || s.Capacity != 0 {
		t.Fatalf("drain with tracing off: %+v", s)
	}
}

func TestRingKeepsOrderAndDrainsOnce(t *testing.T) {
	Enable(8)
	t.Cleanup(func() { Enable(0) })
	Stamp(ReserveSent, "a")
	Stamp(WriteEnqueued, "a")
	StampAll(Ready, []string{"a", "b"}, func(s string) string { return s })
	s := Drain()
	want := []struct {
		h Hop
		k string
	}{{ReserveSent, "a"}, {WriteEnqueued, "a"}, {Ready, "a"}, {Ready, "b"}}
	if len(s.Entries) != len(want) || s.Dropped != 0 || s.Capacity != 8 {
		t.Fatalf("drained %+v", s)
	}
	for i, w := range want {
		if s.Entries[i].Hop != w.h || s.Entries[i].Key != w.k {
			t.Fatalf("entry %d is %+v, want %v %s", i, s.Entries[i], w.h, w.k)
		}
		if i > 0 && s.Entries[i].NS < s.Entries[i-1].NS {
			t.Fatalf("stamps go back: %+v", s.Entries)
		}
	}
	if again := Drain(); len(again.Entries) != 0 {
		t.Fatalf("a second drain gave %+v", again)
	}
}

func TestFullRingOverwritesTheOldestAndCountsIt(t *testing.T) {
	Enable(4)
	t.Cleanup(func() { Enable(0) })
	for i := 0; i < 10; i++ {
		Stamp(Ready, fmt.Sprint(i))
	}
	s := Drain()
	if s.Dropped != 6 || len(s.Entries) != 4 {
		t.Fatalf("dropped %d, kept %d; want 6 and 4", s.Dropped, len(s.Entries))
	}
	for i, e := range s.Entries {
		if e.Key != fmt.Sprint(6+i) {
			t.Fatalf("kept %+v, want the newest four in order", s.Entries)
		}
	}
	// After a drain the ring wraps from where it is, and counts anew.
	for i := 0; i < 5; i++ {
		Stamp(Ready, fmt.Sprint(100+i))
	}
	s = Drain()
	if s.Dropped != 1 || len(s.Entries) != 4 || s.Entries[0].Key != "101" || s.Entries[3].Key != "104" {
		t.Fatalf("second round: %+v", s)
	}
}

func TestCapacityIsBounded(t *testing.T) {
	Enable(MaxCapacity + 1)
	t.Cleanup(func() { Enable(0) })
	if Capacity() != MaxCapacity {
		t.Fatalf("capacity %d, want %d", Capacity(), MaxCapacity)
	}
}

func TestConcurrentWritersLoseNothingWithinCapacity(t *testing.T) {
	const writers, each = 8, 500
	Enable(writers * each)
	t.Cleanup(func() { Enable(0) })
	var wg sync.WaitGroup
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				Stamp(Hop(1+i%int(hopEnd-1)), fmt.Sprintf("%d-%d", w, i))
			}
		}()
	}
	// A reader beside the writers, as a bench drains a live process.
	var drained []Entry
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 20; i++ {
			drained = append(drained, Drain().Entries...)
		}
	}()
	wg.Wait()
	<-done
	drained = append(drained, Drain().Entries...)
	seen := map[string]bool{}
	for _, e := range drained {
		if seen[e.Key] {
			t.Fatalf("%s drained twice", e.Key)
		}
		seen[e.Key] = true
	}
	if len(seen) != writers*each {
		t.Fatalf("drained %d stamps, want %d", len(seen), writers*each)
	}
}

func TestNowIsClockMonotonic(t *testing.T) {
	var a, b unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &a); err != nil {
		t.Skip(err)
	}
	n := Now()
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &b); err != nil {
		t.Fatal(err)
	}
	// Ordering only: between two readings of the kernel's clock.
	if n < a.Nano() || n > b.Nano() {
		t.Fatalf("Now %d is not between CLOCK_MONOTONIC readings %d and %d", n, a.Nano(), b.Nano())
	}
}

func TestCapacityFromEnv(t *testing.T) {
	for v, want := range map[string]int{"": 0, "0": 0, "x": 0, "-3": 0, "1": DefaultCapacity, "4096": 4096} {
		n, ok := capacityFromEnv(v)
		if ok != (want > 0) || n != want {
			t.Errorf("%q: %d %v, want %d", v, n, ok, want)
		}
	}
}

func TestHopNames(t *testing.T) {
	for h := Hop(1); h < hopEnd; h++ {
		if names[h] == "" {
			t.Errorf("hop %d has no name", h)
		}
	}
	if Hop(0).String() != "hop(0)" || hopEnd.String() == "" {
		t.Error("an unknown hop needs a name too")
	}
}

func BenchmarkStampOff(b *testing.B) {
	Enable(0)
	for i := 0; i < b.N; i++ {
		Stamp(Ready, "h")
	}
}

func BenchmarkStampOn(b *testing.B) {
	Enable(1 << 10)
	defer Enable(0)
	for i := 0; i < b.N; i++ {
		Stamp(Ready, "h")
	}
}

// TestHopsKnownToPython: every Go hop is one of python/ecmooncake/trace.py's
// HOPS, which orders and describes the stamps ecm_trace returns by name.
func TestHopsKnownToPython(t *testing.T) {
	src, err := os.ReadFile("../../python/ecmooncake/trace.py")
	if err != nil {
		t.Fatal(err)
	}
	for h := Hop(1); h < hopEnd; h++ {
		if !strings.Contains(string(src), `("`+h.String()+`", "`) {
			t.Errorf("hop %s is missing from python/ecmooncake/trace.py HOPS", h)
		}
	}
}
