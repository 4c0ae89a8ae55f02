package backend

import (
	"fmt"

	"gorgonia.org/tensor"
)

// Groups is how a grouped op (GroupedMatMul, GroupedMatMulTN and the fused
// MoE ops) splits its rows into consecutive groups, one per matrix of its
// stack: group g is the rows [o_g, o_g+n_g), o_g the rows of the groups
// before it. The split is given on the host (Rows), on the device
// (Offsets), or both, and then both describe the same split:
//
//   - Rows[g] = n_g. The groups may end before the operands' last row;
//     the rows after them are not touched.
//   - Offsets is an Int32 [G+1] tensor of the prefix sums: o_0 = 0, o_g
//     non-decreasing, and o_G the operands' rows. The host need not read
//     it: the MoE layer's dropless dispatch on one expert rank has
//     RouteByExpert write it on the device, so the experts' forward
//     products are sized there, with no round trip to the host.
//
// A backend's kernels read Offsets where they are given; a path that needs
// the counts on the host takes Rows, or reads Offsets (GroupRows), which
// waits for the device.
type Groups struct {
	Rows    []int
	Offsets Tensor
}

// Len is the number of groups.
func (g Groups) Len() int {
	if g.Rows != nil || g.Offsets == nil {
		return len(g.Rows)
	}
	return g.Offsets.Len() - 1
}

// Held is the rows the groups hold, of operands of opRows rows: all of
// them with Offsets (which end at the last row), else the sum of Rows.
func (g Groups) Held(opRows int) int {
	if g.Offsets != nil {
		return opRows
	}
	return sumRows(g.Rows)
}

// CheckGroups checks g against operands of rows rows as far as the host
// can without reading Offsets: at least one group, Rows' counts
// non-negative and within rows, Offsets an Int32 vector of Len()+1
// entries. GroupRows checks Offsets' contents when it reads them.
func CheckGroups(g Groups, rows int) error {
	if g.Rows == nil && g.Offsets == nil {
		return fmt.Errorf("no groups: neither row counts nor offsets")
	}
	if g.Rows != nil {
		if len(g.Rows) == 0 {
			return fmt.Errorf("no groups: the row counts are empty")
		}
		if err := checkGroupRows(g.Rows, rows); err != nil {
			return err
		}
	}
	if o := g.Offsets; o != nil {
		if o.DType() != Int32 || len(o.Shape()) != 1 {
			return fmt.Errorf("offsets are %v %v, want an Int32 vector", o.DType(), o.Shape())
		}
		if o.Len() < 2 {
			return fmt.Errorf("no groups: %d offsets", o.Len())
		}
		if g.Rows != nil && o.Len() != len(g.Rows)+1 {
			return fmt.Errorf("%d row counts but %d offsets, want %d", len(g.Rows), o.Len(), len(g.Rows)+1)
		}
		if sum := sumRows(g.Rows); g.Rows != nil && sum != rows {
			return fmt.Errorf("the row counts hold %d rows but offsets end at the operands' %d", sum, rows)
		}
	}
	return nil
}

// GroupRows returns g's row counts on the host for operands of rows rows:
// Rows when given, else Offsets read from b (a download, which waits for
// the device) and checked (first 0, non-decreasing, last rows).
func GroupRows(b Backend, g Groups, rows int) ([]int, error) {
	if err := CheckGroups(g, rows); err != nil {
		return nil, err
	}
	if g.Rows != nil {
		return g.Rows, nil
	}
	return OffsetRows(DownloadInt32(b, g.Offsets), rows)
}

// OffsetRows turns group offsets (o_0 = 0, non-decreasing, o_G = rows)
// into row counts, or says what is wrong with them.
func OffsetRows(offsets []int32, rows int) ([]int, error) {
	G := len(offsets) - 1
	if G < 1 || offsets[0] != 0 || int(offsets[G]) != rows {
		return nil, fmt.Errorf("group offsets %s: want %d+1 offsets from 0 to the operands' %d rows", brief(offsets), G, rows)
	}
	out := make([]int, G)
	for g := range G {
		n := int(offsets[g+1]) - int(offsets[g])
		if n < 0 {
			return nil, fmt.Errorf("group offsets %s: group %d ends at row %d before it starts (%d)", brief(offsets), g, offsets[g+1], offsets[g])
		}
		out[g] = n
	}
	return out, nil
}

func sumRows(rows []int) int {
	n := 0
	for _, r := range rows {
		n += r
	}
	return n
}

// brief prints up to 9 offsets, then the count of the rest.
func brief(v []int32) string {
	if len(v) <= 9 {
		return fmt.Sprint(v)
	}
	return fmt.Sprintf("%v... (%d more)", v[:8], len(v)-8)
}

// PendingDownload is a copy to the host under way (Backend.StartDownload):
// calling it waits for the copy and returns it.
type PendingDownload func() *tensor.Dense
