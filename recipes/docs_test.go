package recipes

import (
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/engine"
)

// docRow matches a row of a field table in docs/recipes.md:
// | `model.moe.top_k` | integer | `2` | meaning |
var docRow = regexp.MustCompile("^\\| `([a-z0-9_]+(?:\\.[a-z0-9_]+)+)` \\| ([^|]+) \\| `([^`]*)` \\|")

// TestDocsMatchConfig keeps docs/recipes.md in step with engine.Config:
// one row per field, none for a field that does not exist, and each row's
// type and default true.
func TestDocsMatchConfig(t *testing.T) {
	doc := string(mustRead(t, "../docs/recipes.md"))
	rows := map[string][]string{}
	for line := range strings.Lines(doc) {
		if m := docRow.FindStringSubmatch(strings.TrimSpace(line)); m != nil {
			if _, dup := rows[m[1]]; dup {
				t.Errorf("docs/recipes.md has two rows for %s", m[1])
			}
			rows[m[1]] = m[2:]
		}
	}
	def := engine.DefaultConfig()
	for _, l := range leaves() {
		row, ok := rows[l.path]
		if !ok {
			t.Errorf("docs/recipes.md has no row for %s", l.path)
			continue
		}
		delete(rows, l.path)
		typ, text := strings.TrimSpace(row[0]), row[1]
		if want := kindWord(l.typ); typ != want {
			t.Errorf("docs/recipes.md gives %s the type %q, want %q", l.path, typ, want)
		}
		want, _ := lookup(&def, l.path)
		got := reflect.New(l.typ).Elem()
		var err error
		if l.typ.Kind() == reflect.String {
			var s string
			if s, err = strconv.Unquote(text); err == nil {
				got.SetString(s)
			}
		} else {
			err = setLeaf(got, l.path, text)
		}
		if err != nil || !reflect.DeepEqual(got.Interface(), want.Interface()) {
			t.Errorf("docs/recipes.md gives %s the default `%s`, want %v (%v)", l.path, text, want, err)
		}
	}
	for path := range rows {
		t.Errorf("docs/recipes.md has a row for %s, which engine.Config does not have", path)
	}
}
