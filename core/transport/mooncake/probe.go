package mooncake

// Availability says whether a TransferEngine library can serve this
// transport, for tools that check a host before anything is configured.
type Availability struct {
	// RegistersGPU says whether the engine is a CUDA build, which registers
	// GPU memory (a GPU slab on the consumer, GPU staging on the producer);
	// GPUReason says how that was read.
	RegistersGPU bool   `json:"registers_gpu"`
	GPUReason    string `json:"gpu_reason,omitempty"`

	Library   string   `json:"library"`
	Engine    string   `json:"engine,omitempty"`
	Version   string   `json:"version,omitempty"`
	Available bool     `json:"available"`
	Reason    string   `json:"reason,omitempty"`
	Symbols   []string `json:"symbols"`
	// Wheel is what the shim decided about the wheel's version (whether
	// it was checked against it, the warning it loaded with); nil without
	// a wheel or before the shim got to decide.
	Wheel *WheelCheck `json:"wheel,omitempty"`
}

// Probe loads the library at path (empty: DefaultLibrary on the loader's
// search path), and the wheel's engine.so through it when engine is set,
// the way New does, once per process and path, and reports whether it has
// every function the transport calls. It creates no engine.
func Probe(path, engine string) Availability {
	if path == "" {
		path = DefaultLibrary
	}
	out := Availability{Library: path, Engine: engine, Symbols: append([]string(nil), symbols...)}
	out.RegistersGPU, out.GPUReason = gpuSupport(Config{Library: path, Engine: engine})
	if engine != "" {
		out.Version, _ = WheelVersion(engine)
	}
	l, err := load(path, engine)
	if err != nil {
		out.Reason = err.Error()
		return out
	}
	out.Available = true
	if engine != "" {
		wc := l.wheel
		out.Wheel = &wc
	}
	return out
}
