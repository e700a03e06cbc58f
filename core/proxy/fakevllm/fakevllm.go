package fakevllm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/internal/due"
)

// Roles.
const (
	RoleEncode = "encode"
	RolePD     = "pd"
)

// Fault is what the next call does instead of answering normally.
type Fault int

const (
	// Status503 answers 503 with vLLM's JSON error body.
	Status503 Fault = iota + 1
	// Status400 answers 400, a client error no retry can fix.
	Status400
	// StreamError (pd, streamed requests) sends the role chunk, then an
	// error event with code 500, then [DONE]: vLLM's shape for a request
	// that failed in the engine, e.g. an encoder output that never came.
	StreamError
	// NoParams (encode) answers 200 without ec_transfer_params, as an
	// instance that is not an EC producer does.
	NoParams
	// Hang blocks until the client goes away.
	Hang
	// Drop closes the connection without an answer.
	Drop
)

// Config sets a fake's behaviour.
type Config struct {
	Role  string
	Host  string // default 127.0.0.1
	Port  int    // 0 picks a free port
	Model string
	// Version is the vLLM release GET /version names (default 0.33.0).
	Version string
	// Tokens per answer, and the delay before each streamed token.
	Tokens     int
	TokenDelay time.Duration
	// EncodeDelay is how long an encoder takes per item.
	EncodeDelay time.Duration
	// OnEncode runs for each encoder call before it answers; an error
	// makes the call answer 500. It may push real bytes to the consumer.
	OnEncode func(ctx context.Context, e Encode) error
	// BeforeAnswer runs for each pd call with its ec_items; an error makes
	// it fail as StreamError (streamed) or Status503 does.
	BeforeAnswer func(ctx context.Context, items []ECItem) error
	// OmitModality (encode) leaves modality out of each item's entry, as
	// vLLM 0.32's encoder does.
	OmitModality bool
	// KeepAlive closes a connection idle this long, as vLLM's HTTP server
	// does after 5 s; zero keeps idle connections open.
	KeepAlive time.Duration
	// DropReused answers only the first request of each connection and
	// closes the connection unanswered on the next: what a client sees
	// when it sends on a connection the server is closing for idleness.
	DropReused bool
	// AfterDone keeps a streamed answer open this long after its [DONE]
	// event before ending it, as a server may before the last chunk of
	// the chunked encoding.
	AfterDone time.Duration
}

// Encode describes one encoder call.
type Encode struct {
	Consumer   string
	TransferID string
	Identifier string
	Modality   string
}

// ECItem is one entry of a consumer request's ec_transfer_params.ec_items.
type ECItem struct {
	MMHash     string `json:"mm_hash"`
	TransferID string `json:"transfer_id"`
}

// Call is one recorded request.
type Call struct {
	Path      string
	RequestID string
	DPRank    string
	Auth      string
	Body      []byte
}

// Server is one fake instance.
type Server struct {
	cfg Config

	mu     sync.Mutex
	addr   string
	srv    *http.Server
	ln     net.Listener
	calls  []Call
	faults []Fault
	done   chan struct{}

	healthy   atomic.Bool
	cancelled atomic.Int64
	served    atomic.Int64
	opened    atomic.Int64
	closed    atomic.Int64
}

// Start listens and serves in the background.
func Start(cfg Config) (*Server, error) {
	if cfg.Role != RoleEncode && cfg.Role != RolePD {
		return nil, fmt.Errorf("fakevllm: role %q; want %s or %s", cfg.Role, RoleEncode, RolePD)
	}
	if cfg.Host == "" {
		cfg.Host = "127.0.0.1"
	}
	if cfg.Model == "" {
		cfg.Model = "fake-model"
	}
	if cfg.Tokens <= 0 {
		cfg.Tokens = 4
	}
	s := &Server{cfg: cfg}
	s.healthy.Store(true)
	if err := s.listen(net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.Port))); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *Server) listen(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("fakevllm: listen on %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/health", s.health)
	mux.HandleFunc("/version", s.version)
	mux.HandleFunc("/v1/models", s.models)
	mux.HandleFunc("/v1/chat/completions", s.generate)
	mux.HandleFunc("/v1/completions", s.generate)
	srv := &http.Server{Handler: s.dropReused(mux), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: s.cfg.KeepAlive, ConnState: s.connState,
		ConnContext: func(ctx context.Context, _ net.Conn) context.Context {
			return context.WithValue(ctx, connRequests{}, new(atomic.Int64))
		}}
	done := make(chan struct{})
	s.mu.Lock()
	s.addr, s.srv, s.ln, s.done = ln.Addr().String(), srv, ln, done
	s.mu.Unlock()
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	return nil
}

