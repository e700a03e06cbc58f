package mooncake

// Availability says whether a TransferEngine library can serve this
// transport, for tools that check a host before anything is configured.
type Availability struct {
	Library   string   `json:"library"`
	Available bool     `json:"available"`
	Reason    string   `json:"reason,omitempty"`
	Symbols   []string `json:"symbols"`
}

// Probe loads the library at path (empty: DefaultLibrary on the loader's
// search path) the way New does, once per process and path, and reports
// whether it has every function the transport calls. It creates no engine.
func Probe(path string) Availability {
	if path == "" {
		path = DefaultLibrary
	}
	out := Availability{Library: path, Symbols: append([]string(nil), symbols...)}
	if _, err := load(path); err != nil {
		out.Reason = err.Error()
	} else {
		out.Available = true
	}
	return out
}
