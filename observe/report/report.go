// Package report writes one self-contained HTML file about a training run
// (`mktrain report RUN_DIR`): the loss and validation curves, the learning
// rate, the gradient norm, tokens/s, MFU and memory, and per MoE layer a
// heat map of each expert's load over the steps with dead and overloaded
// experts flagged; with a `mktrain bench train` result, where a step's
// time goes. The charts are drawn by gonum/plot as PNG images and embedded
// in the page as data URIs, so the file needs nothing beside it.
//
// It reads what a run directory keeps: metrics.jsonl (one line per logged
// step, with the experts' load; log.every sets how dense the curves and
// heat maps are) and recipe.yaml.
//
// # Flags
//
// An expert's load is its share of its layer's token assignments over the
// fair share 1/E. Over the last quarter of the logged steps (at least one),
// an expert whose mean load is below DeadBelow is flagged dead, one above
// OverloadedAbove overloaded.
package report

import (
	"encoding/base64"
	"errors"
	"fmt"
	"html/template"
	"io"
	"math"
	"os"
	"path/filepath"
	"time"
)

// Thresholds of the experts' flags, on the load over the fair share.
const (
	DeadBelow       = 0.1 // gets less than a tenth of its share
	OverloadedAbove = 2.0 // gets more than twice its share
)

// Run is what a report shows.
type Run struct {
	Dir    string
	Recipe string // recipe.yaml, "" when missing
	Steps  []Step
	Bench  *Bench // nil without one
}

