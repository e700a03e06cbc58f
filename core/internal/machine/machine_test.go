package machine

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

type light uint8

const (
	red light = iota
	green
	off
	numLights
)

func (l light) String() string { return [...]string{"red", "green", "off", "past"}[min(int(l), 3)] }

func TestEdges(t *testing.T) {
	e := NewEdges(numLights, map[light][]light{red: {green, off}, green: {red}})
	for _, c := range []struct {
		from, to light
		ok       bool
	}{
		{red, green, true}, {red, off, true}, {green, red, true},
		{red, red, false}, {green, off, false}, {off, red, false},
		{numLights, red, false}, {red, numLights, false},
	} {
		require.Equal(t, c.ok, e.Allows(c.from, c.to), "%s -> %s", c.from, c.to)
		err := e.Check(c.from, c.to)
		if c.ok {
			require.NoError(t, err)
			continue
		}
		require.True(t, errors.Is(err, ErrIllegalTransition), "%v", err)
		require.EqualError(t, err, "illegal transition: "+c.from.String()+" -> "+c.to.String())
	}
	require.Panics(t, func() { NewEdges(numLights, map[light][]light{red: {numLights}}) })
}
