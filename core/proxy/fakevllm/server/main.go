package main

import (
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/ecmooncake/ecmooncake/core/proxy/fakevllm"
)

func main() {
	role := flag.String("role", "", "encode or pd")
	host := flag.String("host", "127.0.0.1", "address to listen on")
	port := flag.Int("port", 0, "port to listen on (0 picks one)")
	model := flag.String("model", "fake-model", "model name to report")
	tokens := flag.Int("tokens", 8, "tokens per answer")
	delay := flag.Duration("token-delay", 20*time.Millisecond, "delay before each streamed token")
	flag.Parse()
	s, err := fakevllm.Start(fakevllm.Config{Role: *role, Host: *host, Port: *port, Model: *model, Tokens: *tokens, TokenDelay: *delay})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	fmt.Printf("fake vLLM %s instance listening on %s\n", *role, s.URL())
	select {}
}
