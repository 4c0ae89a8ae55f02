package recipes

import (
	"math"
	"math/rand/v2"
	"reflect"
	"strconv"
	"strings"

	"github.com/mktrain/mktrain/engine"
)

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)) }

func quote(s string) string { return strconv.Quote(s) }

// trickyStrings are strings that YAML would read as something else unless
// they are quoted, or that need escapes.
var trickyStrings = []string{
	"", " ", "auto", "null", "Null", "~", "true", "False", "yes", "no", "on", "off", "y", "n",
	"1", "-1", "1e3", "0x10", "010", ".inf", "-.inf", ".nan", "NaN", "3.5",
	"a: b", "a:b", "#x", "x #y", "- x", "*x", "&x", "!x", "%x", "@x", "`x", "'x'", `"x"`,
	"[a]", "{a: 1}", "a,b", " leading", "trailing ", "two\nlines", "tab\there", "bell\a",
	"data/train_*.bin", `C:\data\*.bin`, "ünïcödé", "日本語", "emoji 🚀", "---", "...", "? x", "| x", "> x",
	strings.Repeat("long words ", 20),
}

// randomConfig sets every leaf of a Config to a random value of its type,
// valid or not: the canonical form must carry any value.
func randomConfig(rng *rand.Rand) engine.Config {
	cfg := engine.DefaultConfig()
	for _, l := range leaves() {
		v, err := lookup(&cfg, l.path)
		if err != nil {
			panic(err)
		}
		switch v.Kind() {
		case reflect.Int:
			switch rng.IntN(3) {
			case 0:
				v.SetInt(rng.Int64N(2000) - 1000)
			case 1:
				v.SetInt(int64(rng.Uint64()))
			default:
				v.SetInt([]int64{0, 1, math.MaxInt64, math.MinInt64}[rng.IntN(4)])
			}
		case reflect.Uint64:
			v.SetUint([]uint64{0, 1, math.MaxUint64, rng.Uint64()}[rng.IntN(4)])
		case reflect.Float64:
			specials := []float64{0, math.Copysign(0, -1), 1, -1, math.Inf(1), math.Inf(-1),
				math.MaxFloat64, math.SmallestNonzeroFloat64, 1e-5, 3e-4, 0.1}
			if rng.IntN(2) == 0 {
				v.SetFloat(specials[rng.IntN(len(specials))])
			} else {
				v.SetFloat(rng.NormFloat64() * math.Pow(10, float64(rng.IntN(600)-300)))
			}
		case reflect.String:
			if rng.IntN(3) > 0 {
				v.SetString(trickyStrings[rng.IntN(len(trickyStrings))])
			} else {
				runes := make([]rune, rng.IntN(12))
				for i := range runes {
					runes[i] = rune(rng.IntN(0x3000) + 1)
				}
				v.SetString(strings.ToValidUTF8(string(runes), "?"))
			}
		case reflect.Bool:
			v.SetBool(rng.IntN(2) == 0)
		default:
			panic("randomConfig: no generator for " + l.path)
		}
	}
	return cfg
}
