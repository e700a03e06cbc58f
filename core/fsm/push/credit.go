package push

import "time"

// Shared reports whether more than one live transfer carries mmHash. A
// runtime that takes regions without asking the shard (the standing
// credit of core/producer) leaves such content to reservations: their
// grants tell the manager which write each transfer follows, so that a
// write others follow is not given up under them.
func (m *Manager) Shared(mmHash string) bool {
	c := m.contents[mmHash]
	return c != nil && len(c.transfers) > 1
}

// FollowsAt tells the manager that the shard made the provisional write
// of (transferID, dest) follow another push's write of its content (its
// claim was answered follower): that write is then followed, as if the
// reservation had been answered so, and is not given up under it. Call it
// before the record's write is reported.
func (m *Manager) FollowsAt(transferID, dest string, now time.Time) {
	m.advance(now)
	if r := m.find(transferID, dest); r != nil && !r.state.Terminal() {
		m.noteFollower(r, now)
	}
}
