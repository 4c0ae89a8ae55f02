package main

import (
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/mktrain/mktrain/engine"
)

// buildCommit is the source revision stamped by the linker
// (-ldflags "-X main.buildCommit=REV", as scripts/gpu-test.sh build does),
// for builds where Go's own VCS stamping is off or finds no repository;
// "" otherwise. Benchmark results name it as their commit.
var buildCommit string

// versionString is the release, the source revision when the binary was
// built from a git checkout, and the Go version.
func versionString() string {
	rev := ""
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = " " + s.Value[:min(12, len(s.Value))]
			case "vcs.modified":
				if s.Value == "true" {
					rev += "+dirty"
				}
			}
		}
	}
	if rev == "" && buildCommit != "" {
		rev = " " + buildCommit[:min(12, len(buildCommit))]
	}
	return fmt.Sprintf("mktrain %s%s (%s %s/%s)", engine.Version, rev, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
