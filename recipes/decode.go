package recipes

// Strict decoding. The YAML is parsed into a node tree and walked beside
// engine.Config by reflection, rather than handed to yaml's own decoder,
// for three reasons: every problem is found in one pass and placed at its
// line with its field path; numbers are read strictly (yaml would truncate
// "steps: 2.5" to 2 and take "010" as octal); and the line of every value is
// kept, so that Validate's messages can point into the file too.

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"unicode/utf8"

	"go.yaml.in/yaml/v3"

	"github.com/mktrain/mktrain/engine"
)

// emptyRecipe is the problem with a recipe that sets nothing: it would
// train the built-in defaults, which is never what a user meant.
const emptyRecipe = "the recipe is empty (or only comments): start from a shipped one, " +
	"`mktrain run tiny` or a copy of recipes/tiny.yaml, and change what you need"

// decoder fills a Config from one recipe file and collects every problem.
type decoder struct {
	file  string
	errs  []error
	lines map[string]int // leaf path -> line of its value in the file
}

func (d *decoder) fail(line int, format string, args ...any) {
	d.errs = append(d.errs, &Error{File: d.file, Line: line, Err: fmt.Errorf(format, args...)})
}

// document decodes data, a recipe of one YAML document, into cfg.
func (d *decoder) document(data []byte, cfg *engine.Config) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if err == io.EOF { // an empty file, or only comments
			d.fail(0, "%s", emptyRecipe)
		} else {
			d.errs = append(d.errs, d.syntaxError(err))
		}
		return
	}
	var next yaml.Node
	switch err := dec.Decode(&next); {
	case err == nil:
		d.fail(next.Line, "a recipe is one YAML document, but a second one starts here")
		return
	case err != io.EOF:
		d.errs = append(d.errs, d.syntaxError(err))
		return
	}
	root := resolveAlias(doc.Content[0])
	if isNull(root) {
		d.fail(0, "%s", emptyRecipe)
		return
	}
	if root.Kind != yaml.MappingNode {
		d.fail(root.Line, "a recipe must be a mapping of sections (%s), not %s",
			strings.Join(fieldNames(reflect.TypeFor[engine.Config]()), ", "), describe(root))
		return
	}
	d.section(root, reflect.ValueOf(cfg).Elem(), "")
}

// yamlLine matches the line number that yaml puts in its syntax errors.
var yamlLine = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

// syntaxError turns yaml's "yaml: line 3: did not find expected key" into an
// Error placed at line 3.
func (d *decoder) syntaxError(err error) error {
	msg := err.Error()
	if m := yamlLine.FindStringSubmatch(msg); m != nil {
		line, _ := strconv.Atoi(m[1])
		return &Error{File: d.file, Line: line, Err: errors.New(m[2])}
	}
	return &Error{File: d.file, Err: errors.New(strings.TrimPrefix(msg, "yaml: "))}
}

// section decodes mapping node n into struct value v, the section at path
// ("" for the whole recipe). A section left empty keeps its defaults.
func (d *decoder) section(n *yaml.Node, v reflect.Value, path string) {
	seen := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		keyNode, valueNode := resolveAlias(n.Content[i]), resolveAlias(n.Content[i+1])
		if keyNode.Kind != yaml.ScalarNode {
			d.fail(keyNode.Line, "a key must be a plain name, not %s", describe(keyNode))
			continue
		}
		key := keyNode.Value
		fieldPath := join(path, key)
		if first, dup := seen[key]; dup {
			d.fail(keyNode.Line, "%s is set twice (first at line %d)", fieldPath, first)
			continue
		}
		seen[key] = keyNode.Line
		f, ok := fieldByName(v, key)
		if !ok {
			d.errs = append(d.errs, &Error{File: d.file, Line: keyNode.Line, Err: unknownField(key, path, v.Type())})
			continue
		}
		if !isSection(f.Type()) {
			d.leaf(valueNode, f, fieldPath)
			continue
		}
		switch {
		case isNull(valueNode):
		case valueNode.Kind == yaml.MappingNode:
			d.section(valueNode, f, fieldPath)
		default:
			d.fail(valueNode.Line, "section %s must be a mapping of its fields (%s), not %s",
				fieldPath, strings.Join(fieldNames(f.Type()), ", "), describe(valueNode))
		}
	}
}

