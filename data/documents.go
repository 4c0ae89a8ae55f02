package data

// This file reads the documents of a corpus for PrepareTokenized: text
// files (one document each), JSON Lines (one document per line, a string
// field) and Parquet (one document per row, a string column), plain or
// compressed with gzip or zstd. It only splits the input into documents and
// says where each came from; parsing a JSON line and tokenizing happen on
// the workers (tokenize.go).

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"unicode/utf8"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"github.com/parquet-go/parquet-go"
	"github.com/parquet-go/parquet-go/deprecated"
	"github.com/parquet-go/parquet-go/format"
)

// InputFormat is how a corpus file holds its documents.
type InputFormat int

const (
	// FormatText is a UTF-8 text file: the whole file is one document.
	FormatText InputFormat = iota
	// FormatJSONL is JSON Lines (.jsonl, .ndjson, or .json as Hugging Face
	// datasets' to_json writes it): one JSON object per line, its text in a
	// string field; blank lines are skipped.
	FormatJSONL
	// FormatParquet is a Parquet file: one document per row, its text in a
	// string column.
	FormatParquet
)

func (f InputFormat) String() string {
	switch f {
	case FormatJSONL:
		return "jsonl"
	case FormatParquet:
		return "parquet"
	}
	return "text"
}

// Compression is how a corpus file is compressed, from its last extension.
type Compression int

const (
	Uncompressed Compression = iota
	Gzip                     // .gz
	Zstd                     // .zst or .zstd
)

// InputKind tells a corpus file's format and compression from its name:
// .gz, .zst and .zstd say the compression; then .jsonl, .ndjson and .json
// mean JSON Lines, .parquet means Parquet, anything else is text.
func InputKind(path string) (InputFormat, Compression) {
	name := strings.ToLower(filepath.Base(path))
	comp := Uncompressed
	switch ext := filepath.Ext(name); ext {
	case ".gz":
		comp = Gzip
	case ".zst", ".zstd":
		comp = Zstd
	}
	if comp != Uncompressed {
		name = strings.TrimSuffix(name, filepath.Ext(name))
	}
	switch filepath.Ext(name) {
	case ".jsonl", ".ndjson", ".json":
		return FormatJSONL, comp
	case ".parquet":
		return FormatParquet, comp
	}
	return FormatText, comp
}

// rawDoc is one document as read, before parsing and tokenizing.
type rawDoc struct {
	file  int    // index of the input file
	where int64  // the line (JSON Lines, from 1) or row (Parquet, from 0); 0 for a text file
	data  []byte // the text; for JSON Lines, the whole line
}

// docSink receives the documents of one file in order. It may keep data:
// every document has its own bytes.
type docSink func(d rawDoc) error

// progressReader counts the bytes read from a file for the progress bar.
type progressReader struct {
	r    io.Reader
	read func(n int64)
}

func (p progressReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	if n > 0 {
		p.read(int64(n))
	}
	return n, err
}

// progressReaderAt counts the bytes a Parquet reader reads.
type progressReaderAt struct {
	r    io.ReaderAt
	read func(n int64)
}

func (p progressReaderAt) ReadAt(b []byte, off int64) (int, error) {
	n, err := p.r.ReadAt(b, off)
	if n > 0 {
		p.read(int64(n))
	}
	return n, err
}

// readDocuments sends the documents of the file at path (input number
// file) to sink, in order. textKey names the JSON field or Parquet column.
// read hears of the file's bytes as they are read (on disk: compressed).
// Errors name the file, and the line or row where there is one.
func readDocuments(ctx context.Context, path string, file int, textKey string, read func(int64), sink docSink) error {
	format, comp := InputKind(path)
	if format == FormatParquet {
		if comp != Uncompressed {
			return fmt.Errorf("%s: a Parquet file compresses its own pages; decompress the file first", path)
		}
		return readParquet(ctx, path, file, textKey, read, sink)
	}
	f, err := os.Open(path)
	if err != nil {
		return err // *PathError names the file
	}
	defer f.Close()
	r, closeDecoder, err := decompressor(progressReader{r: f, read: read}, comp)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	defer closeDecoder()
	if format == FormatJSONL {
		return readJSONLines(ctx, path, r, file, sink)
	}
	text, err := io.ReadAll(r)
	if err != nil {
		return fmt.Errorf("%s: reading at byte %d of the text: %w", path, len(text), describeReadError(err, comp))
	}
	return sink(rawDoc{file: file, data: text})
}

