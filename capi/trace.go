package capi

import "github.com/ecmooncake/ecmooncake/core/trace"

// traceRequest is ecm_trace's input: set capacity to start a fresh ring
// (0 turns tracing off), drain to take the stamps recorded since the last
// drain.
type traceRequest struct {
	Capacity *int `json:"capacity"`
	Drain    bool `json:"drain"`
}

// traceReply is ecm_trace's answer. Each stamp is [hop, mm_hash,
// CLOCK_MONOTONIC ns]: arrays, not objects, since a bench drains tens of
// thousands at once.
type traceReply struct {
	Enabled  bool     `json:"enabled"`
	Capacity int      `json:"capacity"`
	Dropped  uint64   `json:"dropped"`
	Stamps   [][3]any `json:"stamps"`
}

// Trace applies an ecm_trace request to this process's ring of ready-path
// stamps (core/trace) and answers with its state and what it drained.
func Trace(raw []byte) ([]byte, error) {
	var req traceRequest
	if len(raw) > 0 {
		if err := unmarshal("ecm_trace request", raw, &req); err != nil {
			return nil, err
		}
	}
	if req.Capacity != nil {
		if *req.Capacity < 0 {
			return nil, statusErr(StatusInvalid, "ecm_trace: capacity %d is negative", *req.Capacity)
		}
		trace.Enable(*req.Capacity)
	}
	rep := traceReply{Enabled: trace.Enabled(), Capacity: trace.Capacity(), Stamps: [][3]any{}}
	if req.Drain {
		s := trace.Drain()
		rep.Dropped = s.Dropped
		rep.Stamps = make([][3]any, len(s.Entries))
		for i, e := range s.Entries {
			rep.Stamps[i] = [3]any{e.Hop.String(), e.Key, e.NS}
		}
	}
	return marshal(rep)
}
