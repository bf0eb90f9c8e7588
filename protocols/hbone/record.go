package hbone

import "os"

// tlsRecord is the largest plaintext of a TLS record (RFC 8446, 5.1).
const tlsRecord = 16 << 10

// FullRecordsWrite is the largest write that a stream sends as whole TLS
// records: a DATA frame's 9-byte header and its payload fill exactly four
// records. A relay that reads 64 KiB at a time instead makes every full
// read five records, the fifth carrying the frame header's worth of bytes
// (one more system call, AEAD seal and TCP segment per 64 KiB).
const FullRecordsWrite = 4*tlsRecord - frameHeaderLen

// frameHeaderLen is the length of an HTTP/2 frame header.
const frameHeaderLen = 9

// recordFit says whether relays size their reads into streams by
// FullRecordsWrite (MESHTUN_HBONE_RECORD_FIT=1; an A/B knob).
var recordFit = os.Getenv("MESHTUN_HBONE_RECORD_FIT") == "1"

// WriteSizeHint is the largest write to c that becomes whole TLS records
// (FullRecordsWrite), or 0 for no preference.
func (c *Conn) WriteSizeHint() int {
	if recordFit {
		return FullRecordsWrite
	}
	return 0
}

// upstreamReadSize is how much the server's relay reads from the upstream
// at most with a buffer of size n.
func upstreamReadSize(n int) int {
	if recordFit && n > FullRecordsWrite {
		return FullRecordsWrite
	}
	return n
}
