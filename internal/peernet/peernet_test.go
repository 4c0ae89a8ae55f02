package peernet_test

import (
	"testing"
	"time"

	"github.com/mktrain/mktrain/internal/peernet"
)

func TestDuration(t *testing.T) {
	for d, want := range map[time.Duration]string{
		30 * time.Second: "30s", 1500 * time.Millisecond: "1.5s", 10 * time.Minute: "10m",
		90 * time.Second: "1m30s", 200 * time.Millisecond: "200ms", time.Hour: "1h",
	} {
		if got := peernet.Duration(d); got != want {
			t.Errorf("peernet.Duration(%v) = %q, want %q", d, got, want)
		}
	}
}

func TestRankList(t *testing.T) {
	if got := peernet.RankList("node", []int{2}); got != "node 2" {
		t.Errorf("got %q", got)
	}
	if got := peernet.RankList("node", []int{2, 3}); got != "nodes 2, 3" {
		t.Errorf("got %q", got)
	}
}
