package node

import (
	"errors"

	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/mooncake"
)

// newMooncake loads the TransferEngine library for either role; a missing
// library or symbol is ErrUnavailable, and only the objects that chose
// this transport ever see it.
func newMooncake(c mooncake.Config) (transport.Transport, error) {
	tr, err := mooncake.New(c)
	if errors.Is(err, mooncake.ErrUnavailable) {
		return nil, &kindError{kind: ErrUnavailable, err: err}
	}
	if err != nil {
		return nil, err
	}
	return tr, nil
}
