// Package config decodes and validates the settings that cross the C
// boundary as JSON: one struct per object (consumer shard, producer,
// consumer scheduler) plus the process-wide runtime settings.
//
// Settings come through these structs and never through environment
// variables read by Go: a Go runtime inside a Python process sees only the
// environment the process started with, not what Python set later.
//
// Decoding is strict. An unknown key is an error that names it, because a
// misspelt timeout silently falling back to its default is the kind of
// mistake an operator finds only under load. Every invalid value is an
// error that names the key, the value and what is allowed.
package config