// LoadRun reads a run directory's metrics.jsonl and recipe.yaml.
func LoadRun(dir string) (Run, error) {
	st, err := os.Stat(dir)
	if err != nil {
		return Run{}, err
	}
	if !st.IsDir() {
		return Run{}, fmt.Errorf("%s is not a run directory", dir)
	}
	path := filepath.Join(dir, "metrics.jsonl")
	steps, err := ReadMetrics(path)
	if errors.Is(err, os.ErrNotExist) {
		return Run{}, fmt.Errorf("%s has no metrics.jsonl: not a run directory, or its run logged no step yet", dir)
	}
	if err != nil {
		return Run{}, err
	}
	if len(steps) == 0 {
		return Run{}, fmt.Errorf("%s holds no logged step yet", path)
	}
	recipe, err := os.ReadFile(filepath.Join(dir, "recipe.yaml"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return Run{}, err
	}
	return Run{Dir: dir, Recipe: string(recipe), Steps: steps}, nil
}

// ExpertFlag is an expert flagged dead or overloaded.
type ExpertFlag struct {
	Layer, Expert int
	Kind          string  // "dead" or "overloaded"
	Load          float64 // mean load over the fair share in the window
	FromStep      int     // the window: logged steps FromStep..ToStep
	ToStep        int
}

// FlagExperts finds the dead and overloaded experts of steps (see the
// package doc).
func FlagExperts(steps []Step) []ExpertFlag {
	var withLoad []Step
	for _, s := range steps {
		if len(s.Experts) > 0 {
			withLoad = append(withLoad, s)
		}
	}
	if len(withLoad) == 0 {
		return nil
	}
	window := withLoad[len(withLoad)-max(1, len(withLoad)/4):]
	var flags []ExpertFlag
	for li, layer := range window[len(window)-1].Experts {
		experts := len(layer.Fraction)
		for e := range experts {
			sum, n := 0.0, 0
			for _, s := range window {
				if li < len(s.Experts) && e < len(s.Experts[li].Fraction) {
					sum += s.Experts[li].Fraction[e] * float64(experts)
					n++
				}
			}
			if n == 0 {
				continue
			}
			load := sum / float64(n)
			f := ExpertFlag{Layer: layer.Layer, Expert: e, Load: load, FromStep: window[0].Step, ToStep: window[len(window)-1].Step}
			switch {
			case load < DeadBelow:
				f.Kind = "dead"
			case load > OverloadedAbove:
				f.Kind = "overloaded"
			default:
				continue
			}
			flags = append(flags, f)
		}
	}
	return flags
}

// chart is a rendered chart for the page.
type chart struct {
	Title string
	URI   template.URL // data:image/png;base64,...
}

func dataURI(png []byte) template.URL {
	return template.URL("data:image/png;base64," + base64.StdEncoding.EncodeToString(png))
}

// page is the template's data.
type page struct {
	Dir, Recipe, Generated string
	Summary                [][2]string
	Charts                 []chart
	Layers                 []layerSection
	Bench                  *chart
	BenchNote              string
	Thresholds             string
}

type layerSection struct {
	Layer int
	Chart chart
	Flags []ExpertFlag
}

// Write renders the report of r as one HTML page.
func Write(w io.Writer, r Run) error {
	pg, err := build(r)
	if err != nil {
		return err
	}
	return pageTemplate().Execute(w, pg)
}

func build(r Run) (page, error) {
	pg := page{Dir: r.Dir, Recipe: r.Recipe, Generated: time.Now().UTC().Format(time.RFC3339),
		Thresholds: fmt.Sprintf("dead: below %.1f of the fair share, overloaded: above %.1f times it, mean over the last quarter of the logged steps", DeadBelow, OverloadedAbove)}
	steps := r.Steps
	n := len(steps)
	x := make([]float64, n)
	col := func(f func(Step) float64) []float64 {
		out := make([]float64, n)
		for i, s := range steps {
			out[i] = f(s)
		}
		return out
	}
	for i, s := range steps {
		x[i] = float64(s.Step)
	}
	opt := func(p *float64) float64 {
		if p == nil {
			return math.NaN()
		}
		return *p
	}
	valLoss := col(func(s Step) float64 { return opt(s.ValLoss) })
	last := steps[n-1]
	pg.Summary = [][2]string{
		{"last logged step", fmt.Sprint(last.Step)},
		{"training loss", fmt.Sprintf("%.4f", last.Loss)},
		{"tokens", fmt.Sprint(last.Tokens)},
		{"training time (this run's part)", (time.Duration(last.ElapsedS * float64(time.Second))).Round(time.Second).String()},
	}
	if i := lastValid(valLoss); i >= 0 {
		pg.Summary = append(pg.Summary, [2]string{"validation loss",
			fmt.Sprintf("%.4f at step %d (%d batches)", valLoss[i], steps[i].Step, steps[i].ValBatches)})
	}

	type spec struct {
		title, y string
		log      bool
		ss       []series
	}
	specs := []spec{
		{"loss", "nats per token", false, []series{
			{name: "training", x: x, y: col(func(s Step) float64 { return s.Loss })},
			{name: "validation", x: x, y: valLoss, points: true, dashed: true},
		}},
		{"load-balancing losses (unweighted, summed over layers)", "loss", false, []series{
			{name: "aux loss", x: x, y: col(func(s Step) float64 { return s.AuxLoss })},
			{name: "z-loss", x: x, y: col(func(s Step) float64 { return s.ZLoss }), dashed: true},
		}},
		{"learning rate", "lr", false, []series{{x: x, y: col(func(s Step) float64 { return s.LR })}}},
		{"gradient norm (before clipping)", "norm", true, []series{{x: x, y: col(func(s Step) float64 { return s.GradNorm })}}},
		{"throughput", "tokens/s", false, []series{{x: x, y: col(func(s Step) float64 { return s.TokensPerSec })}}},
		{"model FLOPs utilisation", "MFU", false, []series{{x: x, y: col(func(s Step) float64 { return opt(s.MFU) })}}},
		{"peak memory", "GiB", false, []series{{x: x, y: col(func(s Step) float64 {
			if s.PeakMemory == 0 {
				return math.NaN()
			}
			return float64(s.PeakMemory) / (1 << 30)
		})}}},
	}
	for _, sp := range specs {
		img, err := lineChart(sp.title, sp.y, sp.log, sp.ss...)
		if err != nil {
			return page{}, err
		}
		if img != nil { // nil: no data (the MFU on the CPU)
			pg.Charts = append(pg.Charts, chart{Title: sp.title, URI: dataURI(img)})
		}
	}

	flags := FlagExperts(steps)
	for _, g := range loadGrids(steps) {
		byExpert := map[int]string{}
		var layerFlags []ExpertFlag
		for _, f := range flags {
			if f.Layer == g.layer {
				byExpert[f.Expert] = f.Kind
				layerFlags = append(layerFlags, f)
			}
		}
		img, err := heatmap(g.layer, g.grid, byExpert)
		if err != nil {
			return page{}, err
		}
		pg.Layers = append(pg.Layers, layerSection{Layer: g.layer, Chart: chart{Title: fmt.Sprintf("layer %d", g.layer), URI: dataURI(img)}, Flags: layerFlags})
	}

	if r.Bench != nil {
		img, err := breakdownChart(r.Bench)
		if err != nil {
			return page{}, err
		}
		pg.Bench = &chart{Title: "time breakdown", URI: dataURI(img)}
		f := r.Bench.Figures
		pg.BenchNote = fmt.Sprintf("bench train of %s, commit %.12s, %s: %.0f tokens/s, median step %.1f ms",
			r.Bench.Recipe, r.Bench.Commit, r.Bench.Date, f.TokensPerSec, f.StepMSMedian)
	}
	return pg, nil
}

func lastValid(v []float64) int {
	for i := len(v) - 1; i >= 0; i-- {
		if !math.IsNaN(v[i]) {
			return i
		}
	}
	return -1
}

// layerGrid is one layer's heat map data.
type layerGrid struct {
	layer int
	grid  loadGrid
}

// loadGrids gathers each layer's load over the steps that logged it with
// the same number of experts as the last one.
func loadGrids(steps []Step) []layerGrid {
	var lastLoad *Step
	for i := range steps {
		if len(steps[i].Experts) > 0 {
			lastLoad = &steps[i]
		}
	}
	if lastLoad == nil {
		return nil
	}
	var out []layerGrid
	for li, l := range lastLoad.Experts {
		experts := len(l.Fraction)
		if experts == 0 {
			continue
		}
		g := loadGrid{}
		for _, s := range steps {
			if li >= len(s.Experts) || len(s.Experts[li].Fraction) != experts {
				continue
			}
			row := make([]float64, experts)
			for e, f := range s.Experts[li].Fraction {
				row[e] = f * float64(experts)
			}
			g.steps = append(g.steps, float64(s.Step))
			g.load = append(g.load, row)
		}
		if len(g.steps) == 1 { // a heat map needs two columns to span
			g.steps = append(g.steps, g.steps[0]+1)
			g.load = append(g.load, g.load[0])
		}
		out = append(out, layerGrid{layer: l.Layer, grid: g})
	}
	return out
}

func pageTemplate() *template.Template {
	return template.Must(template.New("report").Parse(`<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>mktrain report: {{.Dir}}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; } td, th { padding: 0.2em 1em 0.2em 0; text-align: left; vertical-align: top; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; } .charts img { width: 530px; }
img.wide { width: 100%; } .flag-dead { color: #1f4e9c; } .flag-overloaded { color: #a01020; }
pre { background: #f6f6f6; padding: 1em; overflow: auto; font-size: 0.85em; }
.note { color: #666; font-size: 0.9em; }
</style>
</head>
<body>
<h1>mktrain report: {{.Dir}}</h1>
<p class="note">Generated {{.Generated}} from {{.Dir}}/metrics.jsonl.</p>
<table>{{range .Summary}}<tr><th>{{index . 0}}</th><td>{{index . 1}}</td></tr>{{end}}</table>

<h2>Training</h2>
<div class="charts">{{range .Charts}}<img src="{{.URI}}" alt="{{.Title}}" title="{{.Title}}">{{end}}</div>

{{if .Layers}}<h2>Expert load</h2>
<p class="note">Each cell is an expert's share of its layer's token assignments at a logged step, over the fair share (1 / experts). Flags: {{.Thresholds}}.</p>
{{range .Layers}}<h3>Layer {{.Layer}}</h3>
<img class="wide" src="{{.Chart.URI}}" alt="layer {{.Layer}} expert load">
{{if .Flags}}<table><tr><th>expert</th><th>flag</th><th>mean load / fair share</th><th>steps</th></tr>
{{range .Flags}}<tr class="flag-{{.Kind}}"><td>{{.Expert}}</td><td>{{.Kind}}</td><td>{{printf "%.2f" .Load}}</td><td>{{.FromStep}}–{{.ToStep}}</td></tr>
{{end}}</table>{{else}}<p class="note">No dead or overloaded expert.</p>{{end}}
{{end}}{{end}}

{{if .Bench}}<h2>Where a step's time goes</h2>
<p class="note">{{.BenchNote}}</p>
<img src="{{.Bench.URI}}" alt="time breakdown">{{end}}

{{if .Recipe}}<h2>Recipe</h2>
<pre>{{.Recipe}}</pre>{{end}}
</body>
</html>
`))
}