// URL is the base URL.
func (s *Server) URL() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return "http://" + s.addr
}

// Addr is host:port.
func (s *Server) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.addr
}

// Stop closes the listener and every connection, as a crashed instance.
func (s *Server) Stop() {
	s.mu.Lock()
	srv, done := s.srv, s.done
	s.srv = nil
	s.mu.Unlock()
	if srv == nil {
		return
	}
	_ = srv.Close()
	t := time.NewTimer(5 * time.Second)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// Restart listens again on the same address after Stop.
func (s *Server) Restart() error { return s.listen(s.Addr()) }

// Close stops the server for good.
func (s *Server) Close() { s.Stop() }

// SetHealthy switches /health between 200 and 503.
func (s *Server) SetHealthy(ok bool) { s.healthy.Store(ok) }

// Inject queues faults for the next calls, one call each.
func (s *Server) Inject(f ...Fault) {
	s.mu.Lock()
	s.faults = append(s.faults, f...)
	s.mu.Unlock()
}

// Calls returns the recorded generate calls.
func (s *Server) Calls() []Call {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Call(nil), s.calls...)
}

// Reset forgets recorded calls and pending faults.
func (s *Server) Reset() {
	s.mu.Lock()
	s.calls, s.faults = nil, nil
	s.mu.Unlock()
}

// Cancelled counts calls whose client went away before the answer ended.
func (s *Server) Cancelled() int64 { return s.cancelled.Load() }

// Conns reports how many connections were accepted and how many of them
// are closed since Start.
func (s *Server) Conns() (opened, closed int64) { return s.opened.Load(), s.closed.Load() }

func (s *Server) connState(_ net.Conn, st http.ConnState) {
	switch st {
	case http.StateNew:
		s.opened.Inc()
	case http.StateClosed, http.StateHijacked:
		s.closed.Inc()
	}
}

// connRequests keys the count of requests a connection has carried.
type connRequests struct{}

func (s *Server) dropReused(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := r.Context().Value(connRequests{}).(*atomic.Int64)
		if s.cfg.DropReused && n != nil && n.Inc() > 1 {
			hijackClose(w)
			return
		}
		h.ServeHTTP(w, r)
	})
}

func hijackClose(w http.ResponseWriter) {
	if hj, ok := w.(http.Hijacker); ok {
		if c, _, err := hj.Hijack(); err == nil {
			_ = c.Close()
		}
	}
}

// Served counts calls answered in full.
func (s *Server) Served() int64 { return s.served.Load() }

