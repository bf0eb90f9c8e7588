package node

import (
	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

var testTD = spiffeid.RequireTrustDomainFromString("cluster.local")
