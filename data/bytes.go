package data

import "fmt"

// ByteVocab is the byte-level tokenizer's vocabulary: token t is byte t.
const ByteVocab = 256

// EncodeBytes is the byte-level tokenizer: one token per byte.
func EncodeBytes(b []byte) []uint32 {
	ts := make([]uint32, len(b))
	for i, c := range b {
		ts[i] = uint32(c)
	}
	return ts
}

// DecodeBytes inverts EncodeBytes. A token >= ByteVocab (which a model with
// a larger vocabulary may produce) is an error naming its position.
func DecodeBytes(tokens []uint32) ([]byte, error) {
	b := make([]byte, len(tokens))
	for i, t := range tokens {
		if t >= ByteVocab {
			return nil, fmt.Errorf("token %d at position %d is not a byte (>= %d)", t, i, ByteVocab)
		}
		b[i] = byte(t)
	}
	return b, nil
}
