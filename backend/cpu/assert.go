package cpu

import "github.com/mktrain/mktrain/backend"

var _ backend.Backend = (*Backend)(nil)
