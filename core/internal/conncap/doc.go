// Package conncap decides which connection goes when a server is full:
// the admission rule every port that accepts connections from anybody
// shares (the control plane's ZeroMQ sockets and the Mooncake metadata
// store), so that a flood of connections that prove nothing can neither
// lock out the peers of the deployment nor grow without bound.
//
// # The rule
//
// A server holds at most Max connections, and one peer address at most
// PerPeer of them. A connection is unproven until the server has seen
// it prove itself (Prove: a request with the token; or, with Young set,
// having lived past the handshake deadline, which a connection that
// failed its handshake does not) and it is not in the middle of a
// request (Busy). When a newcomer puts the server over a limit, one
// unproven connection makes room:
//
//   - over the address's share: that address's own longest-waiting
//     unproven connection;
//   - over Max: the longest-waiting unproven connection of the
//     newcomer's own address when it holds another, else of the address
//     holding the most unproven ones (on a tie, the address whose
//     candidate waited longest), so a flood makes room from its own
//     connections, never from another address's;
//   - with none of those unproven, the newcomer itself is refused.
//
// "Longest waiting" counts from the accept, or from the end of the last
// request (Busy(false)): a peer that just asked something is the last
// to go. A proven or busy connection is never chosen.
//
// # Invariants
//
//   - A Table does no I/O and reads no clock: the owner passes the time,
//     closes the victim and serializes calls (it is not safe for
//     concurrent use).
//   - After Accepted returns, the table holds at most Max entries and no
//     address more than PerPeer; the victim, if any, is already out of it.
//   - The decision depends only on the calls made, never on map order.
package conncap
