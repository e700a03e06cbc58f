package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
)

// sseReader splits a text/event-stream body into events.
type sseReader struct{ br *bufio.Reader }

func newSSEReader(r io.Reader) *sseReader { return &sseReader{br: bufio.NewReaderSize(r, 32<<10)} }

// maxEvent bounds one event; vLLM's chunks are a few hundred bytes, a
// chunk with many logprobs a few tens of kilobytes.
const maxEvent = 16 << 20

var errEventTooLarge = errors.New("stream event larger than 16 MiB")

// next returns the next event with its terminating blank line, or io.EOF
// after the last one. A body that ends without a blank line yields what it
// had as a last event.
func (s *sseReader) next() ([]byte, error) {
	var ev []byte
	for {
		line, err := s.br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			ev = append(ev, line...)
			if len(ev) > maxEvent {
				return nil, errEventTooLarge
			}
			continue
		}
		ev = append(ev, line...)
		if err != nil {
			if errors.Is(err, io.EOF) && len(bytes.TrimSpace(ev)) > 0 {
				return ev, nil
			}
			return nil, err
		}
		if len(ev) > maxEvent {
			return nil, errEventTooLarge
		}
		if len(bytes.TrimRight(line, "\r\n")) == 0 {
			if len(bytes.TrimSpace(ev)) == 0 {
				ev = ev[:0] // stray blank lines between events
				continue
			}
			return ev, nil
		}
	}
}

// eventKind says what an event means for the retry decision.
type eventKind int

const (
	// eventHold carries nothing generated yet (vLLM's first chunk names
	// only the role): it is held back, so a failure that follows it can
	// still be retried.
	eventHold eventKind = iota
	// eventCommit carries output: from here on the answer goes to the
	// client and cannot be retried.
	eventCommit
	// eventRetry is an error the consumer reports before any output, of a
	// kind worth another attempt (5xx: vLLM's retryable failures, an
	// encoder output that did not arrive).
	eventRetry
)

// classify reads one event. Only events before the first commit are
// parsed; after it the proxy copies bytes.
func classify(ev []byte) (eventKind, string) {
	var data []byte
	for _, line := range bytes.Split(ev, []byte("\n")) {
		line = bytes.TrimRight(line, "\r")
		if d, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			data = append(data, bytes.TrimPrefix(d, []byte(" "))...)
		}
	}
	data = bytes.TrimSpace(data)
	if len(data) == 0 {
		return eventHold, "" // a comment or keep-alive
	}
	if string(data) == "[DONE]" {
		return eventCommit, ""
	}
	var chunk struct {
		Error   *upstreamError `json:"error"`
		Choices []struct {
			Delta struct {
				Content          *string         `json:"content"`
				ReasoningContent *string         `json:"reasoning_content"`
				Reasoning        *string         `json:"reasoning"`
				ToolCalls        json.RawMessage `json:"tool_calls"`
			} `json:"delta"`
			Text         *string         `json:"text"`
			FinishReason *string         `json:"finish_reason"`
			Logprobs     json.RawMessage `json:"logprobs"`
		} `json:"choices"`
		Usage json.RawMessage `json:"usage"`
	}
	if json.Unmarshal(data, &chunk) != nil {
		return eventCommit, ""
	}
	if chunk.Error != nil {
		if chunk.Error.retryable() {
			return eventRetry, chunk.Error.Message
		}
		return eventCommit, ""
	}
	for _, c := range chunk.Choices {
		d := c.Delta
		if nonEmpty(d.Content) || nonEmpty(d.ReasoningContent) || nonEmpty(d.Reasoning) || nonEmpty(c.Text) ||
			c.FinishReason != nil || isSet(d.ToolCalls) || isSet(c.Logprobs) {
			return eventCommit, ""
		}
	}
	if len(chunk.Choices) == 0 && isSet(chunk.Usage) {
		return eventCommit, ""
	}
	return eventHold, ""
}

func nonEmpty(s *string) bool { return s != nil && *s != "" }

func isSet(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) > 0 && string(t) != "null" && string(t) != "[]"
}

// upstreamError is vLLM's error object.
type upstreamError struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Code    any    `json:"code"`
}

func (e *upstreamError) retryable() bool {
	switch c := e.Code.(type) {
	case float64:
		return c >= 500
	case string:
		return len(c) == 3 && c[0] == '5'
	}
	return e.Type == "InternalServerError" || e.Type == "ServiceUnavailableError"
}

// retryableStatus reports whether a non-streamed answer may be retried.
func retryableStatus(code int) bool { return code >= 500 && code <= 599 }
