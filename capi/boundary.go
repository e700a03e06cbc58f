package capi

// MaxSources bounds the items of one ecm_producer_sources_device call
// (ECM_MAX_SOURCES): one model step's encoder outputs are a few hundred
// at most, and a count from a caller that lies must be refused before it
// sizes an allocation the runtime cannot make (which aborts the process).
const MaxSources = 1 << 16

// maxSpanBytes bounds the length of a caller's (pointer, nbytes): no user
// address space reaches past 2^57 (five-level paging; 2^47 with four), so
// a larger length is a bug in the caller, not memory.
const maxSpanBytes = 1 << 57

// NotNil refuses a NULL pointer parameter; exports check every one before
// any work, so that nothing is opened that the caller could not close.
func NotNil(fn, param string, ok bool) error {
	if !ok {
		return statusErr(StatusInvalid, "%s: %s is NULL", fn, param)
	}
	return nil
}

// Count checks an item count from C and returns it as an int.
func Count(fn string, n uint64) (int, error) {
	if n > MaxSources {
		return 0, statusErr(StatusInvalid, "%s: n = %d items; at most %d (ECM_MAX_SOURCES) per call", fn, n, MaxSources)
	}
	return int(n), nil
}

// Span checks a caller's (pointer, nbytes) before the library views it.
func Span(fn, what string, p uintptr, n uint64) error {
	switch {
	case n == 0:
		return nil
	case p == 0:
		return statusErr(StatusInvalid, "%s: %s is NULL but its length is %d bytes", fn, what, n)
	case n > maxSpanBytes || uint64(p)+n < uint64(p):
		return statusErr(StatusInvalid, "%s: %s: nbytes = %d from 0x%x is beyond the address space", fn, what, n, p)
	}
	return nil
}
