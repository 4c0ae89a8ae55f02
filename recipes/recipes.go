package recipes

import (
	"bytes"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/mktrain/mktrain/engine"
)

// shipped holds the recipes that come with mktrain, addressable by name.
//
//go:embed *.yaml
var shipped embed.FS

// An Error is one problem with a recipe, placed as precisely as it can be.
// Parse returns every problem it finds, joined with errors.Join; each is an
// *Error, and one that Validate found wraps its *engine.FieldError. Load
// returns the same, or a plain error when it cannot read the file.
type Error struct {
	File     string // the recipe's path as given, or recipes/NAME.yaml for a shipped one
	Line     int    // the line in File, 1-based; 0 when the problem has no single place there
	Override string // the --set argument that caused the problem, if one did
	Err      error  // the problem, as a sentence
}

// Error reads "file:line: --set k=v: sentence", leaving out what is unknown.
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Line > 0 {
		b.WriteString(":" + strconv.Itoa(e.Line))
	}
	b.WriteString(": ")
	if e.Override != "" {
		b.WriteString("--set " + e.Override + ": ")
	}
	b.WriteString(e.Err.Error())
	return b.String()
}

func (e *Error) Unwrap() error { return e.Err }

// Load reads the recipe in file, applies overrides ("key.path=value", as
// given to --set) and validates the result. When there is no such file and
// file names a shipped recipe ("tiny", "tiny.yaml" or "recipes/tiny.yaml"),
// the shipped one is used. It returns the configuration and its snapshot:
// the effective recipe as YAML, for the run directory.
func Load(file string, overrides []string) (engine.Config, []byte, error) {
	data, err := readRecipe(file)
	if errors.Is(err, fs.ErrNotExist) {
		if name, ok := shippedName(file); ok {
			data, err = shipped.ReadFile(name + ".yaml")
			if err != nil { // cannot happen: shippedName checked it is there
				return engine.Config{}, nil, fmt.Errorf("shipped recipe %s: %w", name, err)
			}
			return Parse("recipes/"+name+".yaml", data, overrides)
		}
		return engine.Config{}, nil, fmt.Errorf("recipe %s: no such file, and not a shipped recipe (%s)",
			file, strings.Join(Shipped(), ", "))
	}
	if err != nil {
		return engine.Config{}, nil, fmt.Errorf("recipe %s: %w", file, err)
	}
	return Parse(file, data, overrides)
}

// MaxRecipeBytes bounds the recipe file Load reads: recipes are a few
// hundred bytes, and a bound keeps a wrong path (/dev/zero, a data shard)
// from being read into memory.
const MaxRecipeBytes = 1 << 20

// maxProblems bounds the problems Parse reports; a count of the rest
// follows them.
const maxProblems = 20

// readRecipe reads file, refusing one larger than MaxRecipeBytes.
func readRecipe(file string) ([]byte, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxRecipeBytes+1))
	if err != nil {
		return nil, err
	}
	if len(data) > MaxRecipeBytes {
		return nil, fmt.Errorf("larger than %d bytes; a recipe is a short YAML file (is this the right path?)", MaxRecipeBytes)
	}
	return data, nil
}

// firstProblems keeps the first maxProblems of errs and says how many
// more there were.
func firstProblems(file string, errs []error) []error {
	if len(errs) <= maxProblems {
		return errs
	}
	rest := len(errs) - maxProblems
	return append(errs[:maxProblems:maxProblems], &Error{File: file, Err: fmt.Errorf("and %d more problems", rest)})
}

// Parse is Load for a recipe held in memory; name is what its errors call it.
func Parse(name string, data []byte, overrides []string) (engine.Config, []byte, error) {
	cfg := engine.DefaultConfig()
	d := decoder{file: name, lines: map[string]int{}}
	d.document(data, &cfg)
	set := d.override(&cfg, overrides)
	if len(d.errs) > 0 {
		return engine.Config{}, nil, errors.Join(firstProblems(d.file, d.errs)...)
	}
	if err := cfg.Validate(); err != nil {
		return engine.Config{}, nil, d.place(err, set)
	}
	return cfg, snapshot(name, overrides, cfg), nil
}

