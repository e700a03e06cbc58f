package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// embedsSince is the first vLLM release (major, minor) whose consumer
// takes an embeddings-only request: 0.28 and 0.29 accept embeds without
// tensors only with --enable-mm-embeds, which they do not turn on for a
// consumer (0.30 does, in VllmConfig._resolve_mm_embedding_inputs), and
// 0.26 and 0.27 refuse them outright. Before 0.30 vLLM cannot fail a
// request whose push never comes either (no take_unavailable_requests):
// the connector lets the engine encode the item itself, which needs the
// media. So an older PD instance gets the client's media with the
// transfer parameters.
var embedsSince = [2]int{0, 30}

// takesEmbeds says whether a consumer of this vLLM version takes an
// embeddings-only request. A version it cannot read says no: the media
// works on every release.
func takesEmbeds(version string) bool {
	fields := strings.SplitN(version, ".", 3)
	if len(fields) < 2 {
		return false
	}
	major, err := strconv.Atoi(fields[0])
	if err != nil {
		return false
	}
	// "30", "30rc1", "30.dev4": the leading digits.
	minorText := fields[1]
	end := 0
	for end < len(minorText) && minorText[end] >= '0' && minorText[end] <= '9' {
		end++
	}
	minor, err := strconv.Atoi(minorText[:end])
	if err != nil {
		return false
	}
	return major > embedsSince[0] || (major == embedsSince[0] && minor >= embedsSince[1])
}

// parseVersionReply reads vLLM's GET /version answer ({"version": "..."});
// "" for anything else.
func parseVersionReply(body []byte) string {
	var reply struct {
		Version any `json:"version"`
	}
	if json.Unmarshal(body, &reply) != nil {
		return ""
	}
	v, _ := reply.Version.(string)
	return v
}

// fetchVersion asks one instance's /version. An answer that is not
// vLLM's (a 404, another body) is a known, unreadable version; only a
// failed call leaves it unknown, to be asked again. Asked once per
// instance, on a connection of its own that is closed after (the
// transport without keep-alives): the request that follows opens its own,
// as it would without this question.
func fetchVersion(ctx context.Context, b *backend, timeout time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	hr, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+b.up.addr+"/version", http.NoBody)
	if err != nil {
		return "", fmt.Errorf("version: %w", err)
	}
	resp, err := b.up.fresh.RoundTrip(hr)
	if err != nil {
		return "", fmt.Errorf("version: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if err != nil {
		return "", fmt.Errorf("version: read: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return "", nil
	}
	return parseVersionReply(body), nil
}

// consumerTakesEmbeds says whether the consumer instance b takes an
// embeddings-only request, asking its /version the first time (and again
// after it failed a health check: another release may have taken its
// place). While the version is unknown the answer is no.
func (p *Proxy) consumerTakesEmbeds(ctx context.Context, b *backend) bool {
	b.mu.Lock()
	version, known := b.version, b.versionKnown
	b.mu.Unlock()
	if !known {
		v, err := fetchVersion(ctx, b, p.cfg.healthTimeout())
		if err != nil {
			p.log.Warn("consumer version unknown: sending the media with the transfer", "url", b.reg.URL, "cause", err)
			return false
		}
		version = v
		b.mu.Lock()
		b.version, b.versionKnown = v, true
		b.mu.Unlock()
		if takesEmbeds(v) {
			p.log.Info("consumer takes embeddings-only requests", "url", b.reg.URL, "vllm", v)
		} else {
			p.log.Info("consumer gets the media with the transfer (vLLM < 0.30 takes no embeddings-only request)", "url", b.reg.URL, "vllm", v)
		}
	}
	return takesEmbeds(version)
}
