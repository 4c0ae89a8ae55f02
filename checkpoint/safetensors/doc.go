// Package safetensors reads and writes the safetensors tensor file format
// (https://github.com/huggingface/safetensors), the format of mktrain's
// checkpoints and of its Hugging Face exports, without holding a second copy
// of the data in memory.
//
// # Use
//
// Writing: NewWriter takes every tensor's name, dtype and shape up front
// (TensorSpec) and writes the header at once; the caller then streams each
// tensor's elements in the declared order with WriteFloat32, in as many
// chunks as it likes, and Close checks that everything declared was
// written. The writer converts through a small fixed buffer, so saving a
// model never needs a second copy of it. It writes F32 and BF16 (rounded to
// nearest, ties to even; NaN stays NaN).
//
//	w, err := safetensors.NewWriter(f, []safetensors.TensorSpec{
//		{Name: "w1", DType: safetensors.F32, Shape: []int{2, 3}},
//	}, map[string]string{"format": "pt"})
//	err = w.WriteFloat32(w1)
//	err = w.Close()
//
// Reading: Open (a path) and NewFile (an io.ReaderAt) parse and validate the
// header, with errors that name the file and the tensor; File.Float32 reads
// one tensor by name into a []float32, converting from F32, BF16, F16 or
// F64; File.Header lists the tensors (Names, Lookup). ReadHeader parses
// only the header from a stream, for compressed files that cannot be read
// at random.
//
// # Format
//
// A file is three parts, back to back:
//
//	8 bytes        N, the header length, unsigned little-endian
//	N bytes        the header: a UTF-8 JSON object, padded with spaces
//	rest           the data buffer: every tensor's raw little-endian bytes
//
// The header maps each tensor name to its element type, shape and byte range
// in the data buffer, and may hold one "__metadata__" object of string
// values:
//
//	{"__metadata__":{"format":"pt"},
//	 "w1":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},
//	 "w2":{"dtype":"BF16","shape":[3],"data_offsets":[24,30]}}
//
// data_offsets are [begin, end) relative to the start of the data buffer.
// The ranges must tile the buffer exactly: no overlaps, no holes, nothing
// after the last tensor. Tensors are row-major. This package pads the header
// with spaces so that the data buffer starts at a multiple of 8 bytes, as the
// reference implementation does.
package safetensors
