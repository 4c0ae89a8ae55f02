package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// The README's "Embedding the engine" program is what a newcomer copies
// first: it must compile as written and leave no error unhandled.

// readmeSection is the README heading whose first Go block is checked.
const readmeSection = "## Embedding the engine"

// TestReadmeEmbeddingCompiles builds the README's embedding program as a
// main package of this module (through a build overlay: nothing is
// written into the source tree) and type-checks it to find errors it
// drops: a call whose error result is discarded, an error assigned to _,
// and an error variable assigned and then assigned again, or never read,
// without being looked at.
func TestReadmeEmbeddingCompiles(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is not on PATH: %v", err)
	}
	moduleRoot, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(moduleRoot, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	src, err := goBlockAfter(string(readme), readmeSection)
	if err != nil {
		t.Fatalf("README.md: %v", err)
	}
	if !strings.HasPrefix(src, "package main\n") {
		t.Fatalf("README.md's %q program must be a whole program (package main, its imports, func main), so that it compiles as written; it starts %q", readmeSection, firstLine(src))
	}

	// The program lives, for the go command only, in a package of this
	// module that does not exist on disk.
	tmp := t.TempDir()
	srcFile := filepath.Join(tmp, "main.go")
	if err := os.WriteFile(srcFile, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	pkgDir := filepath.Join(moduleRoot, "examples", "trainsvc", "readme_embedding")
	overlay, err := json.Marshal(map[string]any{"Replace": map[string]string{filepath.Join(pkgDir, "main.go"): srcFile}})
	if err != nil {
		t.Fatal(err)
	}
	overlayFile := filepath.Join(tmp, "overlay.json")
	if err := os.WriteFile(overlayFile, overlay, 0o644); err != nil {
		t.Fatal(err)
	}
	goCmd := func(args ...string) []byte {
		t.Helper()
		cmd := exec.Command(goTool, args...)
		cmd.Dir = moduleRoot
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go %s: %v\n%s\nThe program (README.md, %s):\n%s", strings.Join(args, " "), err, stderr.Bytes(), readmeSection, numbered(src))
		}
		return out
	}
	// go list -export compiles the program and its dependencies (without
	// linking it): a compile error fails it.

	// Type-check it against its dependencies' export data (which go list
	// -export leaves in the build cache) to see which calls return errors.
	exports := map[string]string{}
	list := goCmd("list", "-overlay", overlayFile, "-export", "-deps", "-f", "{{.ImportPath}} {{.Export}}", "./examples/trainsvc/readme_embedding")
	for sc := bufio.NewScanner(bytes.NewReader(list)); sc.Scan(); {
		if path, export, ok := strings.Cut(sc.Text(), " "); ok && export != "" {
			exports[path] = export
		}
	}
	fset := token.NewFileSet()
	file, err := parser.ParseFile(fset, "README.md", src, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	info := &types.Info{Types: map[ast.Expr]types.TypeAndValue{}, Defs: map[*ast.Ident]types.Object{}, Uses: map[*ast.Ident]types.Object{}}
	conf := types.Config{Importer: importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		export, ok := exports[path]
		if !ok {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(export)
	})}
	if _, err := conf.Check("main", fset, []*ast.File{file}, info); err != nil {
		t.Fatalf("type-checking the README's program: %v", err)
	}
	for _, problem := range droppedErrors(fset, file, info) {
		t.Errorf("README.md, %s, line %s", readmeSection, problem)
	}
}