func (s *Server) health(w http.ResponseWriter, r *http.Request) {
	if !s.healthy.Load() {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (s *Server) version(w http.ResponseWriter, r *http.Request) {
	v := s.cfg.Version
	if v == "" {
		v = "0.33.0"
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]string{"version": v})
}

func (s *Server) models(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []any{map[string]any{"id": s.cfg.Model, "object": "model", "owned_by": "fakevllm"}}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// vllmError writes vLLM's error body.
func vllmError(w http.ResponseWriter, status int, typ, msg string) {
	writeJSON(w, status, errorBody(status, typ, msg))
}

func errorBody(status int, typ, msg string) map[string]any {
	return map[string]any{"error": map[string]any{"message": msg, "type": typ, "param": nil, "code": status}}
}

func (s *Server) generate(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		vllmError(w, http.StatusMethodNotAllowed, "BadRequestError", "POST only")
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 512<<20))
	if err != nil {
		return
	}
	s.mu.Lock()
	s.calls = append(s.calls, Call{Path: r.URL.Path, RequestID: r.Header.Get("X-Request-Id"), DPRank: r.Header.Get("X-data-parallel-rank"), Auth: r.Header.Get("Authorization"), Body: body})
	var fault Fault
	if len(s.faults) > 0 {
		fault, s.faults = s.faults[0], s.faults[1:]
	}
	s.mu.Unlock()
	var req map[string]json.RawMessage
	if err := json.Unmarshal(body, &req); err != nil {
		vllmError(w, http.StatusBadRequest, "BadRequestError", "body is not a JSON object")
		return
	}
	switch fault {
	case Status503:
		vllmError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "injected: request failed; please retry")
		return
	case Status400:
		vllmError(w, http.StatusBadRequest, "BadRequestError", "injected: bad request")
		return
	case Hang:
		<-r.Context().Done()
		s.cancelled.Add(1)
		return
	case Drop:
		hijackClose(w)
		return
	}
	if s.cfg.Role == RoleEncode {
		s.encode(w, r, req, fault)
		return
	}
	s.answer(w, r, req, fault)
}

// Identifier is what vLLM would report for a media part: the client's
// uuid when given, else a content hash.
func Identifier(model string, part json.RawMessage) string {
	var p struct {
		UUID string `json:"uuid"`
	}
	_ = json.Unmarshal(part, &p)
	if p.UUID != "" {
		return p.UUID
	}
	var c bytes.Buffer
	_ = json.Compact(&c, part)
	sum := sha256.Sum256(append([]byte(model+"\x00"), c.Bytes()...))
	return hex.EncodeToString(sum[:16])
}

var modalityOf = map[string]string{"image_url": "image", "input_audio": "audio", "audio_url": "audio", "video_url": "video"}

// Metadata is the placeholder metadata the fake encoder reports per
// modality (what a Qwen-VL-style model needs to size its placeholders).
var Metadata = map[string]map[string]any{
	"image": {"image_grid_thw": []int{1, 8, 8}},
	"audio": {"audio_feature_lengths": []int{50}},
	"video": {"video_grid_thw": []int{2, 8, 8}},
}

func (s *Server) encode(w http.ResponseWriter, r *http.Request, req map[string]json.RawMessage, fault Fault) {
	var msgs []struct {
		Content []json.RawMessage `json:"content"`
	}
	var params struct {
		Consumer    string   `json:"consumer"`
		ConsumerZMQ string   `json:"consumer_zmq"`
		Items       []ECItem `json:"ec_items"`
	}
	_ = json.Unmarshal(req["messages"], &msgs)
	if len(msgs) != 1 || len(msgs[0].Content) != 1 {
		vllmError(w, http.StatusBadRequest, "BadRequestError", "an encoder call carries exactly one message with one media part")
		return
	}
	var model string
	_ = json.Unmarshal(req["model"], &model)
	part := msgs[0].Content[0]
	var head struct {
		Type string `json:"type"`
	}
	_ = json.Unmarshal(part, &head)
	modality, ok := modalityOf[head.Type]
	if !ok {
		vllmError(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("part type %q is not media", head.Type))
		return
	}
	if p, ok := req["ec_transfer_params"]; ok {
		_ = json.Unmarshal(p, &params)
	}
	if params.Consumer == "" {
		params.Consumer = params.ConsumerZMQ
	}
	tid := ""
	if len(params.Items) > 0 {
		tid = params.Items[0].TransferID
	}
	id := Identifier(model, part)
	if s.cfg.EncodeDelay > 0 {
		t := time.NewTimer(s.cfg.EncodeDelay)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			s.cancelled.Add(1)
			return
		}
	}
	if s.cfg.OnEncode != nil && params.Consumer != "" {
		if err := s.cfg.OnEncode(r.Context(), Encode{Consumer: params.Consumer, TransferID: tid, Identifier: id, Modality: modality}); err != nil {
			vllmError(w, http.StatusInternalServerError, "InternalServerError", "push failed: "+err.Error())
			return
		}
	}
	resp := map[string]any{
		"id": "chatcmpl-" + r.Header.Get("X-Request-Id"), "object": "chat.completion", "created": time.Now().Unix(), "model": model,
		"choices": []any{map[string]any{"index": 0, "message": map[string]any{"role": "assistant", "content": ""}, "finish_reason": "length"}},
		"usage":   map[string]any{"prompt_tokens": 70, "completion_tokens": 1, "total_tokens": 71},
	}
	if fault != NoParams && params.Consumer != "" {
		entry := map[string]any{"modality": modality, "item_indices": []int{0}, "metadata": Metadata[modality]}
		if s.cfg.OmitModality {
			delete(entry, "modality")
		}
		if tid != "" {
			entry["transfer_id"] = tid
		}
		resp["ec_transfer_params"] = map[string]any{id: entry}
	}
	s.served.Add(1)
	writeJSON(w, http.StatusOK, resp)
}