// leaf decodes node n into the scalar field v at path.
func (d *decoder) leaf(n *yaml.Node, v reflect.Value, path string) {
	d.lines[path] = n.Line
	switch {
	case n.Kind != yaml.ScalarNode:
		d.fail(n.Line, "%s must be %s, not %s", path, wants(v.Type()), describe(n))
	case isNull(n) && v.Kind() == reflect.String:
		v.SetString("")
	case isNull(n):
		d.fail(n.Line, "%s has no value; write %s or remove the line to keep the default", path, wants(v.Type()))
	case n.Style&(yaml.DoubleQuotedStyle|yaml.SingleQuotedStyle|yaml.LiteralStyle|yaml.FoldedStyle) != 0 &&
		v.Kind() != reflect.String:
		d.fail(n.Line, "%s must be %s, not the quoted string %q; write it without quotes", path, wants(v.Type()), n.Value)
	default:
		if err := setLeaf(v, path, n.Value); err != nil {
			d.fail(n.Line, "%v", err)
		}
	}
}

// setLeaf parses text, as written in a recipe or a --set, into the scalar
// field v at path. Strings are taken as they are.
func setLeaf(v reflect.Value, path, text string) error {
	switch v.Kind() {
	case reflect.String:
		if !utf8.ValidString(text) {
			return fmt.Errorf("%s must be UTF-8 text, got %q", path, text)
		}
		v.SetString(text)
		return nil
	case reflect.Int:
		x, err := parseInt(strings.TrimSpace(text))
		if err != nil {
			return fmt.Errorf("%s must be %s, %w", path, wants(v.Type()), err)
		}
		v.SetInt(x)
		return nil
	case reflect.Uint64:
		x, err := strconv.ParseUint(strings.TrimSpace(text), 10, 64)
		if err != nil {
			return fmt.Errorf("%s must be %s, got %q", path, wants(v.Type()), text)
		}
		v.SetUint(x)
		return nil
	case reflect.Float64:
		x, err := parseFloat(strings.TrimSpace(text))
		if err != nil {
			return fmt.Errorf("%s must be %s, got %q", path, wants(v.Type()), text)
		}
		v.SetFloat(x)
		return nil
	case reflect.Bool:
		switch strings.ToLower(strings.TrimSpace(text)) {
		case "true":
			v.SetBool(true)
			return nil
		case "false":
			v.SetBool(false)
			return nil
		}
		return fmt.Errorf("%s must be %s, got %q", path, wants(v.Type()), text)
	}
	// Only a new kind of field in engine.Config gets here; the tests load a
	// recipe that sets every field, so they find it first.
	return fmt.Errorf("%s has type %s, which recipes cannot set yet", path, v.Type())
}

// parseInt reads a decimal integer, or a number in exponent form that is a
// whole number ("1e6"). Its errors finish the sentence "X must be an integer, ".
func parseInt(text string) (int64, error) {
	if x, err := strconv.ParseInt(text, 10, strconv.IntSize); err == nil {
		return x, nil
	} else if errors.Is(err, strconv.ErrRange) {
		return 0, fmt.Errorf("got %s, which is out of range", text)
	}
	f, err := strconv.ParseFloat(text, 64)
	switch {
	case err != nil || math.IsNaN(f) || math.IsInf(f, 0):
		return 0, fmt.Errorf("got %q", text)
	case f != math.Trunc(f):
		return 0, fmt.Errorf("got %s, which is not a whole number", text)
	case f < math.MinInt || f >= -math.MinInt: // -MinInt is 2^63 as a float
		return 0, fmt.Errorf("got %s, which is out of range", text)
	}
	return int64(f), nil
}

// parseFloat reads a number as strconv does, plus YAML's spellings of
// infinity and NaN (which Validate then rejects in a sentence).
func parseFloat(text string) (float64, error) {
	switch text {
	case ".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF":
		return math.Inf(1), nil
	case "-.inf", "-.Inf", "-.INF":
		return math.Inf(-1), nil
	case ".nan", ".NaN", ".NAN":
		return math.NaN(), nil
	}
	x, err := strconv.ParseFloat(text, 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		return 0, err
	}
	return x, nil // out of range: ±Inf or 0, which Validate reports
}

// wants says what a leaf of type t must be, to finish "X must be ...".
func wants(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Int:
		return "an integer"
	case reflect.Uint64:
		return "a non-negative integer"
	case reflect.Float64:
		return "a number"
	case reflect.Bool:
		return "true or false"
	case reflect.String:
		return "a string"
	}
	return "a " + t.String()
}

// describe names what node n is, for "must be X, not ...".
func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		return fmt.Sprintf("the value %q", n.Value)
	}
	return "an empty value"
}

// resolveAlias follows *name references to the node they stand for.
func resolveAlias(n *yaml.Node) *yaml.Node {
	for n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	return n
}

func isNull(n *yaml.Node) bool {
	return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null"
}