// TestDroppedErrorsFindsThem: the check above finds each way of dropping
// an error (so that its silence on the README means something).
func TestDroppedErrorsFindsThem(t *testing.T) {
	src := `package main

import (
	"fmt"
	"os"
	"strconv"
)

func handled() (err error) {
	n, err := strconv.Atoi("1")
	if err != nil {
		return err
	}
	defer func() {
		if cerr := os.Remove("x"); cerr != nil && err == nil {
			err = cerr // a named result: the caller reads it
		}
	}()
	fmt.Println(n)
	return nil
}

func dropped() {
	os.Remove("a")
	defer os.Remove("b")
	_ = os.Remove("c")
	_, _ = strconv.Atoi("d")
	n, err := strconv.Atoi("e")
	m, err := strconv.Atoi("f")
	if err != nil {
		return
	}
	err = os.Remove("g")
	fmt.Println(n, m)
}

func overwritten() (err error) {
	err = os.Remove("h")
	err = os.Remove("i")
	return
}
`
	fset := token.NewFileSet()
	file, err := parser.ParseFile(fset, "x.go", src, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	info := &types.Info{Types: map[ast.Expr]types.TypeAndValue{}, Defs: map[*ast.Ident]types.Object{}, Uses: map[*ast.Ident]types.Object{}}
	if _, err := (&types.Config{Importer: importer.Default()}).Check("main", fset, []*ast.File{file}, info); err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, p := range droppedErrors(fset, file, info) {
		line, _, _ := strings.Cut(p, ":")
		lines = append(lines, line)
	}
	if want := []string{"24", "25", "26", "27", "28", "33", "38"}; !slices.Equal(lines, want) {
		t.Errorf("dropped errors found on lines %v; want %v:\n%s", lines, want, strings.Join(droppedErrors(fset, file, info), "\n"))
	}
}

// droppedErrors lists, as "line: what", the errors file drops (see
// TestReadmeEmbeddingCompiles). Printing with package fmt is exempt, as
// errcheck's default has it.
func droppedErrors(fset *token.FileSet, file *ast.File, info *types.Info) []string {
	var problems []string
	report := func(pos token.Pos, format string, args ...any) {
		problems = append(problems, fmt.Sprintf("%d: %s", fset.Position(pos).Line, fmt.Sprintf(format, args...)))
	}
	errorType := types.Universe.Lookup("error").Type()
	isError := func(t types.Type) bool { return t != nil && types.Identical(t, errorType) }
	returnsError := func(call *ast.CallExpr) bool {
		if sel, ok := call.Fun.(*ast.SelectorExpr); ok {
			if pkg, ok := sel.X.(*ast.Ident); ok && pkg.Name == "fmt" && (strings.HasPrefix(sel.Sel.Name, "Print") || strings.HasPrefix(sel.Sel.Name, "Fprint")) {
				return false
			}
		}
		switch t := info.Types[call].Type.(type) {
		case *types.Tuple:
			for i := range t.Len() {
				if isError(t.At(i).Type()) {
					return true
				}
			}
			return false
		default:
			return isError(t)
		}
	}
	// rhsType is the type of the i-th value an assignment's right side gives.
	rhsType := func(rhs []ast.Expr, i, lhs int) types.Type {
		if len(rhs) == 1 && lhs > 1 {
			if tuple, ok := info.Types[rhs[0]].Type.(*types.Tuple); ok {
				return tuple.At(i).Type()
			}
			return nil
		}
		return info.Types[rhs[i]].Type
	}

	// Named results are read by the caller after their last assignment.
	namedResults := map[types.Object]bool{}
	// Each error variable's assignments and reads, in source order, per
	// function (a deferred closure that sets a named result is apart
	// from the body that returns it).
	type access struct {
		pos    token.Pos
		assign bool
	}
	type varInFunc struct {
		obj types.Object
		fn  ast.Node
	}
	accesses := map[varInFunc][]access{}
	var keys []varInFunc // in the order first seen, for a stable report
	record := func(k varInFunc, a access) {
		if _, ok := accesses[k]; !ok {
			keys = append(keys, k)
		}
		accesses[k] = append(accesses[k], a)
	}
	assigned := map[*ast.Ident]bool{}
	var stack []ast.Node
	innermostFunc := func() ast.Node {
		for i := len(stack) - 1; i >= 0; i-- {
			switch stack[i].(type) {
			case *ast.FuncDecl, *ast.FuncLit:
				return stack[i]
			}
		}
		return nil
	}
	ast.Inspect(file, func(n ast.Node) bool {
		if n == nil {
			stack = stack[:len(stack)-1]
			return true
		}
		stack = append(stack, n)
		switch n := n.(type) {
		case *ast.FuncType:
			if n.Results != nil {
				for _, f := range n.Results.List {
					for _, name := range f.Names {
						namedResults[info.Defs[name]] = true
					}
				}
			}
		case *ast.ExprStmt:
			if call, ok := n.X.(*ast.CallExpr); ok && returnsError(call) {
				report(n.Pos(), "the error of this call is dropped")
			}
		case *ast.DeferStmt:
			if returnsError(n.Call) {
				report(n.Pos(), "the error of this deferred call is dropped")
			}
		case *ast.GoStmt:
			if returnsError(n.Call) {
				report(n.Pos(), "the error of this goroutine's call is dropped")
			}
		case *ast.AssignStmt:
			for i, lhs := range n.Lhs {
				id, ok := lhs.(*ast.Ident)
				if !ok {
					continue
				}
				if id.Name == "_" {
					if isError(rhsType(n.Rhs, i, len(n.Lhs))) {
						report(id.Pos(), "an error is assigned to _")
					}
					continue
				}
				obj := info.Defs[id]
				if obj == nil {
					obj = info.Uses[id]
				}
				if obj != nil && isError(obj.Type()) {
					assigned[id] = true
					record(varInFunc{obj, innermostFunc()}, access{id.Pos(), true})
				}
			}
		case *ast.Ident:
			if obj := info.Uses[n]; obj != nil && !assigned[n] && isError(obj.Type()) {
				record(varInFunc{obj, innermostFunc()}, access{n.Pos(), false})
			}
		}
		return true
	})
	for _, k := range keys {
		list := accesses[k]
		for i, a := range list {
			last := i+1 == len(list)
			if a.assign && ((last && !namedResults[k.obj]) || (!last && list[i+1].assign)) {
				report(a.pos, "the error assigned to %s is never looked at", k.obj.Name())
			}
		}
	}
	slices.SortFunc(problems, func(a, b string) int {
		var la, lb int
		fmt.Sscan(a, &la)
		fmt.Sscan(b, &lb)
		return la - lb
	})
	return problems
}

// goBlockAfter returns the first ```go block after the line heading.
func goBlockAfter(markdown, heading string) (string, error) {
	_, rest, ok := strings.Cut(markdown, "\n"+heading+"\n")
	if !ok {
		return "", fmt.Errorf("no section %q", heading)
	}
	_, rest, ok = strings.Cut(rest, "```go\n")
	if !ok {
		return "", fmt.Errorf("section %q holds no ```go block", heading)
	}
	block, _, ok := strings.Cut(rest, "\n```")
	if !ok {
		return "", fmt.Errorf("section %q: the ```go block does not end", heading)
	}
	return block + "\n", nil
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// numbered prefixes each line of src with its number, for error messages.
func numbered(src string) string {
	var b strings.Builder
	for i, line := range strings.Split(strings.TrimSuffix(src, "\n"), "\n") {
		fmt.Fprintf(&b, "%3d  %s\n", i+1, line)
	}
	return b.String()
}