func (s *Server) answer(w http.ResponseWriter, r *http.Request, req map[string]json.RawMessage, fault Fault) {
	var stream bool
	_ = json.Unmarshal(req["stream"], &stream)
	var model string
	_ = json.Unmarshal(req["model"], &model)
	var params struct {
		Items []ECItem `json:"ec_items"`
	}
	if p, ok := req["ec_transfer_params"]; ok {
		_ = json.Unmarshal(p, &params)
	}
	var kv struct {
		DoRemoteDecode  bool `json:"do_remote_decode"`
		DoRemotePrefill bool `json:"do_remote_prefill"`
	}
	if p, ok := req["kv_transfer_params"]; ok {
		_ = json.Unmarshal(p, &kv)
	}
	// A decode instance receives the prompt's KV, not its encoder outputs,
	// so vLLM accepts metadata-only embeds there without ec_items.
	embeds, media, err := countParts(req["messages"], params.Items, kv.DoRemotePrefill)
	if err != nil {
		vllmError(w, http.StatusBadRequest, "BadRequestError", err.Error())
		return
	}
	failed := fault == StreamError
	if !failed && s.cfg.BeforeAnswer != nil {
		if err := s.cfg.BeforeAnswer(r.Context(), params.Items); err != nil {
			if !stream {
				vllmError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "encoder output unavailable: "+err.Error())
				return
			}
			failed = true
		}
	}
	chat := r.URL.Path == "/v1/chat/completions"
	text := fmt.Sprintf("fake answer with %d embeds and %d media parts", embeds, media)
	if kv.DoRemoteDecode {
		// A prefill: one token, and what the decode instance needs.
		resp := completion(chat, model, r.Header.Get("X-Request-Id"), "x", "length")
		resp["kv_transfer_params"] = map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "fake-prefill", "remote_block_ids": []int{1, 2, 3}, "remote_host": s.cfg.Host, "remote_port": 5600}
		s.served.Add(1)
		writeJSON(w, http.StatusOK, resp)
		return
	}
	if !stream {
		if failed {
			vllmError(w, http.StatusInternalServerError, "InternalServerError", "Internal server error")
			return
		}
		if !s.sleep(r.Context(), time.Duration(s.cfg.Tokens)*s.cfg.TokenDelay) {
			return
		}
		s.served.Add(1)
		writeJSON(w, http.StatusOK, completion(chat, model, r.Header.Get("X-Request-Id"), text, "stop"))
		return
	}
	s.streamAnswer(w, r, chat, model, text, failed)
}

func (s *Server) sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return true
	}
	if !due.Sleep(ctx.Done(), d) {
		s.cancelled.Add(1)
		return false
	}
	return true
}