// decompressor wraps r in the decoder comp names.
func decompressor(r io.Reader, comp Compression) (io.Reader, func(), error) {
	switch comp {
	case Gzip:
		zr, err := gzip.NewReader(r)
		if err != nil {
			return nil, nil, fmt.Errorf("not a gzip file: %w", describeReadError(err, comp))
		}
		return zr, func() { zr.Close() }, nil
	case Zstd:
		zr, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1))
		if err != nil {
			return nil, nil, err
		}
		return zr, zr.Close, nil
	}
	return r, func() {}, nil
}

// describeReadError says what a cut-off compressed stream is.
func describeReadError(err error, comp Compression) error {
	if errors.Is(err, io.ErrUnexpectedEOF) && comp != Uncompressed {
		return fmt.Errorf("%w (the compressed file is truncated)", err)
	}
	return err
}

// readJSONLines sends every non-blank line of r as a document; the workers
// parse it. Lines may be of any length.
func readJSONLines(ctx context.Context, path string, r io.Reader, file int, sink docSink) error {
	_, comp := InputKind(path)
	br := bufio.NewReaderSize(r, 1<<20)
	var line int64
	for {
		if line%1024 == 0 && ctx.Err() != nil {
			return context.Cause(ctx)
		}
		b, err := readLine(br)
		if err != nil && !errors.Is(err, io.EOF) {
			// The partial line is not a document: it was cut off.
			return fmt.Errorf("%s:%d: %w", path, line+1, describeReadError(err, comp))
		}
		if err == nil || len(b) > 0 {
			line++
		}
		if len(bytes.TrimSpace(b)) > 0 {
			if serr := sink(rawDoc{file: file, where: line, data: b}); serr != nil {
				return serr
			}
		}
		if err != nil { // io.EOF
			return nil
		}
	}
}

// readLine returns the next line of br without its line break, in memory of
// its own; io.EOF comes with the last line (maybe empty).
func readLine(br *bufio.Reader) ([]byte, error) {
	var out []byte
	for {
		chunk, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			out = append(out, chunk...)
			continue
		}
		if out == nil {
			out = make([]byte, len(chunk))
			copy(out, chunk)
		} else {
			out = append(out, chunk...)
		}
		out = bytes.TrimSuffix(out, []byte("\n"))
		out = bytes.TrimSuffix(out, []byte("\r"))
		return out, err
	}
}

// readParquet sends the values of column textKey, one document per row.
// The column must hold UTF-8 strings (Parquet's STRING, or the older UTF8
// annotation), one per row; a null is an error naming its row.
func readParquet(ctx context.Context, path string, file int, textKey string, read func(int64), sink docSink) (err error) {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	// parquet-go may panic on a damaged file; that is a bad input, not a
	// crash.
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("%s: not a readable Parquet file: %v", path, p)
		}
	}()
	pf, err := parquet.OpenFile(progressReaderAt{r: f, read: read}, st.Size(), parquet.SkipPageIndex(true), parquet.SkipBloomFilters(true))
	if err != nil {
		return fmt.Errorf("%s: not a readable Parquet file: %w", path, err)
	}
	col := pf.Root().Column(textKey)
	if col == nil {
		var names []string
		for _, c := range pf.Root().Columns() {
			names = append(names, c.Name())
		}
		return fmt.Errorf("%s: no column %q (the columns are %s; choose one with --text-key)", path, textKey, strings.Join(names, ", "))
	}
	if err := checkStringColumn(col); err != nil {
		return fmt.Errorf("%s: column %q %w", path, textKey, err)
	}
	pages := col.Pages()
	defer pages.Close()
	values := make([]parquet.Value, 256)
	var row int64
	for {
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		page, err := pages.ReadPage()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%s: row %d: %w", path, row, err)
		}
		vr := page.Values()
		for {
			n, err := vr.ReadValues(values)
			for _, v := range values[:n] {
				if v.IsNull() {
					parquet.Release(page)
					return fmt.Errorf("%s: row %d: column %q is null, not a string", path, row, textKey)
				}
				text := append([]byte(nil), v.ByteArray()...)
				if serr := sink(rawDoc{file: file, where: row, data: text}); serr != nil {
					parquet.Release(page)
					return serr
				}
				row++
			}
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				parquet.Release(page)
				return fmt.Errorf("%s: row %d: %w", path, row, err)
			}
		}
		parquet.Release(page)
	}
}

