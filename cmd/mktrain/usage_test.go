package main

import (
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

var (
	flagDefault = regexp.MustCompile(`(?m)^  -([a-z][a-z0-9-]*)`)               // a flag as FlagSet.PrintDefaults lists it
	flagMention = regexp.MustCompile(`--([a-z][a-z0-9-]*)`)                     // a flag as the usage text names it
	commandLine = regexp.MustCompile(`(?m)^[ \t]+mktrain ([a-z]+(?: [a-z]+)?)`) // a synopsis line
)

// packageDoc is main.go's package comment.
func packageDoc(t *testing.T) string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "main.go", nil, parser.ParseComments|parser.PackageClauseOnly)
	if err != nil {
		t.Fatal(err)
	}
	return f.Doc.Text()
}

// readmeCommands is the synopsis block of README.md's Commands section.
func readmeCommands(t *testing.T) string {
	t.Helper()
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "\n## Commands\n")
	if !ok {
		t.Fatal("README.md has no Commands section")
	}
	_, block, ok := strings.Cut(section, "```\n")
	if ok {
		block, _, ok = strings.Cut(block, "```")
	}
	if !ok {
		t.Fatal("README.md's Commands section has no ``` block")
	}
	return block
}

// TestUsageNamesEveryCommandAndFlag keeps topUsage, the package doc and
// README's Commands block in step with the commands: each names every command and every flag a
// command's --help lists, and no command or flag that does not exist.
func TestUsageNamesEveryCommandAndFlag(t *testing.T) {
	texts := map[string]string{"topUsage": topUsage, "package doc": packageDoc(t), "README's Commands": readmeCommands(t)}
	real := map[string]bool{"help": true}
	commands := usageCommands(t) // topUsage's, which runCommand's switch must match (help_test.go)
	for _, cmd := range commands {
		code, stdout, stderr := runCLI(t, append(slices.Clone(cmd), "--help")...)
		if code != exitOK {
			t.Errorf("mktrain %s --help: exit %d\n%s", strings.Join(cmd, " "), code, stderr)
		}
		for what, text := range texts {
			if !strings.Contains(text, "mktrain "+strings.Join(cmd, " ")) {
				t.Errorf("%s does not name the command mktrain %s", what, strings.Join(cmd, " "))
			}
		}
		for _, m := range flagDefault.FindAllStringSubmatch(stdout+stderr, -1) {
			real[m[1]] = true
			for what, text := range texts {
				if !strings.Contains(text, "--"+m[1]) {
					t.Errorf("%s does not name mktrain %s --%s", what, strings.Join(cmd, " "), m[1])
				}
			}
		}
	}
	if len(real) < 20 {
		t.Fatalf("found only %d flags in the commands' --help; is the PrintDefaults format parsed?", len(real))
	}
	for what, text := range texts {
		for _, m := range flagMention.FindAllStringSubmatch(text, -1) {
			if !real[m[1]] {
				t.Errorf("%s names --%s, which no command has", what, m[1])
			}
		}
		for _, m := range commandLine.FindAllStringSubmatch(text, -1) {
			words := strings.Fields(m[1]) // "bench train", or "version print": a command and the next word
			if !slices.ContainsFunc(commands, func(c []string) bool {
				return slices.Equal(c, words) || len(c) == 1 && c[0] == words[0]
			}) {
				t.Errorf("%s names the command mktrain %s, which does not exist", what, m[1])
			}
		}
	}
}
