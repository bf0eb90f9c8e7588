// Package stack is meshtun's packet path between the TUN device and the
// proxy.
//
// A dispatcher reads every packet from the TUN and asks the classifier
// (package classify) what to do with it:
//
//	verbatim  → written back into the TUN byte for byte; the kernel routes it
//	            on as if meshtun were not there (UDP, ICMP, other protocols,
//	            TCP flows meshtun does not proxy)
//	intercept → handed to a gVisor netstack, which terminates the TCP flow
//	            and gives the proxy a connection with the original addresses
//	drop      → malformed, or a new flow that does not fit the flow table
//
// The netstack runs promiscuous (it accepts connections for any address)
// and spoofing (it can originate connections from any address). Everything
// it sends goes out through the TUN, and the classifier sees it first so
// that the replies to flows the netstack originates come back to it.
package stack
