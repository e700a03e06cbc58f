// Package defaults fills in the settings a caller left out: the core's
// configurations read a zero (or negative) size, count or wait as "use
// the default".
package defaults
