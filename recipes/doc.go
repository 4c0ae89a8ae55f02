// Package recipes turns a recipe, a YAML file that describes a whole
// training run, into a validated engine.Config. It is what `mktrain run
// RECIPE --set key.path=value` calls; the reference of every field, its
// default and its rules is docs/recipes.md.
//
// # Use
//
//	cfg, snapshot, err := recipes.Load("recipes/tiny.yaml", []string{"train.lr=3e-4"})
//
// Load starts from engine.DefaultConfig, so a recipe names only the fields
// it changes; applies the overrides (the --set arguments) in order; and
// validates the result with engine.Config.Validate. The snapshot is the
// effective configuration as YAML, every field written out, under a comment
// naming the recipe and the overrides; the run directory keeps it as
// recipe.yaml, and parsing it gives the same configuration back. Parse does
// the same for a recipe held in memory. Hash digests the canonical YAML
// (Canonical); a checkpoint stores it so that a resumed run can tell
// whether its recipe changed. The examples show both functions' output.
//
// The shipped recipes (Shipped: tiny, moe-small, moe-fine, moe-large,
// long-context) are built into the binary. When Load's path names no file
// on disk but names a shipped recipe ("tiny", "tiny.yaml" or
// "recipes/tiny.yaml"), the built-in one is used, so `mktrain run tiny`
// works from any directory. A file on disk always wins.
//
// # Overrides
//
// An override is "key.path=value": the dotted path of one field, as in the
// recipe ("train.lr", "model.moe.top_k"), "=", then the value as it would
// be written in YAML for numbers and booleans ("3e-4", "1e6" for an
// integer, "true"). A string is taken exactly as written, with no quoting
// ("data.train=shards/train_*.bin", "data.train=" for the empty string).
//
// # Strictness
//
// Each problem is an *Error that names the file, the line when there is
// one (or the override), and the field path:
//
//	x.yaml:3: unknown field "topk" in section model.moe; did you mean "top_k"?
//	x.yaml:2: model.dim must be an integer, got 64.5, which is not a whole number
//	y.yaml:3: model.heads (6) must divide model.dim (64)
//	y.yaml: --set train.lr=-1: train.lr must be positive, got -1
//
// All the problems of reading the file and the overrides come at once,
// joined; when there are none, all the rules Validate finds broken come at
// once. Unknown sections and fields are errors, as are a key set twice, a
// second YAML document, quoted numbers, fractions where an integer is
// wanted, and booleans other than true and false. A key with no value is an
// error for a number or a boolean and the empty string for a string; to
// keep a default, leave the key out. A test (docs_test.go) keeps
// docs/recipes.md in step with engine.Config.
package recipes
