// Package classify decides, per packet read from the TUN device, whether
// meshtun intercepts it (hands it to the gVisor netstack), forwards it
// verbatim (writes the same bytes back into the TUN so the kernel routes it
// on as if meshtun were not there) or drops it. It takes the place of the
// iptables rules and the conntrack table a sidecar or ztunnel would use.
//
// Packets are raw IPv4 or IPv6 datagrams (no link or packet-info header).
// The rules, in order:
//
//   - Malformed packets are dropped with a [DropReason]: shorter than the
//     fixed IP header, a version nibble other than 4 or 6, an IPv4 header
//     length below 5 words or beyond the packet, an IP length field that
//     disagrees with the packet, a truncated or over-long IPv6 extension
//     header chain, a truncated TCP header or a TCP data offset below 5.
//   - Fragments of TCP segments (IPv4 MF or offset set with protocol TCP;
//     an IPv6 Fragment header whose next header is TCP or an extension
//     header) are dropped with [FragmentedTCP]: their ports cannot be seen,
//     and verbatim they would let a reassembled connection bypass the mesh.
//   - Everything that is not TCP is verbatim: UDP, ICMP, ICMPv6 and any other
//     protocol, fragmented or not. IPv6 hop-by-hop, routing and destination
//     options headers are skipped (at most 8 of them) to find TCP.
//   - A TCP SYN (SYN set; ACK, RST and FIN clear) that the [Policy] selects
//     starts an intercepted flow. Every later packet of that flow, in either
//     direction, is intercepted.
//   - The netstack reports each packet it writes to the TUN through
//     [Classifier.Outbound]. An outbound SYN registers a flow the netstack
//     originated, so that the replies arriving from the TUN are intercepted.
//   - Any other TCP packet of no known flow is intercepted if the policy
//     would select the connection whichever side opened it (both
//     orientations): no verbatim connection can carry it, and the netstack
//     answers it with a RST unless it has the connection. Otherwise (one of a
//     flow that was not intercepted, a reply to a connection the node itself
//     opened, a SYN the policy does not select) it is verbatim.
//   - A RST whose sequence number is outside its flow's window (RFC 5961
//     §3) is dropped with [RSTOutOfWindow]; it neither ends the flow nor
//     reaches either end.
//
// Flows live in a bounded table. When it is full, a SYN that would be
// intercepted is dropped with [TableFull] rather than let through verbatim:
// mesh traffic must never bypass the mesh. Before giving up it evicts the
// longest-closed flow of the table shard the new flow hashes to, if there is
// one. Half-open flows (the initiator has not acknowledged the responder's
// SYN: a SYN-ACK alone does not establish a flow) are bounded per source
// ([Config.MaxHalfOpenPerSource], [HalfOpenPerSource]) and in total
// ([Config.MaxHalfOpen]): at the bound, a SYN from a source with fewer
// pending handshakes displaces one of a source with more, else it is
// dropped with [HalfOpenFull]. They expire after [Config.SynTimeout].
//
// The netstack holds the flows of its connections ([Classifier.Own]): such a
// flow neither expires nor ends on FIN or RST, only on [Classifier.Release].
// Other established flows expire after [Config.IdleTimeout] without packets.
// A flow that was released, saw an in-window RST, or a FIN in both
// directions, closes and is removed [Config.CloseTimeout] after that;
// packets still in flight in that grace period keep going to the netstack.
// Expiry happens only in [Classifier.Sweep], which also advances the coarse
// clock the per-packet path reads instead of calling time.Now.
//
// Inbound, Outbound and Sweep are safe for concurrent use; the table is
// split into mutex-protected shards. The per-packet paths do not allocate.
package classify