// checkStringColumn accepts a top-level column of one UTF-8 string per
// row; its error completes `column "text" ...`.
func checkStringColumn(col *parquet.Column) error {
	if !col.Leaf() {
		return errors.New("is a group of columns, not a string column")
	}
	if col.Repeated() {
		return errors.New("is a list (repeated), not one string per row")
	}
	t := col.Type()
	isString := false
	if lt := t.LogicalType(); lt != nil {
		_, isString = lt.Value.(*format.StringType)
	}
	if ct := t.ConvertedType(); ct != nil && *ct == deprecated.UTF8 {
		isString = true
	}
	if t.Kind() != parquet.ByteArray || !isString {
		return fmt.Errorf("holds %s, not strings (a BYTE_ARRAY column annotated STRING)", describeParquetType(t))
	}
	return nil
}

func describeParquetType(t parquet.Type) string {
	if lt := t.LogicalType(); lt != nil && lt.Value != nil {
		return fmt.Sprintf("%s (%s)", t.Kind(), lt)
	}
	return t.Kind().String()
}

// jsonText is the string field key of the JSON object in line: the text of
// a JSON Lines document. Its errors complete "file:line: ...".
func jsonText(line []byte, key string) (string, error) {
	if !json.Valid(line) {
		var v any
		err := json.Unmarshal(line, &v)
		if err == nil { // cannot happen: Valid and Unmarshal agree
			err = errors.New("invalid")
		}
		return "", fmt.Errorf("not valid JSON: %w", err)
	}
	i := skipSpace(line, 0)
	if line[i] != '{' {
		return "", fmt.Errorf("a JSON object per line expected, got %s", jsonKind(line[i]))
	}
	// line is valid JSON, so the scan below needs no checks of its own.
	var value []byte
	var fields []string
	i = skipSpace(line, i+1)
	for line[i] != '}' {
		end := skipValue(line, i)
		name := line[i:end]
		if bytes.IndexByte(name, '\\') >= 0 {
			var s string
			_ = json.Unmarshal(name, &s)
			name = []byte(s)
		} else {
			name = name[1 : len(name)-1]
		}
		i = skipSpace(line, end)
		i = skipSpace(line, i+1) // the ':'
		end = skipValue(line, i)
		if string(name) == key {
			value = line[i:end] // the last of repeated keys wins, as in encoding/json
		}
		if len(fields) < 20 {
			fields = append(fields, string(name))
		}
		i = skipSpace(line, end)
		if line[i] == ',' {
			i = skipSpace(line, i+1)
		}
	}
	if value == nil {
		if len(fields) == 0 {
			return "", fmt.Errorf("no %q field: the object is empty (choose the text field with --text-key)", key)
		}
		return "", fmt.Errorf("no %q field (the fields are %s; choose one with --text-key)", key, strings.Join(fields, ", "))
	}
	if value[0] != '"' {
		return "", fmt.Errorf("field %q is %s, not a string", key, jsonKind(value[0]))
	}
	inner := value[1 : len(value)-1]
	if bytes.IndexByte(inner, '\\') < 0 && utf8.Valid(inner) {
		return string(inner), nil
	}
	var s string
	if err := json.Unmarshal(value, &s); err != nil {
		return "", fmt.Errorf("field %q: %w", key, err)
	}
	return s, nil
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\r' || b[i] == '\n') {
		i++
	}
	return i
}

// skipValue returns the end of the JSON value starting at b[i], in valid
// JSON.
func skipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		for j := i + 1; j < len(b); j++ {
			switch b[j] {
			case '\\':
				j++
			case '"':
				return j + 1
			}
		}
		return len(b)
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				j = skipValue(b, j) - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1
				}
			}
		}
		return len(b)
	}
	j := i
	for j < len(b) && !strings.ContainsRune(",}] \t\r\n", rune(b[j])) {
		j++
	}
	return j
}

// jsonKind names the kind of the JSON value that starts with c.
func jsonKind(c byte) string {
	switch c {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	return "a number"
}
