// Package config decodes and validates the settings that cross the C
// boundary as JSON: one struct per object (consumer shard, producer,
// consumer scheduler) plus the process-wide runtime settings, and the
// settings of the optional second tier in Mooncake Store (store.go).
//
// Settings come through these structs and never through environment
// variables read by Go: a Go runtime inside a Python process sees only the
// environment the process started with, not what Python set later.
//
// The auth settings (auth_secret, auth_secret_file, auth_secret_dir,
// allow_unauthenticated) are the one exception to "decode, then validate": a
// secret file is read, and the per-user secret of auth_secret_dir created,
// when the object opens (Auth.LoadSecret), and a secret never appears in an
// error or a printed struct (type Secret). Which directory is the per-user
// one depends on HOME and XDG_RUNTIME_DIR, so the Python package resolves it
// and passes it down.
//
// Decoding is strict. An unknown key is an error that names it, because a
// misspelt timeout silently falling back to its default is the kind of
// mistake an operator finds only under load. Every invalid value is an
// error that names the key, the value and what is allowed.
//
// schema.go is the one source of truth for what each key means: its kind,
// range, choices and help (specs), joined by Schema with the struct fields
// and the Default* values. Validate draws its ranges from specs, and
// schema_test.go proves each listed bound is the enforced one. The schema
// is checked in as python/ecmooncake/settings.json (`go generate
// ./core/config`), from which the Python package builds its own checks
// and against which the README's settings tables are tested. Adding a
// setting: the struct field, its specs entry, go generate, a README row.
package config
