package report

// The charts, drawn by gonum/plot and encoded as PNG: an SVG would name
// its fonts and leave them to the browser, whose glyphs are wider or
// narrower than the ones gonum/plot measured the labels with.

import (
	"bytes"
	"fmt"
	"image/color"
	"math"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/palette/moreland"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Chart sizes.
const (
	lineWidth, lineHeight = 16 * vg.Centimeter, 8 * vg.Centimeter
	heatWidth             = 24 * vg.Centimeter
)

// series is one line of a line chart; points with a NaN y are left out.
type series struct {
	name   string
	x, y   []float64
	dashed bool
	points bool // draw each point (sparse series: the validation loss)
}

// lineColor is the colour of a chart's i-th line: blue, red, green,
// purple, then again.
func lineColor(i int) color.Color {
	colors := []color.RGBA{{R: 31, G: 119, B: 180, A: 255}, {R: 214, G: 39, B: 40, A: 255},
		{R: 44, G: 160, B: 44, A: 255}, {R: 148, G: 103, B: 189, A: 255}}
	return colors[i%len(colors)]
}

// lineChart draws series over steps.
func lineChart(title, yLabel string, logY bool, ss ...series) ([]byte, error) {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "step"
	p.Y.Label.Text = yLabel
	p.Add(plotter.NewGrid())
	if logY {
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	}
	drawn := 0
	for i, s := range ss {
		var xys plotter.XYs
		for j := range s.x {
			if math.IsNaN(s.y[j]) || math.IsInf(s.y[j], 0) || logY && s.y[j] <= 0 {
				continue
			}
			xys = append(xys, plotter.XY{X: s.x[j], Y: s.y[j]})
		}
		if len(xys) == 0 {
			continue
		}
		l, err := plotter.NewLine(xys)
		if err != nil {
			return nil, err
		}
		l.Color = lineColor(i)
		l.Width = vg.Points(1.5)
		if s.dashed {
			l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		}
		p.Add(l)
		if s.points {
			sc, err := plotter.NewScatter(xys)
			if err != nil {
				return nil, err
			}
			sc.Color, sc.Shape, sc.Radius = l.Color, draw.CircleGlyph{}, vg.Points(2.5)
			p.Add(sc)
		}
		if len(ss) > 1 {
			p.Legend.Add(s.name, l)
		}
		drawn++
	}
	if drawn == 0 {
		return nil, nil // nothing to draw: no chart
	}
	p.Legend.Top = true
	return render(p, lineWidth, lineHeight)
}

// loadGrid is a layer's expert load over the logged steps as a heat map's
// grid: column c is the c-th logged step, row r expert r, the value the
// expert's share of assignments over the fair share 1/E.
type loadGrid struct {
	steps []float64
	load  [][]float64 // [step][expert]
}

func (g loadGrid) Dims() (c, r int)   { return len(g.steps), len(g.load[0]) }
func (g loadGrid) Z(c, r int) float64 { return g.load[c][r] }
func (g loadGrid) X(c int) float64    { return g.steps[c] }
func (g loadGrid) Y(r int) float64    { return float64(r) }

// Heat map colour range: from no load (0) through the fair share (1,
// grey) to twice it and more (2).
const heatMax = 2

// heatmap draws a layer's load over steps, expert names on the y axis
// marked with their flags.
func heatmap(layer int, g loadGrid, flags map[int]string) ([]byte, error) {
	cmap := moreland.SmoothBlueRed()
	cmap.SetMin(0)
	cmap.SetMax(heatMax)
	h := plotter.NewHeatMap(g, cmap.Palette(64))
	h.Min, h.Max = 0, heatMax
	h.Overflow = color.RGBA{R: 100, G: 0, B: 20, A: 255}
	h.NaN = color.Gray{Y: 200}
	p := plot.New()
	p.Title.Text = fmt.Sprintf("layer %d: load / fair share (blue: none, grey: 1, red: 2 or more)", layer)
	p.X.Label.Text = "step"
	p.Y.Label.Text = "expert"
	p.Add(h)
	_, experts := g.Dims()
	ticks := make([]plot.Tick, experts)
	for e := range experts {
		label := fmt.Sprint(e)
		if f := flags[e]; f != "" {
			label += " " + f
		}
		ticks[e] = plot.Tick{Value: float64(e), Label: label}
	}
	p.Y.Tick.Marker = plot.ConstantTicks(ticks)
	p.Y.Min, p.Y.Max = -0.5, float64(experts)-0.5
	// One row per expert, at least 1 cm for a few experts.
	height := max(6*vg.Centimeter, vg.Length(experts)*0.6*vg.Centimeter+3*vg.Centimeter)
	return render(p, heatWidth, height)
}

// breakdownChart draws a bench train result's time per kind of work.
func breakdownChart(b *Bench) ([]byte, error) {
	rows := b.Figures.Breakdown
	values := make(plotter.Values, len(rows))
	names := make([]string, len(rows))
	// Longest at the top: the bars go bottom-up.
	for i, r := range rows {
		j := len(rows) - 1 - i
		values[j], names[j] = r.MS, fmt.Sprintf("%s (%.0f%%)", r.Kind, 100*r.Share)
	}
	bars, err := plotter.NewBarChart(values, vg.Points(12))
	if err != nil {
		return nil, err
	}
	bars.Horizontal = true
	bars.Color = lineColor(0)
	bars.LineStyle.Width = 0
	p := plot.New()
	p.Title.Text = fmt.Sprintf("%s on %s: profiled step %.1f ms", b.Recipe, machineName(b), b.Figures.ProfiledStepMS)
	p.X.Label.Text = "ms per step"
	p.Add(plotter.NewGrid(), bars)
	p.NominalY(names...)
	height := max(6*vg.Centimeter, vg.Length(len(rows))*0.7*vg.Centimeter+3*vg.Centimeter)
	return render(p, lineWidth, height)
}

func machineName(b *Bench) string {
	if b.Machine.Device != "" {
		return b.Machine.Device
	}
	if b.Machine.CPU != "" {
		return b.Machine.CPU
	}
	return b.Machine.Backend
}

// render draws p as a PNG of w by h at 144 dots per inch (sharp on a
// high-density screen). gonum/plot panics on some degenerate data: that
// becomes an error.
func render(p *plot.Plot, w, h vg.Length) (out []byte, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("drawing %q: %v", p.Title.Text, r)
		}
	}()
	c := vgimg.NewWith(vgimg.UseWH(w, h), vgimg.UseDPI(144), vgimg.UseBackgroundColor(color.White))
	p.Draw(draw.New(c))
	var buf bytes.Buffer
	if _, err := (vgimg.PngCanvas{Canvas: c}).WriteTo(&buf); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
