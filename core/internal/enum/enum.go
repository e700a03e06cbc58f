package enum

import "strconv"

// Name returns names[v], or typ(v) when v is past the table or unnamed.
func Name[T ~uint8](typ string, names []string, v T) string {
	if int(v) < len(names) && names[v] != "" {
		return names[v]
	}
	return typ + "(" + strconv.Itoa(int(v)) + ")"
}
