// Package tensorboard writes TensorBoard event files: the scalars and
// histograms of a training run, readable by TensorBoard
// (`tensorboard --logdir runs`) and importable by tools that read its
// files (W&B's `wandb sync RUN_DIR`). It needs neither
// TensorFlow nor generated protobuf code: the few messages it writes are
// encoded field by field.
//
// # Use
//
//	w, err := tensorboard.Create(runDir, time.Now()) // a new events.out.tfevents.* file
//	err = w.SessionStart(step, time.Now())           // after a resume: TensorBoard drops the old file's later steps
//	err = w.Write(step, time.Now(), []tensorboard.Value{
//		tensorboard.Scalar("train/loss", 2.31),
//		tensorboard.Histogram("experts/layer0/load", h),
//	})
//	err = w.Close()
//
// The engine writes a run's files itself when a recipe sets
// log.tensorboard (engine/tensorboard.go); this package is the format.
//
// # The format
//
// An event file is a sequence of TFRecords, each
//
//	uint64 length (little-endian)
//	uint32 masked CRC-32C of the 8 length bytes
//	length bytes of data: one serialized tensorflow.Event
//	uint32 masked CRC-32C of the data
//
// where the CRC-32C uses the Castagnoli polynomial and the mask is
// ((crc >> 15) | (crc << 17)) + 0xa282ead8 (record.go). The first event of a
// file carries file_version "brain.Event:2". The messages and the fields
// written (event.go; the numbers are those of TensorFlow's event.proto,
// summary.proto and histogram.proto):
//
//	Event           1 wall_time double, 2 step int64, 3 file_version string,
//	                5 summary Summary, 7 session_log SessionLog
//	SessionLog      1 status enum (1 = START)
//	Summary         1 value repeated Value
//	Value           1 tag string, 2 simple_value float, 5 histo HistogramProto
//	HistogramProto  1 min, 2 max, 3 num, 4 sum, 5 sum_squares double,
//	                6 bucket_limit, 7 bucket packed repeated double
//
// Each Create makes a new file named events.out.tfevents.<unix seconds>.
// <host>.<pid>.<n>, never reopening an old one, so a resumed run appends
// its events to a file of its own and a file cut short by a crash stays as
// it was (TensorBoard reads it up to the last whole record). A resumed run
// writes a SessionLog START at the step it continues from; TensorBoard then
// drops the events at and after that step from the files before, which a
// crash may have left ahead of the checkpoint.
package tensorboard
