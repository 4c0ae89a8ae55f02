package tensorboard

// TFRecord framing: each record is its length, a checksum of the length,
// the data and a checksum of the data, so a reader can tell a record cut
// short by a crash from a whole one.

import (
	"encoding/binary"
	"hash/crc32"
	"io"
)

// maskDelta is added to the rotated CRC (TFRecord's mask): a CRC of data
// that itself holds CRCs is then not a CRC of plain data.
const maskDelta = 0xa282ead8

// MaskedCRC is the masked CRC-32C (Castagnoli) of b, as TFRecord stores it.
func MaskedCRC(b []byte) uint32 {
	crc := crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli))
	return (crc>>15 | crc<<17) + maskDelta
}

// appendRecord appends data as one TFRecord to buf.
func appendRecord(buf, data []byte) []byte {
	var length [8]byte
	binary.LittleEndian.PutUint64(length[:], uint64(len(data)))
	buf = append(buf, length[:]...)
	buf = binary.LittleEndian.AppendUint32(buf, MaskedCRC(length[:]))
	buf = append(buf, data...)
	return binary.LittleEndian.AppendUint32(buf, MaskedCRC(data))
}

// WriteRecord writes data to w as one TFRecord, in one Write.
func WriteRecord(w io.Writer, data []byte) error {
	_, err := w.Write(appendRecord(make([]byte, 0, len(data)+16), data))
	return err
}
