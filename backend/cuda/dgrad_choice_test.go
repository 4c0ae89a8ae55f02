package cuda

import "testing"

// TestDgradTrials walks one shape's measurement: the builds alternate,
// timed, until each has dgradTrialRuns launches; then the beside build runs
// untimed until the timings are in; the last timing makes the choice,
// which every later call takes.
func TestDgradTrials(t *testing.T) {
	for _, tc := range []struct {
		name       string
		beside     []float32
		first      []float32
		wantChoice int
	}{
		{"first faster", []float32{1.0, 0.9, 1.1}, []float32{0.8, 0.95, 0.85}, dgradFirst},
		{"beside faster", []float32{0.7, 0.9, 0.8}, []float32{0.8, 0.75, 0.85}, dgradBeside},
		{"a tie keeps beside", []float32{0.8, 0.9, 0.8}, []float32{0.8, 0.85, 0.9}, dgradBeside},
		{"one fast outlier counts", []float32{1.0, 1.0, 1.0}, []float32{2.0, 0.5, 2.0}, dgradFirst},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := newDgradTrials()
			var builds []int
			for range 2 * dgradTrialRuns {
				b, timed := tr.next()
				if !timed {
					t.Fatalf("launch %d untimed while measuring", len(builds))
				}
				builds = append(builds, b)
			}
			for i, b := range builds {
				if b != i%2 {
					t.Fatalf("timed launches ran builds %v, want them in turn from beside", builds)
				}
			}
			if b, timed := tr.next(); b != dgradBeside || timed {
				t.Fatalf("waiting for timings: build %d timed %v, want beside, untimed", b, timed)
			}
			// The timings arrive in any order; the choice waits for all.
			for i := range dgradTrialRuns {
				tr.add(dgradFirst, tc.first[i])
				if tr.choice >= 0 {
					t.Fatalf("chose after %d timings of first alone", i+1)
				}
			}
			for i := range dgradTrialRuns {
				if tr.choice >= 0 {
					t.Fatalf("chose before the last timing")
				}
				tr.add(dgradBeside, tc.beside[i])
			}
			if tr.choice != tc.wantChoice {
				t.Fatalf("chose %d from beside %v, first %v; want %d", tr.choice, tc.beside, tc.first, tc.wantChoice)
			}
			for range 3 {
				if b, timed := tr.next(); b != tc.wantChoice || timed {
					t.Fatalf("after the choice: build %d timed %v, want %d untimed", b, timed, tc.wantChoice)
				}
			}
		})
	}
}

// TestDgradShapeBuckets: rows in the same power-of-two range share a
// measurement; a different width, depth or expert count does not.
func TestDgradShapeBuckets(t *testing.T) {
	a := newDgradShape(24576, 1408, 2048, 16)
	if b := newDgradShape(30000, 1408, 2048, 16); a != b {
		t.Errorf("24576 and 30000 rows: %v and %v, want one shape", a, b)
	}
	for _, b := range []dgradShape{newDgradShape(40000, 1408, 2048, 16), newDgradShape(24576, 2816, 2048, 16),
		newDgradShape(24576, 1408, 1024, 16), newDgradShape(24576, 1408, 2048, 8)} {
		if a == b {
			t.Errorf("%v and %v are one shape", a, b)
		}
	}
}
