// Package recipes turns a recipe, a YAML file that describes a whole
// training run, into an engine.Config.
//
// # Loading
//
//	cfg, snapshot, err := recipes.Load("recipes/tiny.yaml", []string{"train.lr=3e-4"})
//
// Load starts from engine.DefaultConfig, so a recipe need only name the
// fields it changes; then it applies the overrides (the command line's --set
// arguments) in order, and validates the result with engine.Config.Validate.
// The snapshot is the effective configuration as YAML, every field written
// out, under a comment naming the recipe and the overrides; the run directory
// keeps it, and parsing it gives the same configuration back.
//
// The shipped recipes (see Shipped) are built into the binary. When Load's
// path names no file on disk but names a shipped recipe, "tiny",
// "tiny.yaml" or "recipes/tiny.yaml", the built-in one is used, so
// `mktrain train tiny` works from any directory. A file on disk always wins.
//
// # Strictness
//
// Every problem is reported at once, each as an *Error that names the file,
// the line when there is one, and the field path:
//
//	recipes/x.yaml:12: unknown field "lr_max" in section train; did you mean "min_lr"?
//	recipes/x.yaml:5: model.dim must be an integer, got 64.5, which is not a whole number
//	recipes/x.yaml:7: model.heads (6) must divide model.dim (64)
//	recipes/x.yaml: --set model.moe.top_k=3: model.moe.top_k (3) cannot exceed model.moe.experts (2)
//
// Unknown sections and fields are errors, as are a key set twice, a second
// YAML document, quoted numbers, fractions where an integer is wanted, and
// booleans other than true and false. A key with no value is an error for a
// number or a boolean and the empty string for a string; to keep a default,
// leave the key out. A section with no fields keeps its defaults.
//
// # Overrides
//
// An override is "key.path=value": the dotted path of one field, as in the
// recipe ("train.lr", "model.moe.top_k"), then "=", then the value as it
// would be written in YAML for numbers and booleans ("3e-4", "1e6" for an
// integer, "true"). A string is taken exactly as written, with no quoting
// ("data.train=shards/train_*.bin", "data.train=" for the empty string).
//
// # Hash
//
// Hash digests the canonical YAML (Canonical) of a configuration; a
// checkpoint stores it beside the snapshot so that a resumed run can tell
// whether its recipe changed.
//
// The reference of every field, its default and the rules Validate
// enforces is docs/recipes.md; a test keeps it in step with engine.Config.
package recipes
