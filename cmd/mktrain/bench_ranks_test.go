package main

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/comm"
)

// holdingClock is a profile.Holder whose time is what the holds and the
// ranks' work add; it logs holds and marks in order.
type holdingClock struct {
	mu    sync.Mutex
	now   time.Duration
	marks map[profile.Mark]time.Duration
	log   []string
}

func (c *holdingClock) Hold(d time.Duration) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now += d
	c.log = append(c.log, "hold "+d.String())
	return nil
}

func (c *holdingClock) Mark() (profile.Mark, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := profile.Mark(len(c.marks) + 1)
	c.marks[m] = c.now
	c.log = append(c.log, "mark")
	return m, nil
}

func (c *holdingClock) Elapsed(a, b profile.Mark) (time.Duration, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.marks[b] - c.marks[a], nil
}

func (c *holdingClock) Release(profile.Mark) {}

func (c *holdingClock) add(d time.Duration) {
	c.mu.Lock()
	c.now += d
	c.mu.Unlock()
}

// oneRankStep on ranks that share the clock's device: rank 0 holds it
// once, before the start mark, and the step's time is the ranks' work
// alone; on ranks with devices of their own there is no hold; a rank
// whose work fails is named and the others do not wait for it.
func TestOneRankStepHolds(t *testing.T) {
	b := cpu.New(backend.Float32)
	steps := func(c *holdingClock, own bool, fail int) []rankStep {
		world, err := comm.NewLocal(contextMesh(3), b)
		if err != nil {
			t.Fatal(err)
		}
		s := make([]rankStep, 3)
		for r := range s {
			s[r] = rankStep{group: world[r].Context, ranks: world[r], work: func() error {
				if r == fail {
					return errors.New("no memory")
				}
				c.add(7)
				return nil
			}}
			if own {
				s[r].device = b
			}
		}
		return s
	}

	c := &holdingClock{marks: map[profile.Mark]time.Duration{}}
	d, _, held, err := oneRankStep(b, c, steps(c, false, -1), stepHold)
	if err != nil || d != 21 || !held {
		t.Errorf("step %v, held %v (%v), want 21ns, held: the three ranks' work without the hold", d, held, err)
	}
	if got := strings.Join(c.log, ", "); got != "hold "+stepHold.String()+", mark, mark" {
		t.Errorf("log %q, want the hold before the start mark", got)
	}

	c = &holdingClock{marks: map[profile.Mark]time.Duration{}}
	if _, _, held, err := oneRankStep(b, c, steps(c, true, -1), stepHold); err != nil || held || strings.Contains(strings.Join(c.log, " "), "hold") {
		t.Errorf("ranks with their own devices: log %q, held %v (%v), want no hold", c.log, held, err)
	}

	c = &holdingClock{marks: map[profile.Mark]time.Duration{}}
	done := make(chan error, 1)
	go func() {
		_, _, _, err := oneRankStep(b, c, steps(c, false, 1), stepHold)
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "rank 1: no memory") {
			t.Errorf("error %v, want rank 1's", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("oneRankStep hung after a rank's work failed")
	}
}

// timeInterleaved takes one sample of each kind (here the ring rows'
// forward and forward+backward) of every path a round, the paths in the
// order of balancedOrder's rows in turn, keeps the samples after the two
// warm-up rounds, and sets each path's medians and spans; a failing
// sample names its path and direction.
func TestTimeInterleaved(t *testing.T) {
	var order []string
	holds := map[string][]time.Duration{}
	// A path's samples: its base time plus the round, and 1000 more for
	// forward+backward, so each median says which samples were kept. Its
	// forward+backward steps take the host base/10000 ms to queue, and
	// path c's first two 5 ms.
	path := func(name string, base time.Duration) *timedPath {
		round := 0
		return &timedPath{name: name, sample: func(kind int, hold time.Duration) (time.Duration, time.Duration, bool, error) {
			order = append(order, fmt.Sprintf("%s/%v", name, kind))
			if kind == 1 {
				holds[name] = append(holds[name], hold)
				d := base + 1000 + time.Duration(round)
				queue := base / 10000 * time.Millisecond
				if name == "c" && round < 2 {
					queue = 5 * time.Millisecond
				}
				round++
				return d, queue, true, nil
			}
			return base + time.Duration(round), 0, true, nil
		}}
	}
	paths := []*timedPath{path("a", 10000), path("b", 20000), path("c", 30000)}
	before := time.Now()
	timeline, err := timeInterleaved(paths, ringKinds, 3)
	if err != nil {
		t.Fatal(err)
	}
	// The timeline: the timed samples (rounds 0..2, rows "cab", "cba",
	// "acb"), each with its path, kind, time and start, in order.
	var gotTimeline []string
	for i, ts := range timeline {
		gotTimeline = append(gotTimeline, fmt.Sprintf("%s/%d", paths[ts.path].name, ts.kind))
		if ts.start.Before(before) || (i > 0 && ts.start.Before(timeline[i-1].start)) {
			t.Errorf("timeline[%d] started at %v, before the call or the sample before it", i, ts.start)
		}
		if base := time.Duration(10000 * (ts.path + 1)); ts.d < base+1000*time.Duration(ts.kind)+2 || ts.d > base+1000*time.Duration(ts.kind)+4 {
			t.Errorf("timeline[%d] = %v, not a timed sample of %s", i, ts.d, paths[ts.path].name)
		}
	}
	wantTimeline := []string{}
	for _, row := range []string{"cab", "cba", "acb"} {
		for _, n := range row {
			wantTimeline = append(wantTimeline, string(n)+"/0", string(n)+"/1")
		}
	}
	if strings.Join(gotTimeline, " ") != strings.Join(wantTimeline, " ") {
		t.Errorf("timeline\n %v\nwant\n %v", gotTimeline, wantTimeline)
	}
	// Rounds -2..2 take balancedOrder(3)'s first five rows.
	want := []string{}
	for _, row := range []string{"abc", "bca", "cab", "cba", "acb"} {
		for _, n := range row {
			want = append(want, string(n)+"/0", string(n)+"/1")
		}
	}
	if strings.Join(order, " ") != strings.Join(want, " ") {
		t.Errorf("order\n %v\nwant\n %v", order, want)
	}
	// Timed rounds are each path's samples 2, 3, 4: median 3.
	for i, p := range paths {
		base := time.Duration(10000 * (i + 1))
		if p.medians[0] != base+3 || p.medians[1] != base+1003 || p.queue != time.Duration(i+1)*time.Millisecond || p.uncovered != 0 {
			t.Errorf("path %s: medians %v / %v, queue %v (%d uncovered), want %v / %v, %v ms", p.name, p.medians[0], p.medians[1], p.queue, p.uncovered, base+3, base+1003, i+1)
		}
		if want := [][2]time.Duration{{base + 2, base + 4}, {base + 1002, base + 1004}}; !slices.Equal(p.spans, want) {
			t.Errorf("path %s: spans %v, want %v", p.name, p.spans, want)
		}
	}
	// The holds: stepHold, or 1.5 times the path's last queueing (c's
	// warm-up took 5 ms, its timed steps 3 ms).
	wantHolds := map[string][]time.Duration{"a": {stepHold, stepHold, stepHold, stepHold, stepHold},
		"c": {stepHold, 7500 * time.Microsecond, 7500 * time.Microsecond, 4500 * time.Microsecond, 4500 * time.Microsecond}}
	for name, w := range wantHolds {
		if fmt.Sprint(holds[name]) != fmt.Sprint(w) {
			t.Errorf("path %s's holds %v, want %v", name, holds[name], w)
		}
	}

	// A path whose host queues each step twice as long as the one before
	// outlasts every hold after the first: 3 timed steps uncovered.
	q := time.Millisecond
	growing := &timedPath{name: "growing", sample: func(int, time.Duration) (time.Duration, time.Duration, bool, error) {
		q *= 2
		return 1, q, true, nil
	}}
	if _, err := timeInterleaved([]*timedPath{growing}, []string{""}, 3); err != nil || growing.uncovered != 3 || growing.queue != 32*time.Millisecond {
		t.Errorf("growing queue: %d steps uncovered, longest %v (%v), want 3, 32ms", growing.uncovered, growing.queue, err)
	}

	// A path whose host waits for the device mid-step queues for longer
	// than any hold (its queueing counts the hold): its holds stop at
	// stepHoldMax instead of growing 1.5 times a round, and every timed
	// step is uncovered.
	var waitingHolds []time.Duration
	waiting := &timedPath{name: "waiting", sample: func(_ int, hold time.Duration) (time.Duration, time.Duration, bool, error) {
		waitingHolds = append(waitingHolds, hold)
		return 1, hold + time.Millisecond, true, nil
	}}
	if _, err := timeInterleaved([]*timedPath{waiting}, []string{""}, 10); err != nil || waiting.uncovered != 10 {
		t.Errorf("waiting host: %d steps uncovered (%v), want 10", waiting.uncovered, err)
	}
	if longest := slices.Max(waitingHolds); longest != stepHoldMax || waitingHolds[len(waitingHolds)-1] != stepHoldMax {
		t.Errorf("waiting host's holds %v: want them to stop at %v", waitingHolds, stepHoldMax)
	}

	// A path that cannot hold the device (ranks with devices of their
	// own, a clock that does not hold) has no hold to outlast: its long
	// queueing is reported, not counted as uncovered.
	unheld := &timedPath{name: "unheld", sample: func(int, time.Duration) (time.Duration, time.Duration, bool, error) {
		return 1, 50 * time.Millisecond, false, nil
	}}
	if _, err := timeInterleaved([]*timedPath{unheld}, []string{""}, 3); err != nil || unheld.uncovered != 0 || unheld.queue != 50*time.Millisecond {
		t.Errorf("unheld path: %d steps uncovered, longest %v (%v), want 0, 50ms", unheld.uncovered, unheld.queue, err)
	}

	failing := &timedPath{name: "mode ring", sample: func(kind int, _ time.Duration) (time.Duration, time.Duration, bool, error) {
		if kind == ringForwardBackward {
			return 0, 0, false, fmt.Errorf("rank 1: timeout")
		}
		return 1, 0, true, nil
	}}
	_, err = timeInterleaved([]*timedPath{path("core", 1), failing}, ringKinds, 2)
	if err == nil || err.Error() != "mode ring, forward+backward: rank 1: timeout" {
		t.Errorf("error %v", err)
	}
}

// The ring rows' core holds the device before its start mark only where
// it is told to (the ranks share the device), so that it is timed as the
// ranks are.
func TestRingCoreSamplerHolds(t *testing.T) {
	b := cpu.New(backend.Float32)
	g := ringGeometry(16)
	rng := rand.New(rand.NewPCG(3, 4))
	qw, kd := g.Heads*g.HeadDim, g.KVHeads*g.HeadDim
	in := ringInputs{q: randValues(rng, g.Seq*qw), k: randValues(rng, g.Seq*kd), v: randValues(rng, g.Seq*kd), da: randValues(rng, g.Seq*qw)}
	for _, hold := range []bool{true, false} {
		c := &holdingClock{marks: map[profile.Mark]time.Duration{}}
		_, _, held, err := ringCoreSampler(b, c, g, in, hold)(ringForwardBackward, 3*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		if held != hold {
			t.Errorf("hold %v: held %v", hold, held)
		}
		want := "mark, mark"
		if hold {
			want = "hold 3ms, " + want
		}
		if got := strings.Join(c.log, ", "); got != want {
			t.Errorf("hold %v: log %q, want %q", hold, got, want)
		}
	}
}

// balancedOrder's rows are orders of every path in which, over all rows,
// each path comes first equally often and directly follows each other
// path equally often.
func TestBalancedOrder(t *testing.T) {
	for n := 1; n <= 7; n++ {
		rows := balancedOrder(n)
		if want := n + n%2*n; len(rows) != want {
			t.Errorf("n %d: %d rows, want %d", n, len(rows), want)
		}
		firsts := make([]int, n)
		follows := make([][]int, n) // follows[a][b]: rows where b directly follows a
		for a := range follows {
			follows[a] = make([]int, n)
		}
		for _, row := range rows {
			if sorted := slices.Sorted(slices.Values(row)); len(row) != n || sorted[0] != 0 || sorted[n-1] != n-1 || len(slices.Compact(sorted)) != n {
				t.Fatalf("n %d: row %v is not an order of 0..%d", n, row, n-1)
			}
			firsts[row[0]]++
			for j := 1; j < n; j++ {
				follows[row[j-1]][row[j]]++
			}
		}
		if slices.Min(firsts) != slices.Max(firsts) {
			t.Errorf("n %d: first positions %v, not equal", n, firsts)
		}
		var counts []int
		for a := range n {
			for b := range n {
				if a != b {
					counts = append(counts, follows[a][b])
				}
			}
		}
		if n > 1 && slices.Min(counts) != slices.Max(counts) {
			t.Errorf("n %d: followers %v, not equal", n, follows)
		}
	}
}