func (s *Server) streamAnswer(w http.ResponseWriter, r *http.Request, chat bool, model, text string, failed bool) {
	fl, _ := w.(http.Flusher)
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	id := "chatcmpl-" + r.Header.Get("X-Request-Id")
	send := func(v any) bool {
		b, _ := json.Marshal(v)
		if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
			return false
		}
		if fl != nil {
			fl.Flush()
		}
		return r.Context().Err() == nil
	}
	chunk := func(delta map[string]any, text string, finish any) map[string]any {
		if chat {
			return map[string]any{"id": id, "object": "chat.completion.chunk", "model": model, "choices": []any{map[string]any{"index": 0, "delta": delta, "logprobs": nil, "finish_reason": finish}}}
		}
		return map[string]any{"id": id, "object": "text_completion", "model": model, "choices": []any{map[string]any{"index": 0, "text": text, "logprobs": nil, "finish_reason": finish}}}
	}
	if chat && !send(chunk(map[string]any{"role": "assistant", "content": ""}, "", nil)) {
		s.cancelled.Add(1)
		return
	}
	if failed {
		send(errorBody(500, "InternalServerError", "Internal server error"))
		fmt.Fprint(w, "data: [DONE]\n\n")
		return
	}
	words := splitTokens(text, s.cfg.Tokens)
	for _, tok := range words {
		if !s.sleep(r.Context(), s.cfg.TokenDelay) {
			return
		}
		if !send(chunk(map[string]any{"content": tok}, tok, nil)) {
			s.cancelled.Add(1)
			return
		}
	}
	if !send(chunk(map[string]any{}, "", "stop")) {
		s.cancelled.Add(1)
		return
	}
	// Counted before [DONE] goes out, so that a client that has read the
	// whole answer finds it counted.
	s.served.Add(1)
	fmt.Fprint(w, "data: [DONE]\n\n")
	if fl != nil {
		fl.Flush()
	}
	if s.cfg.AfterDone > 0 {
		// The answer is whole: a client leaving now cancels nothing.
		t := time.NewTimer(s.cfg.AfterDone)
		defer t.Stop()
		select {
		case <-t.C:
		case <-r.Context().Done():
		}
	}
}

// splitTokens cuts text into n pieces that join back to it.
func splitTokens(text string, n int) []string {
	words := strings.SplitAfter(text, " ")
	out := make([]string, n)
	for i, w := range words {
		out[i*n/len(words)] += w
	}
	return out
}

func completion(chat bool, model, rid, text, finish string) map[string]any {
	if chat {
		return map[string]any{"id": "chatcmpl-" + rid, "object": "chat.completion", "created": time.Now().Unix(), "model": model,
			"choices": []any{map[string]any{"index": 0, "message": map[string]any{"role": "assistant", "content": text}, "finish_reason": finish}},
			"usage":   map[string]any{"prompt_tokens": 80, "completion_tokens": 8, "total_tokens": 88}}
	}
	return map[string]any{"id": "cmpl-" + rid, "object": "text_completion", "created": time.Now().Unix(), "model": model,
		"choices": []any{map[string]any{"index": 0, "text": text, "finish_reason": finish}},
		"usage":   map[string]any{"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}}
}

// countParts counts embeds and raw media parts, and refuses an embeds part
// that names no item the consumer was told to wait for: with no media
// bytes and no pushed item, a consumer could not serve it.
func countParts(raw json.RawMessage, items []ECItem, kvOnly bool) (embeds, media int, err error) {
	if len(raw) == 0 {
		return 0, 0, nil
	}
	var msgs []struct {
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(raw, &msgs) != nil {
		return 0, 0, errors.New("messages is not a list of objects")
	}
	known := map[string]bool{}
	for _, it := range items {
		known[it.MMHash] = true
	}
	for _, m := range msgs {
		var parts []map[string]json.RawMessage
		if json.Unmarshal(m.Content, &parts) != nil {
			continue
		}
		for _, p := range parts {
			var typ, uuid string
			_ = json.Unmarshal(p["type"], &typ)
			_ = json.Unmarshal(p["uuid"], &uuid)
			switch {
			case strings.HasSuffix(typ, "_embeds"):
				// A client's own embeddings come as data (a base64 tensor
				// string); the proxy's references are metadata objects.
				var data string
				clientData := json.Unmarshal(p[typ], &data) == nil
				if !known[uuid] && !kvOnly && !clientData {
					return 0, 0, fmt.Errorf("%s part %q is metadata only but ec_transfer_params.ec_items does not name it", typ, uuid)
				}
				embeds++
			case modalityOf[typ] != "":
				media++
			}
		}
	}
	return embeds, media, nil
}
