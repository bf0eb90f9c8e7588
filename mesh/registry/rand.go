package registry

import "math/rand/v2"

// randN returns a uniform random number in [0, n). math/rand/v2's
// top-level functions use the runtime's per-thread generator: no lock, no
// allocation.
func randN(n uint64) uint64 { return rand.Uint64N(n) }
