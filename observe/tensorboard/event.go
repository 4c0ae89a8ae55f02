package tensorboard

// The protobuf messages of an event file, encoded field by field with
// protowire (the field numbers are in doc.go).

import (
	"math"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
)

// FileVersion is the file_version of the first event of every file.
const FileVersion = "brain.Event:2"

// Field numbers of the messages written.
const (
	eventWallTime    = 1
	eventStep        = 2
	eventFileVersion = 3
	eventSummary     = 5
	eventSessionLog  = 7

	sessionLogStatus = 1
	sessionLogStart  = 1 // SessionLog.SessionStatus START

	summaryValue = 1

	valueTag         = 1
	valueSimpleValue = 2
	valueHisto       = 5

	histoMin         = 1
	histoMax         = 2
	histoNum         = 3
	histoSum         = 4
	histoSumSquares  = 5
	histoBucketLimit = 6
	histoBucket      = 7
)

// Value is one tagged value of a summary: a scalar or a histogram (make
// one with Scalar or Histogram).
type Value struct {
	Tag    string
	scalar float32
	histo  *HistogramData
}

// Scalar is a scalar value. TensorBoard stores scalars as float32.
func Scalar(tag string, v float64) Value { return Value{Tag: tag, scalar: float32(v)} }

// Histogram is a histogram value.
func Histogram(tag string, h HistogramData) Value { return Value{Tag: tag, histo: &h} }

// HistogramData is a histogram as TensorBoard takes it: Counts[i] is the
// weight of the bucket that ends at Limits[i] (inclusive) and starts after
// Limits[i-1] (the first bucket starts at Min); Num, Sum and SumSquares are
// the count, sum and sum of squares of the values.
type HistogramData struct {
	Min, Max             float64
	Num, Sum, SumSquares float64
	Limits, Counts       []float64
}

// appendEvent appends an Event with wall time and step, and whatever
// body appends (the fields of its oneof "what").
func appendEvent(b []byte, wall time.Time, step int64, body func([]byte) []byte) []byte {
	b = protowire.AppendTag(b, eventWallTime, protowire.Fixed64Type)
	seconds := float64(wall.Unix()) + float64(wall.Nanosecond())/1e9
	b = protowire.AppendFixed64(b, math.Float64bits(seconds))
	if step != 0 {
		b = protowire.AppendTag(b, eventStep, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(step))
	}
	return body(b)
}

func appendFileVersion(b []byte) []byte {
	b = protowire.AppendTag(b, eventFileVersion, protowire.BytesType)
	return protowire.AppendString(b, FileVersion)
}

func appendSessionStart(b []byte) []byte {
	var log []byte
	log = protowire.AppendTag(log, sessionLogStatus, protowire.VarintType)
	log = protowire.AppendVarint(log, sessionLogStart)
	b = protowire.AppendTag(b, eventSessionLog, protowire.BytesType)
	return protowire.AppendBytes(b, log)
}

// appendSummary appends the event's summary of values.
func appendSummary(b []byte, values []Value) []byte {
	var summary []byte
	for _, v := range values {
		summary = protowire.AppendTag(summary, summaryValue, protowire.BytesType)
		summary = protowire.AppendBytes(summary, encodeValue(v))
	}
	b = protowire.AppendTag(b, eventSummary, protowire.BytesType)
	return protowire.AppendBytes(b, summary)
}

func encodeValue(v Value) []byte {
	var b []byte
	b = protowire.AppendTag(b, valueTag, protowire.BytesType)
	b = protowire.AppendString(b, v.Tag)
	if v.histo == nil {
		b = protowire.AppendTag(b, valueSimpleValue, protowire.Fixed32Type)
		return protowire.AppendFixed32(b, math.Float32bits(v.scalar))
	}
	b = protowire.AppendTag(b, valueHisto, protowire.BytesType)
	return protowire.AppendBytes(b, encodeHistogram(*v.histo))
}

func encodeHistogram(h HistogramData) []byte {
	var b []byte
	for _, f := range []struct {
		num protowire.Number
		v   float64
	}{{histoMin, h.Min}, {histoMax, h.Max}, {histoNum, h.Num}, {histoSum, h.Sum}, {histoSumSquares, h.SumSquares}} {
		b = protowire.AppendTag(b, f.num, protowire.Fixed64Type)
		b = protowire.AppendFixed64(b, math.Float64bits(f.v))
	}
	b = appendPackedDoubles(b, histoBucketLimit, h.Limits)
	return appendPackedDoubles(b, histoBucket, h.Counts)
}

// appendPackedDoubles appends a packed repeated double field.
func appendPackedDoubles(b []byte, num protowire.Number, vs []float64) []byte {
	packed := make([]byte, 0, 8*len(vs))
	for _, v := range vs {
		packed = protowire.AppendFixed64(packed, math.Float64bits(v))
	}
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendBytes(b, packed)
}
