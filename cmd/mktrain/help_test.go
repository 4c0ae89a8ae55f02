package main

import (
	"context"
	"errors"
	"flag"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// The commands come from the code, so that a command added to mktrain is
// checked without touching these tests: topUsage's synopsis lines give
// every command and subcommand, and runCommand's switch must dispatch
// exactly topUsage's commands.

// usageSynopsis matches a synopsis line of topUsage: "  mktrain" and the
// words of the command (up to its arguments, or the two spaces before
// its description).
var usageSynopsis = regexp.MustCompile(`(?m)^  mktrain((?: [a-z][a-z0-9-]*)+)`)

// usageCommands lists the commands topUsage names, each as its words
// ("run"; "bench", "train"), in its order.
func usageCommands(t *testing.T) [][]string {
	t.Helper()
	var out [][]string
	for _, line := range strings.Split(topUsage, "\n") {
		synopsis, _, _ := strings.Cut(line, "   ") // the description starts after a gap
		m := usageSynopsis.FindStringSubmatch(synopsis)
		if m == nil {
			continue
		}
		words := strings.Fields(m[1])
		if !slices.ContainsFunc(out, func(c []string) bool { return slices.Equal(c, words) }) {
			out = append(out, words)
		}
	}
	if len(out) < 10 {
		t.Fatalf("found only %d commands in topUsage; is its synopsis format parsed?", len(out))
	}
	return out
}

// dispatchedCommands lists the command names runCommand's switch takes,
// read from main.go, leaving out the flag spellings (--version, -h).
func dispatchedCommands(t *testing.T) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "main.go", nil, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, decl := range f.Decls {
		fn, ok := decl.(*ast.FuncDecl)
		if !ok || fn.Name.Name != "runCommand" {
			continue
		}
		ast.Inspect(fn.Body, func(n ast.Node) bool {
			clause, ok := n.(*ast.CaseClause)
			if !ok {
				return true
			}
			for _, e := range clause.List {
				lit, ok := e.(*ast.BasicLit)
				if !ok || lit.Kind != token.STRING {
					continue
				}
				name, err := strconv.Unquote(lit.Value)
				if err == nil && !strings.HasPrefix(name, "-") {
					names = append(names, name)
				}
			}
			return true
		})
	}
	if len(names) == 0 {
		t.Fatal("main.go: found no runCommand switch with command names")
	}
	return names
}

// TestUsageListsEveryCommand: the top-level help names every command
// runCommand dispatches, and nothing else.
func TestUsageListsEveryCommand(t *testing.T) {
	var listed []string
	for _, c := range usageCommands(t) {
		if !slices.Contains(listed, c[0]) {
			listed = append(listed, c[0])
		}
	}
	dispatched := dispatchedCommands(t)
	slices.Sort(listed)
	slices.Sort(dispatched)
	if !slices.Equal(listed, dispatched) {
		t.Errorf("topUsage lists the commands %v; runCommand dispatches %v", listed, dispatched)
	}
	for _, args := range [][]string{{"help"}, {"--help"}, {"-h"}, {"help", "--help"}, {"help", "help"}} {
		code, stdout, stderr := runCLI(t, args...)
		if code != exitOK || stdout != topUsage || stderr != "" {
			t.Errorf("mktrain %s: exit %d, stdout %d bytes, stderr %q; want 0 and the top-level usage on stdout", strings.Join(args, " "), code, len(stdout), stderr)
		}
	}
	if code, _, stderr := runCLI(t, "help", "frobnicate"); code != exitFailure || !strings.Contains(stderr, `unknown command "frobnicate"`) {
		t.Errorf("mktrain help frobnicate: exit %d, %q; want 2 naming the unknown command", code, stderr)
	}
}

// TestEveryCommandHelp: each command and subcommand answers --help, -h
// and `mktrain help CMD [SUB]` alike: exit 0, its usage on stdout (and
// nothing on stderr), naming every flag of its FlagSet. A group of
// subcommands (data, bench, ckpt) answers with a list of them all.
func TestEveryCommandHelp(t *testing.T) {
	commands := usageCommands(t)
	groups := map[string][]string{} // group -> its subcommands, as topUsage lists them
	for _, c := range commands {
		if len(c) == 2 {
			groups[c[0]] = append(groups[c[0]], c[1])
		}
	}
	for _, cmd := range commands {
		name := strings.Join(cmd, " ")
		t.Run(name, func(t *testing.T) {
			var first string
			for _, args := range [][]string{append(slices.Clone(cmd), "--help"), append(slices.Clone(cmd), "-h"), append([]string{"help"}, cmd...)} {
				code, stdout, stderr := runCLI(t, args...)
				if code != exitOK || stderr != "" || !strings.Contains(stdout, "mktrain "+name) {
					t.Errorf("mktrain %s: exit %d, stderr %q, stdout:\n%s\nwant exit 0 and a usage naming mktrain %s on stdout only", strings.Join(args, " "), code, stderr, stdout, name)
				}
				if first == "" {
					first = stdout
				} else if stdout != first {
					t.Errorf("mktrain %s prints another help than mktrain %s --help:\n%s", strings.Join(args, " "), name, stdout)
				}
			}
			// The flags: those of the FlagSet the command parsed its
			// arguments with (the help request carries it).
			err := runCommand(context.Background(), append(slices.Clone(cmd), "--help"), io.Discard, io.Discard)
			if !errors.Is(err, errHelp) {
				t.Fatalf("mktrain %s --help: %v; want a help request", name, err)
			}
			var help *helpRequest
			if !errors.As(err, &help) {
				return // no flags: version, ckpt's subcommands
			}
			help.fs.VisitAll(func(f *flag.Flag) {
				listed := regexp.MustCompile(`(?m)^\s+--?` + regexp.QuoteMeta(f.Name) + `\b`)
				if !listed.MatchString(first) {
					t.Errorf("mktrain %s --help does not list its flag --%s:\n%s", name, f.Name, first)
				}
			})
		})
	}
	for group, subs := range groups {
		t.Run(group, func(t *testing.T) {
			for _, args := range [][]string{{group, "--help"}, {group, "-h"}, {"help", group}} {
				code, stdout, stderr := runCLI(t, args...)
				if code != exitOK || stderr != "" {
					t.Errorf("mktrain %s: exit %d, stderr %q; want 0 and the list of its subcommands on stdout", strings.Join(args, " "), code, stderr)
				}
				for _, sub := range subs {
					if !strings.Contains(stdout, "mktrain "+group+" "+sub) {
						t.Errorf("mktrain %s does not list mktrain %s %s:\n%s", strings.Join(args, " "), group, sub, stdout)
					}
				}
			}
			if code, _, stderr := runCLI(t, group); code != exitFailure || !strings.Contains(stderr, "mktrain "+group+" "+subs[0]) {
				t.Errorf("mktrain %s alone: exit %d, stderr %q; want 2 and the list of its subcommands", group, code, stderr)
			}
		})
	}
}

// TestBadFlagUsageOnStderr: a bad flag is an error on stderr with the
// command's usage, exit 2, and nothing on stdout.
func TestBadFlagUsageOnStderr(t *testing.T) {
	code, stdout, stderr := runCLI(t, "eval", "--no-such-flag")
	if code != exitFailure || stdout != "" || !strings.Contains(stderr, "no-such-flag") || !strings.Contains(stderr, "Usage: mktrain eval") {
		t.Errorf("mktrain eval --no-such-flag: exit %d, stdout %q, stderr %q; want 2, the error and the usage on stderr", code, stdout, stderr)
	}
}
