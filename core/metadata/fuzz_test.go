package metadata

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"testing"

	"github.com/valyala/fasthttp"
)

// FuzzRequests feeds raw bytes, read as pipelined HTTP requests the way
// the server reads them (bodies bounded before they are read), through
// the handler of a small store, and checks after each request that the
// accounting and the limits hold and that every stored value is JSON.
func FuzzRequests(f *testing.F) {
	for _, seed := range []string{
		"PUT /metadata?key=mooncake%2Fram%2Fseg HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}",
		"GET /metadata?key=a HTTP/1.1\r\nHost: h\r\n\r\nDELETE /metadata?key=a HTTP/1.1\r\nHost: h\r\n\r\n",
		"PUT /metadata?key=a&key=b HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n[1]\r\n0\r\n\r\n",
		"PUT /metadata?key=%ZZ HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer t\r\nContent-Length: 1\r\n\r\n1",
		"PUT /metadata?key=x HTTP/1.1\r\nHost: h\r\nContent-Length: 9999999999\r\n\r\n",
		"GET /health HTTP/1.1\r\nHost: h\r\n\r\n",
	} {
		f.Add([]byte(seed), false)
		f.Add([]byte(seed), true)
	}
	f.Fuzz(func(t *testing.T, raw []byte, withToken bool) {
		cfg := Config{MaxValueBytes: 64, MaxKeys: 4, MaxTotalBytes: 200, Open: !withToken, Logger: quiet()}
		if withToken {
			cfg.Token = "t"
		}
		s, err := newServer(cfg)
		if err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(bytes.NewReader(raw))
		for range 16 {
			var ctx fasthttp.RequestCtx
			if err := ctx.Request.Header.Read(br); err != nil {
				return
			}
			limit := s.bodyLimit(&ctx.Request.Header).MaxRequestBodySize
			if err := ctx.Request.ContinueReadBody(br, limit); err != nil {
				if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
					return
				}
				s.readError(&ctx, err)
				checkStore(t, s, &ctx)
				return
			}
			s.handle(&ctx)
			checkStore(t, s, &ctx)
		}
	})
}

func checkStore(t *testing.T, s *Server, ctx *fasthttp.RequestCtx) {
	t.Helper()
	switch code := ctx.Response.StatusCode(); code {
	case 200, 400, 401, 404, 405, 413, 500, 507:
		if code == 500 {
			t.Fatalf("internal error for %q: %s", ctx.Request.String(), ctx.Response.Body())
		}
	default:
		t.Fatalf("status %d for %q", code, ctx.Request.String())
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	var n int64
	for k, v := range s.kv {
		if k == "" || len(k) > MaxKeyLen || len(v) > s.cfg.MaxValueBytes || !json.Valid(v) {
			t.Fatalf("stored %q = %q breaks the limits", k, v)
		}
		n += entrySize(k, v)
	}
	if n != s.bytes || n > s.cfg.MaxTotalBytes || len(s.kv) > s.cfg.MaxKeys {
		t.Fatalf("accounting: %d keys, %d bytes counted, %d stored (limits %d keys, %d bytes)", len(s.kv), s.bytes, n, s.cfg.MaxKeys, s.cfg.MaxTotalBytes)
	}
	if s.cfg.Token != "" && ctx.Response.StatusCode() == 200 && bytes.Equal(ctx.Path(), []byte(Path)) && !s.authorized(&ctx.Request.Header) {
		t.Fatalf("served %q without the token", ctx.Request.String())
	}
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }
