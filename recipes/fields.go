package recipes

// The recipe's shape is engine.Config's: a section is a struct field, a leaf
// is a scalar field, and the name of each is its yaml tag. This file is the
// one place that reads those tags, for the decoder, the --set overrides and
// the tests that keep docs/recipes.md in step.

import (
	"fmt"
	"reflect"
	"strings"

	"github.com/mktrain/mktrain/engine"
)

// fieldByName finds the field of struct value v whose yaml tag is name.
func fieldByName(v reflect.Value, name string) (reflect.Value, bool) {
	t := v.Type()
	for i := range t.NumField() {
		if yamlName(t.Field(i)) == name {
			return v.Field(i), true
		}
	}
	return reflect.Value{}, false
}

// fieldNames lists the yaml names of struct type t's fields, in order.
func fieldNames(t reflect.Type) []string {
	names := make([]string, 0, t.NumField())
	for i := range t.NumField() {
		names = append(names, yamlName(t.Field(i)))
	}
	return names
}

func yamlName(f reflect.StructField) string {
	name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
	return name
}

// isSection reports whether a field of type t is a section (a mapping of
// fields) rather than a leaf.
func isSection(t reflect.Type) bool { return t.Kind() == reflect.Struct }

// leaf is one scalar field of the recipe.
type leaf struct {
	path string       // "model.moe.top_k"
	typ  reflect.Type // its Go type
}

// leaves lists every scalar field of engine.Config, depth first, in the order
// of the struct (which is the order of the snapshot and the docs).
func leaves() []leaf {
	var out []leaf
	var walk func(t reflect.Type, prefix string)
	walk = func(t reflect.Type, prefix string) {
		for i := range t.NumField() {
			f := t.Field(i)
			path := prefix + yamlName(f)
			if isSection(f.Type) {
				walk(f.Type, path+".")
				continue
			}
			out = append(out, leaf{path: path, typ: f.Type})
		}
	}
	walk(reflect.TypeFor[engine.Config](), "")
	return out
}

// lookup finds the leaf at a dotted path in cfg. Its errors say which part of
// the path is wrong and what would have been right.
func lookup(cfg *engine.Config, path string) (reflect.Value, error) {
	v := reflect.ValueOf(cfg).Elem()
	section := ""
	for part := range strings.SplitSeq(path, ".") {
		if !isSection(v.Type()) {
			return reflect.Value{}, fmt.Errorf("%s is a single value and has no field %q", section, part)
		}
		f, ok := fieldByName(v, part)
		if !ok {
			return reflect.Value{}, unknownField(part, section, v.Type())
		}
		v = f
		section = join(section, part)
	}
	if isSection(v.Type()) {
		names := fieldNames(v.Type())
		return reflect.Value{}, fmt.Errorf("%s is a section; set one of its fields, for example %s.%s", path, path, names[0])
	}
	return v, nil
}

// unknownField is the error for a key that section (of struct type t; "" is
// the top level) does not have.
func unknownField(key, section string, t reflect.Type) error {
	names := fieldNames(t)
	what, list := fmt.Sprintf("unknown field %q in section %s", key, section), "fields"
	if section == "" {
		what, list = fmt.Sprintf("unknown section %q", key), "sections"
	}
	if near := nearest(key, names); near != "" {
		return fmt.Errorf("%s; did you mean %q?", what, near)
	}
	return fmt.Errorf("%s; the %s are %s", what, list, strings.Join(names, ", "))
}

// nearest is the name closest to key when it is close enough to be the one
// the user meant (a typo, a swapped pair, a missing underscore), else "".
func nearest(key string, names []string) string {
	if len(key) > 64 { // no field name is that long; spare the quadratic work
		return ""
	}
	best, bestD := "", max(len(key)/3, 1)+1
	for _, n := range names {
		if d := editDistance(key, n); d < bestD {
			best, bestD = n, d
		}
	}
	return best
}

// editDistance is the optimal-string-alignment distance between a and b:
// the fewest insertions, deletions, substitutions and swaps of neighbours.
func editDistance(a, b string) int {
	// d[i][j] is the distance between a[:i] and b[:j].
	d := make([][]int, len(a)+1)
	for i := range d {
		d[i] = make([]int, len(b)+1)
		d[i][0] = i
	}
	for j := range d[0] {
		d[0][j] = j
	}
	for i := 1; i <= len(a); i++ {
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			d[i][j] = min(d[i-1][j]+1, d[i][j-1]+1, d[i-1][j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				d[i][j] = min(d[i][j], d[i-2][j-2]+1)
			}
		}
	}
	return d[len(a)][len(b)]
}

func join(section, name string) string {
	if section == "" {
		return name
	}
	return section + "." + name
}

// kindWord says what a leaf of type t holds, for messages and the docs'
// type column.
func kindWord(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Int:
		return "integer"
	case reflect.Uint64:
		return "unsigned integer"
	case reflect.Float64:
		return "number"
	case reflect.Bool:
		return "bool"
	case reflect.String:
		return "string"
	}
	return t.String()
}
