package comm

import "crypto/rand"

// BlobSize is the size of the blob a multi-node run's node 0 hands to every
// node through the rendezvous (package launch): the run id in its first
// RunIDSize bytes (RunIDFromBlob), then, for a run on the CUDA backend, the
// NCCL world's unique id behind a short header (cuda.PutNCCLID; 136 bytes),
// and room to spare. Every node runs the same mktrain version (the
// rendezvous checks it), so they agree on the layout.
const BlobSize = 256

// RunIDSize is the length of a run's id, which tags its TCP connections.
const RunIDSize = 16

// RunIDFromBlob is the run id carried by a rendezvous blob: its first
// RunIDSize bytes (node 0 fills them with random bytes; NewRunBlob).
func RunIDFromBlob(blob [BlobSize]byte) [RunIDSize]byte {
	var id [RunIDSize]byte
	copy(id[:], blob[:RunIDSize])
	return id
}

// NewRunBlob is a rendezvous blob whose first RunIDSize bytes are a fresh
// random run id (the rest is zero until NCCL's unique id goes there).
func NewRunBlob() [BlobSize]byte {
	var b [BlobSize]byte
	_, _ = rand.Read(b[:RunIDSize]) // crypto/rand.Read never fails
	return b
}
