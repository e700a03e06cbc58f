package due

import "time"

// Sleep waits for d, or until stop closes, and reports whether the whole
// wait passed: the one way a retry or backoff loop pauses, so that closing
// its owner never waits out the pause. A d of zero or less returns true at
// once, unless stop is already closed.
func Sleep(stop <-chan struct{}, d time.Duration) bool {
	if d <= 0 {
		select {
		case <-stop:
			return false
		default:
			return true
		}
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-stop:
		return false
	case <-t.C:
		return true
	}
}
