// Command fake-vllm starts a stand-in for a vLLM instance of an EPD
// deployment (package core/proxy/fakevllm), to try the proxy without a
// GPU:
//
//	go run ./core/proxy/fakevllm/server --role encode --port 8101
//	go run ./core/proxy/fakevllm/server --role pd --port 8100
//
// It serves until interrupted.
package main
