package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/mktrain/mktrain/tokenizer"
)

const tokenizeUsage = `Usage: mktrain tokenize --tokenizer FILE [--json] [--decode] [--special] [TEXT]

Encodes TEXT (or standard input, when TEXT is absent) with a tokenizer and
prints its token ids, space-separated, or as a JSON array with --json. FILE
is a Hugging Face tokenizer.json (BPE, byte-level or SentencePiece-style) or
a tiktoken rank file (.tiktoken). The ids are those of the Hugging Face
tokenizers library with add_special_tokens=False: special tokens written in
the text become their ids, and --special adds the ones the tokenizer's
post-processor adds (Llama's BOS, say).

--decode reads ids instead (space- or comma-separated, or a JSON array) and
prints their text exactly, without a newline of its own (with --json, as a
JSON string on one line).

Flags:
`

func cmdTokenize(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	fs := newFlagSet("tokenize", tokenizeUsage, stderr)
	file := fs.String("tokenizer", "", "tokenizer.json or .tiktoken rank file")
	asJSON := fs.Bool("json", false, "print ids as a JSON array (with --decode: the text as a JSON string)")
	decode := fs.Bool("decode", false, "read token ids and print their text")
	special := fs.Bool("special", false, "add the post-processor's special tokens (BOS) when encoding")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if err := requireFlag(fs, "tokenizer", *file); err != nil {
		return err
	}
	if len(pos) > 1 {
		fs.Usage()
		return usageError{fmt.Sprintf("tokenize takes one TEXT argument (quote it); got %d", len(pos))}
	}
	if *decode && *special {
		return usageError{"--special applies to encoding, not to --decode"}
	}
	tok, err := tokenizer.Load(*file)
	if err != nil {
		return err
	}
	var input string
	if len(pos) == 1 {
		input = pos[0]
	} else {
		b, err := io.ReadAll(stdin)
		if err != nil {
			return fmt.Errorf("tokenize: reading standard input: %w", err)
		}
		input = string(b)
	}
	if *decode {
		ids, err := parseIDs(input)
		if err != nil {
			return err
		}
		text, err := tok.Decode(ids)
		if err != nil {
			return err
		}
		if *asJSON {
			return json.NewEncoder(stdout).Encode(text)
		}
		_, err = io.WriteString(stdout, text)
		return err
	}
	var ids []int
	if *special {
		ids = tok.EncodeWithSpecial(input)
	} else {
		ids = tok.Encode(input)
	}
	if *asJSON {
		if ids == nil {
			ids = []int{}
		}
		return json.NewEncoder(stdout).Encode(ids)
	}
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = strconv.Itoa(id)
	}
	_, err = fmt.Fprintln(stdout, strings.Join(parts, " "))
	return err
}

// parseIDs reads token ids: a JSON array, or integers separated by spaces
// and/or commas.
func parseIDs(s string) ([]int, error) {
	s = strings.TrimSpace(s)
	if strings.HasPrefix(s, "[") {
		var ids []int
		if err := json.Unmarshal([]byte(s), &ids); err != nil {
			return nil, fmt.Errorf("--decode: the input is not a JSON array of integers: %v", err)
		}
		return ids, nil
	}
	var ids []int
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' || r == '\t' || r == '\n' || r == '\r' }) {
		id, err := strconv.Atoi(f)
		if err != nil || id < 0 {
			return nil, fmt.Errorf("--decode: %q is not a token id (ids are non-negative integers)", f)
		}
		ids = append(ids, id)
	}
	return ids, nil
}
