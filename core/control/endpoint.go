package control

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"
)

const tcpScheme = "tcp://"

// ErrBadEndpoint: an endpoint that is not tcp://host:port.
var ErrBadEndpoint = errors.New("bad endpoint")

// resolveTimeout bounds a hostname lookup so that a dead resolver cannot
// hang a constructor or a Connect.
const resolveTimeout = 5 * time.Second

// Endpoint formats a ZeroMQ TCP endpoint, bracketing IPv6 literals:
// "tcp://1.2.3.4:5", "tcp://[::1]:5", "tcp://host:5".
func Endpoint(host string, port int) string {
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	return tcpScheme + net.JoinHostPort(host, strconv.Itoa(port))
}

// SplitEndpoint parses a ZeroMQ TCP endpoint into its host (IPv6 without
// brackets) and port. Host "*" (every interface) and port 0 (any free
// port) are accepted: they are valid to bind.
func SplitEndpoint(ep string) (host string, port int, err error) {
	rest, ok := strings.CutPrefix(ep, tcpScheme)
	if !ok {
		return "", 0, fmt.Errorf("control: endpoint %q: %w: want tcp://host:port", ep, ErrBadEndpoint)
	}
	host, ps, err := net.SplitHostPort(rest)
	if err != nil {
		return "", 0, fmt.Errorf("control: endpoint %q: %w: %v", ep, ErrBadEndpoint, err)
	}
	if host == "" {
		return "", 0, fmt.Errorf("control: endpoint %q: %w: empty host", ep, ErrBadEndpoint)
	}
	port, err = strconv.Atoi(ps)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("control: endpoint %q: %w: port %q not in [0, 65535]", ep, ErrBadEndpoint, ps)
	}
	return host, port, nil
}

// isLiteral reports whether host needs no lookup: an IP address (with an
// optional IPv6 zone) or the bind wildcard.
func isLiteral(host string) bool {
	if host == "*" {
		return true
	}
	ip, _, _ := strings.Cut(host, "%")
	return net.ParseIP(ip) != nil
}

// resolve returns the addresses of host in resolver order, or host itself
// when it is a literal or does not resolve: then libzmq gets the name and
// may still know it (an interface name for a bind, say).
//
// Names are resolved here rather than by libzmq because libzmq, with IPv6
// enabled, asks only for AAAA (v4-mapped) records: "localhost" would become
// ::1 even when the peer listens on 127.0.0.1.
func resolve(host string) []string {
	if isLiteral(host) {
		return []string{host}
	}
	ctx, cancel := context.WithTimeout(context.Background(), resolveTimeout)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupHost(ctx, host)
	if err != nil || len(addrs) == 0 {
		return []string{host}
	}
	return addrs
}

// connectEndpoint turns ep into the endpoint to connect to: a hostname
// becomes its first address, so that one client talks to one server even
// when the name resolves to several hosts.
func connectEndpoint(ep string) (string, error) { return concreteEndpoint("connect", ep) }

// concreteEndpoint is ep with its host resolved to its first address; a
// wildcard host or port is refused, for what ("connect", ...).
func concreteEndpoint(what, ep string) (string, error) {
	host, port, err := SplitEndpoint(ep)
	if err != nil {
		return "", err
	}
	if host == "*" || port == 0 {
		return "", fmt.Errorf("control: %s %q: %w: needs a concrete host and port", what, ep, ErrBadEndpoint)
	}
	return Endpoint(resolve(host)[0], port), nil
}
