// Package logqueuetest holds a log handler that waits as a full stderr
// pipe does, for tests of code that must never wait on its log.
package logqueuetest
