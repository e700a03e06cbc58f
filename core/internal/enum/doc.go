// Package enum names the values of the core's small state enums the same
// way everywhere: the name the table gives a value, and "Type(n)" for a
// value it does not name, so that a corrupt value still prints.
package enum
