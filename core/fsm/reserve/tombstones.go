package reserve

import "github.com/ecmooncake/ecmooncake/core/ids"

// tombKey names one tombstone: a transfer id or a region id, not both.
type tombKey struct {
	transfer string
	res      ids.ResID
}

// transferTomb is what is remembered of a finished transfer: enough to
// answer Status and to repeat a grant to a producer that retries.
type transferTomb struct {
	mmHash string
	kind   Kind
	nbytes uint64
	state  State // the outcome: Ready, Cancelled or Expired
	reason string
}

// regionTomb is what is remembered of a finished region, for the error
// text a late write or complete gets.
type regionTomb struct {
	mmHash string
	state  State
	reason string
}

// tombstones is a FIFO bounded to max entries, transfers and regions
// together: the oldest is forgotten first.
type tombstones struct {
	max       int
	queue     []tombKey
	head      int
	transfers map[string]transferTomb
	regions   map[ids.ResID]regionTomb
}

func newTombstones(max int) tombstones {
	return tombstones{
		max:       max,
		transfers: make(map[string]transferTomb),
		regions:   make(map[ids.ResID]regionTomb),
	}
}

func (ts *tombstones) len() int { return len(ts.queue) - ts.head }

func (ts *tombstones) addTransfer(id string, v transferTomb) {
	_, seen := ts.transfers[id]
	ts.transfers[id] = v
	if !seen {
		ts.push(tombKey{transfer: id})
	}
}

func (ts *tombstones) addRegion(res ids.ResID, v regionTomb) {
	_, seen := ts.regions[res]
	ts.regions[res] = v
	if !seen {
		ts.push(tombKey{res: res})
	}
}

func (ts *tombstones) push(k tombKey) {
	ts.queue = append(ts.queue, k)
	for ts.len() > ts.max {
		old := ts.queue[ts.head]
		ts.queue[ts.head] = tombKey{}
		ts.head++
		if old.transfer != "" {
			delete(ts.transfers, old.transfer)
		} else {
			delete(ts.regions, old.res)
		}
	}
	// Compacting once half the backing array is dead keeps pushes
	// amortised O(1) and the array within twice the bound.
	if ts.head > 0 && ts.head >= len(ts.queue)/2 {
		n := copy(ts.queue, ts.queue[ts.head:])
		clear(ts.queue[n:])
		ts.queue = ts.queue[:n]
		ts.head = 0
	}
}
