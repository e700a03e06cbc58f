// Package enum names the values of the core's small state enums the same
// way everywhere: the name the table gives a value, and "Type(n)" for a
// value it does not name, so that a corrupt value still prints.
package enum

import "strconv"

// Name returns names[v], or typ(v) when v is past the table or unnamed.
func Name[T ~uint8](typ string, names []string, v T) string {
	if int(v) < len(names) && names[v] != "" {
		return names[v]
	}
	return typ + "(" + strconv.Itoa(int(v)) + ")"
}
