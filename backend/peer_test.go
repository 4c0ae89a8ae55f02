package backend

import (
	"slices"
	"strings"
	"testing"
)

// TestRowBlocks checks ExpandRowBlocks on a table with an empty block and
// CheckRowBlocks' answer to each kind of bad table.
func TestRowBlocks(t *testing.T) {
	blocks := []RowBlock{{0, 1, 5}, {2, 0, 0}, {2, 2, 7}, {3, 0, 9}}
	if err := CheckRowBlocks(blocks, 5); err != nil {
		t.Fatal(err)
	}
	want := []int32{1, 5, 1, 6, 2, 7, 0, 9, 0, 10}
	if got := ExpandRowBlocks(blocks, 5); !slices.Equal(got, want) {
		t.Errorf("ExpandRowBlocks = %v, want %v", got, want)
	}
	for _, c := range []struct {
		blocks []RowBlock
		R      int
		want   string
	}{
		{nil, 3, "first block does not start at row 0"},
		{[]RowBlock{{1, 0, 0}}, 3, "first block does not start at row 0"},
		{[]RowBlock{{0, 0, 0}, {4, 0, 0}}, 3, "block 1 starts at row 4, outside [0, 3]"},
		{[]RowBlock{{0, 0, 0}, {2, 0, 0}, {1, 0, 0}}, 3, "block 2 starts at row 1, before block 1"},
		{[]RowBlock{{0, -1, 0}}, 3, "block 0 names rank -1"},
		{[]RowBlock{{0, 0, 1<<31 - 2}}, 3, "overflow int32"},
	} {
		err := CheckRowBlocks(c.blocks, c.R)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("CheckRowBlocks(%v, %d) = %v, want an error with %q", c.blocks, c.R, err, c.want)
		}
	}
	if err := CheckRowBlocks(nil, 0); err != nil {
		t.Errorf("no rows, no blocks: %v", err)
	}
}