// override applies each "key.path=value" to cfg in order (a later one wins)
// and returns which --set argument last set each path.
func (d *decoder) override(cfg *engine.Config, overrides []string) map[string]string {
	set := map[string]string{}
	for _, o := range overrides {
		fail := func(err error) { d.errs = append(d.errs, &Error{File: d.file, Override: o, Err: err}) }
		key, value, ok := strings.Cut(o, "=")
		key = strings.TrimSpace(key)
		if !ok || key == "" {
			fail(errors.New("an override is key.path=value, for example train.lr=3e-4"))
			continue
		}
		v, err := lookup(cfg, key)
		if err != nil {
			fail(err)
			continue
		}
		if err := setLeaf(v, key, value); err != nil {
			fail(err)
			continue
		}
		set[key] = o
	}
	return set
}

// place turns Validate's joined *engine.FieldErrors into *Errors that point
// at the line that set the field, or at the --set that did.
func (d *decoder) place(err error, set map[string]string) error {
	var problems []error
	if joined, ok := err.(interface{ Unwrap() []error }); ok {
		problems = joined.Unwrap()
	} else {
		problems = []error{err}
	}
	out := make([]error, 0, len(problems))
	for _, p := range problems {
		e := &Error{File: d.file, Err: p}
		var fe *engine.FieldError
		if errors.As(p, &fe) {
			if o, ok := set[fe.Field]; ok {
				e.Override = o
			} else {
				e.Line = d.lines[fe.Field]
			}
		}
		out = append(out, e)
	}
	return errors.Join(out...)
}

// Shipped lists the names of the recipes that come with mktrain.
func Shipped() []string {
	entries, _ := shipped.ReadDir(".") // an embed.FS root always reads
	var names []string
	for _, e := range entries {
		names = append(names, strings.TrimSuffix(e.Name(), ".yaml"))
	}
	slices.Sort(names)
	return names
}

// shippedName maps "tiny", "tiny.yaml", "recipes/tiny.yaml" and
// "./recipes/tiny.yaml" to "tiny" when that recipe is shipped.
func shippedName(p string) (string, bool) {
	p = path.Clean(strings.ReplaceAll(p, `\`, "/"))
	p = strings.TrimPrefix(p, "recipes/")
	p = strings.TrimSuffix(p, ".yaml")
	if slices.Contains(Shipped(), p) {
		return p, true
	}
	return "", false
}

// Canonical is cfg as YAML with every field, in the order of engine.Config
// and without comments: the form that Hash digests and snapshots hold.
// Parsing it gives cfg back.
func Canonical(cfg engine.Config) []byte {
	var b bytes.Buffer
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	if err := enc.Encode(cfg); err != nil {
		// Config holds only ints, floats, strings and bools, which always encode.
		panic(fmt.Sprintf("recipes: encoding %T: %v", cfg, err))
	}
	if err := enc.Close(); err != nil {
		panic(fmt.Sprintf("recipes: encoding %T: %v", cfg, err))
	}
	return b.Bytes()
}

// Hash identifies a configuration: the first 16 hex digits of the SHA-256 of
// its canonical YAML. Any change to any field changes it.
func Hash(cfg engine.Config) string {
	sum := sha256.Sum256(Canonical(cfg))
	return hex.EncodeToString(sum[:])[:16]
}

// snapshot is the canonical YAML under a comment that says where it came from.
func snapshot(name string, overrides []string, cfg engine.Config) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "# The effective recipe: %s", strconv.Quote(name))
	for _, o := range overrides {
		fmt.Fprintf(&b, " --set %s", strconv.Quote(o))
	}
	fmt.Fprintf(&b, "\n# hash %s\n", Hash(cfg))
	b.Write(Canonical(cfg))
	return b.Bytes()
}
