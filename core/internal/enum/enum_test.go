package enum

import (
	"testing"

	"github.com/stretchr/testify/require"
)

type color uint8

var colorNames = []string{0: "red", 2: "blue"}

func TestName(t *testing.T) {
	require.Equal(t, "red", Name("Color", colorNames, color(0)))
	require.Equal(t, "blue", Name("Color", colorNames, color(2)))
	require.Equal(t, "Color(1)", Name("Color", colorNames, color(1)), "a hole in the table")
	require.Equal(t, "Color(200)", Name("Color", colorNames, color(200)), "past the table")
}
