package consumer

import "fmt"

// CheckInvariants verifies the shard's reservation table against itself
// and the slab (reserve.Table.CheckInvariants). It walks everything, so it
// is for tests after a fault, or a debug endpoint, never a hot path.
func (s *Shard) CheckInvariants() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.table.CheckInvariants(); err != nil {
		return fmt.Errorf("consumer shard %d: %w", s.cfg.TPRank, err)
	}
	return nil
}
