// Package ids holds the small identity types every other package shares:
// reservation ids, the unguessable tokens that authorise a data-plane
// write into a reservation, and HostIdentity, the name both roles compare
// to choose a same-host data plane.
//
// A write is accepted only when it names a live reservation id together
// with that reservation's token, so tokens come from crypto/rand and are
// compared in constant time. Ids are never reused within a process: they
// come from a counter, so a late message for a finished reservation can
// never address a newer one.
package ids
