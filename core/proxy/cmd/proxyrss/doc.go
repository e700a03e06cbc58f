// Command proxyrss runs one EPD proxy in a process of its own, so that
// its memory can be measured apart from the clients and backends that
// drive it: package proxy's memory test builds it (without the race
// detector, whose shadow memory would be measured too) and runs it.
//
// Usage: proxyrss CONFIG_JSON. It prints "addr HOST:PORT" once the proxy
// listens; then each line "rss" on stdin is answered "rss VMRSS VMHWM"
// (kB, from /proc/self/status: the resident set now and its peak). It
// closes the proxy and exits when stdin ends.
package main
