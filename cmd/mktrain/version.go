package main

import (
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/mktrain/mktrain/engine"
)

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
	return fmt.Sprintf("mktrain %s%s (%s %s/%s)", engine.Version, rev, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
