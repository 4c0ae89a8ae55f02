package launch_test

import (
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/launch"
)

func env(kv ...string) func(string) string {
	m := map[string]string{}
	for i := 0; i < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return func(k string) string { return m[k] }
}

// launchFields is a Launch without its unexported origins, for comparison.
type launchFields struct {
	NNodes, NodeRank       int
	MasterAddr             string
	MasterPort, LocalRanks int
	Source                 string
}

func fields(l launch.Launch) launchFields {
	return launchFields{l.NNodes, l.NodeRank, l.MasterAddr, l.MasterPort, l.LocalRanks, l.Source}
}

func TestLaunchFromEnv(t *testing.T) {
	rank := func(r int) launch.Flags { return launch.Flags{NodeRank: r, NodeRankSet: true} }
	for _, c := range []struct {
		name  string
		env   func(string) string
		flags launch.Flags
		want  launchFields
	}{
		{"nothing set", env(), launch.Flags{LocalRanks: 8},
			launchFields{1, 0, "", 29500, 8, "single node"}},
		{"torchrun-style variables", env("NNODES", "4", "NODE_RANK", "2", "MASTER_ADDR", "10.0.0.1", "MASTER_PORT", "29501"), launch.Flags{},
			launchFields{4, 2, "10.0.0.1", 29501, 0, "torchrun env"}},
		{"default port", env("NNODES", "2", "NODE_RANK", "1", "MASTER_ADDR", "head"), launch.Flags{},
			launchFields{2, 1, "head", 29500, 0, "torchrun env"}},
		{"torchrun's group variables", env("GROUP_WORLD_SIZE", "3", "GROUP_RANK", "1", "MASTER_ADDR", "h", "WORLD_SIZE", "24", "RANK", "9"), launch.Flags{},
			launchFields{3, 1, "h", 29500, 0, "torchrun env"}},
		{"WORLD_SIZE and RANK with one process per node", env("WORLD_SIZE", "3", "RANK", "2", "LOCAL_WORLD_SIZE", "1", "MASTER_ADDR", "h"), launch.Flags{},
			launchFields{3, 2, "h", 29500, 0, "torchrun env"}},
		{"WORLD_SIZE=1 alone is a single node", env("WORLD_SIZE", "1", "RANK", "0"), launch.Flags{},
			launchFields{1, 0, "", 29500, 0, "single node"}},
		{"NNODES wins over a GPU-counting WORLD_SIZE", env("NNODES", "2", "NODE_RANK", "0", "WORLD_SIZE", "16", "RANK", "0", "MASTER_ADDR", "h"), launch.Flags{},
			launchFields{2, 0, "h", 29500, 0, "torchrun env"}},
		{"SLURM", env("SLURM_NNODES", "4", "SLURM_NODEID", "3", "SLURM_PROCID", "3", "SLURM_JOB_NODELIST", "gpu[01-04,07],login1"), launch.Flags{},
			launchFields{4, 3, "gpu01", 29500, 0, "SLURM"}},
		{"SLURM step inside a larger allocation", env("SLURM_NNODES", "8", "SLURM_JOB_NODELIST", "n[1-8]", "SLURM_STEP_NUM_NODES", "2", "SLURM_STEP_NUM_TASKS", "2", "SLURM_STEP_NODELIST", "n[5-6]", "SLURM_NODEID", "1"), launch.Flags{},
			launchFields{2, 1, "n5", 29500, 0, "SLURM"}},
		{"SLURM_PROCID when SLURM_NODEID is missing", env("SLURM_NNODES", "2", "SLURM_PROCID", "1", "SLURM_JOB_NODELIST", "a,b"), launch.Flags{},
			launchFields{2, 1, "a", 29500, 0, "SLURM"}},
		{"torchrun variables win over SLURM's", env("SLURM_NNODES", "4", "SLURM_NODEID", "3", "SLURM_JOB_NODELIST", "gpu[1-4]", "NNODES", "2", "NODE_RANK", "1", "MASTER_ADDR", "x", "MASTER_PORT", "1234"), launch.Flags{},
			launchFields{2, 1, "x", 1234, 0, "torchrun env"}},
		{"MASTER_PORT under SLURM", env("SLURM_NNODES", "2", "SLURM_NODEID", "0", "SLURM_JOB_NODELIST", "a,b", "MASTER_PORT", "40000"), launch.Flags{},
			launchFields{2, 0, "a", 40000, 0, "SLURM"}},
		{"flags win over everything", env("NNODES", "4", "NODE_RANK", "3", "MASTER_ADDR", "x", "MASTER_PORT", "1", "SLURM_NNODES", "9"),
			launch.Flags{NNodes: 2, NodeRank: 1, NodeRankSet: true, MasterAddr: "y", MasterPort: 2345, LocalRanks: 4},
			launchFields{2, 1, "y", 2345, 4, "flags"}},
		{"a flag rank 0 overrides NODE_RANK", env("NNODES", "2", "NODE_RANK", "1", "MASTER_ADDR", "h"), rank(0),
			launchFields{2, 0, "h", 29500, 0, "torchrun env"}},
		{"a single-node SLURM job with a node list it does not need", env("SLURM_NNODES", "1", "SLURM_NODEID", "0", "SLURM_JOB_NODELIST", "bad[1-"), launch.Flags{},
			launchFields{1, 0, "", 29500, 0, "SLURM"}},
		{"blank variables are unset", env("NNODES", " ", "NODE_RANK", "", "MASTER_PORT", " "), launch.Flags{},
			launchFields{1, 0, "", 29500, 0, "single node"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			l, err := launch.FromEnv(c.env, c.flags)
			if err != nil {
				t.Fatalf("FromEnv: %v", err)
			}
			if got := fields(l); got != c.want {
				t.Errorf("got  %+v\nwant %+v", got, c.want)
			}
		})
	}
}

func TestLaunchFromEnvErrors(t *testing.T) {
	for _, c := range []struct {
		name  string
		env   func(string) string
		flags launch.Flags
		want  []string // every line of the error, in order
	}{
		{"rank out of range", env("NNODES", "4", "NODE_RANK", "5", "MASTER_ADDR", "h"), launch.Flags{},
			[]string{"launch: NODE_RANK=5 but NNODES=4: the node rank must be below the node count"}},
		{"flag rank out of an env range", env("NNODES", "4", "MASTER_ADDR", "h"), launch.Flags{NodeRank: 4, NodeRankSet: true},
			[]string{"launch: --node-rank=4 but NNODES=4: the node rank must be below the node count"}},
		{"SLURM rank out of range", env("SLURM_NNODES", "2", "SLURM_NODEID", "2", "SLURM_JOB_NODELIST", "a,b"), launch.Flags{},
			[]string{"launch: SLURM_NODEID=2 but SLURM_NNODES=2: the node rank must be below the node count"}},
		{"bad port", env("MASTER_PORT", "abc"), launch.Flags{},
			[]string{"launch: MASTER_PORT=abc is not a port (1-65535)"}},
		{"port out of range", env("NNODES", "2", "NODE_RANK", "0", "MASTER_ADDR", "h", "MASTER_PORT", "70000"), launch.Flags{},
			[]string{"launch: MASTER_PORT=70000 is not a port (1-65535)"}},
		{"flag port out of range", env("NNODES", "2", "NODE_RANK", "0", "MASTER_ADDR", "h"), launch.Flags{MasterPort: -3},
			[]string{"launch: --master-port=-3 is not a port (1-65535)"}},
		{"not a number", env("NNODES", "four", "NODE_RANK", "x1"), launch.Flags{},
			[]string{"launch: NNODES=four is not a whole number", "launch: NODE_RANK=x1 is not a whole number"}},
		{"zero nodes", env("NNODES", "0", "NODE_RANK", "0"), launch.Flags{},
			[]string{"launch: NNODES=0: a run needs at least 1 node"}},
		{"negative flag nodes", env(), launch.Flags{NNodes: -2},
			[]string{"launch: --nnodes=-2: a run needs at least 1 node"}},
		{"negative rank", env("NNODES", "2", "NODE_RANK", "-1", "MASTER_ADDR", "h"), launch.Flags{},
			[]string{"launch: NODE_RANK=-1: the node rank counts from 0"}},
		{"count without rank", env("NNODES", "4", "MASTER_ADDR", "h"), launch.Flags{},
			[]string{"launch: NNODES=4 but no node rank: set NODE_RANK or --node-rank on each node"}},
		{"rank without count", env("NODE_RANK", "2"), launch.Flags{},
			[]string{"launch: NODE_RANK=2 but no node count: set NNODES or --nnodes"}},
		{"count without address", env("NNODES", "2", "NODE_RANK", "1"), launch.Flags{},
			[]string{"launch: NNODES=2 but no master address: set MASTER_ADDR or --master-addr to node 0's host name or IP"}},
		{"address with a port", env("NNODES", "2", "NODE_RANK", "1", "MASTER_ADDR", "10.0.0.1:29500"), launch.Flags{},
			[]string{"launch: MASTER_ADDR=10.0.0.1:29500 holds a port; give the host alone and the port in MASTER_PORT or --master-port"}},
		{"synonyms disagree", env("NNODES", "2", "GROUP_WORLD_SIZE", "3", "NODE_RANK", "0", "GROUP_RANK", "1", "MASTER_ADDR", "h"), launch.Flags{},
			[]string{"launch: NNODES=2 but GROUP_WORLD_SIZE=3: they must agree", "launch: NODE_RANK=0 but GROUP_RANK=1: they must agree"}},
		{"several processes per node", env("LOCAL_WORLD_SIZE", "8", "WORLD_SIZE", "16", "RANK", "3", "NNODES", "2", "NODE_RANK", "0", "MASTER_ADDR", "h"), launch.Flags{},
			[]string{"launch: LOCAL_WORLD_SIZE=8: mktrain runs one process per node, which drives all the node's GPUs; start one process per node (torchrun --nproc-per-node=1)"}},
		{"several SLURM tasks per node", env("SLURM_STEP_NUM_TASKS", "16", "SLURM_STEP_NUM_NODES", "2", "SLURM_NODEID", "0", "SLURM_STEP_NODELIST", "a,b"), launch.Flags{},
			[]string{"launch: SLURM_STEP_NUM_TASKS=16 on SLURM_STEP_NUM_NODES=2: mktrain runs one process per node, which drives all the node's GPUs; use srun --ntasks-per-node=1"}},
		{"ambiguous WORLD_SIZE", env("WORLD_SIZE", "16", "RANK", "3"), launch.Flags{},
			[]string{"launch: WORLD_SIZE=16 but no node count: WORLD_SIZE counts processes and often GPUs, so mktrain reads it as the node count only with LOCAL_WORLD_SIZE=1; set NNODES or --nnodes"}},
		{"bad SLURM node list", env("SLURM_NNODES", "2", "SLURM_NODEID", "0", "SLURM_JOB_NODELIST", "gpu[01-04"), launch.Flags{},
			[]string{`launch: SLURM_JOB_NODELIST=gpu[01-04: host "gpu[01-04" has '[' without ']'`,
				"launch: SLURM_NNODES=2 but no master address: set MASTER_ADDR or --master-addr to node 0's host name or IP"}},
		{"negative local ranks", env(), launch.Flags{LocalRanks: -1},
			[]string{"launch: local ranks is -1; it must be 0 (not decided) or more"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			l, err := launch.FromEnv(c.env, c.flags)
			if err == nil {
				t.Fatalf("no error; got %+v", fields(l))
			}
			if got := strings.Split(err.Error(), "\n"); !slices.Equal(got, c.want) {
				t.Errorf("error:\n%s\nwant:\n%s", err, strings.Join(c.want, "\n"))
			}
		})
	}
}

func TestLaunchFlagsRegister(t *testing.T) {
	for _, c := range []struct {
		args []string
		want launch.Flags
	}{
		{nil, launch.Flags{}},
		{[]string{"--node-rank", "0"}, launch.Flags{NodeRankSet: true}},
		{[]string{"--nnodes=4", "--node-rank=3", "--master-addr", "gpu01", "--master-port", "29600"},
			launch.Flags{NNodes: 4, NodeRank: 3, NodeRankSet: true, MasterAddr: "gpu01", MasterPort: 29600}},
	} {
		var f launch.Flags
		fs := flag.NewFlagSet("run", flag.ContinueOnError)
		f.Register(fs)
		if err := fs.Parse(c.args); err != nil {
			t.Fatalf("%q: %v", c.args, err)
		}
		if f != c.want {
			t.Errorf("%q: got %+v, want %+v", c.args, f, c.want)
		}
	}
	var f launch.Flags
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	f.Register(fs)
	if err := fs.Parse([]string{"--node-rank=two"}); err == nil || !strings.Contains(err.Error(), `"two" is not a whole number`) {
		t.Errorf("--node-rank=two: error %v", err)
	}
}

func TestLaunchString(t *testing.T) {
	l, err := launch.FromEnv(env("SLURM_NNODES", "4", "SLURM_NODEID", "1", "SLURM_JOB_NODELIST", "gpu[01-04]"), launch.Flags{LocalRanks: 8})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := l.String(), "node 1 of 4, master gpu01:29500 (SLURM), 8 ranks here"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	if got, want := (launch.Launch{NNodes: 1}).String(), "single node"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	if got, want := (launch.Launch{NNodes: 2, MasterAddr: "fe80::1", MasterPort: 1}).Addr(), "[fe80::1]:1"; got != want {
		t.Errorf("Addr() = %q, want %q", got, want)
	}
}

func TestParseHostlist(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []string
	}{
		{"login1", []string{"login1"}},
		{"gpu[01-04,07],login1", []string{"gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "login1"}},
		{"n[8-10]", []string{"n8", "n9", "n10"}},
		{"n[08-10]", []string{"n08", "n09", "n10"}},
		{"a,b[2],c", []string{"a", "b2", "c"}},
		{"rack[1-2]-gpu[1,3]", []string{"rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"}},
		{"x[1-2]y", []string{"x1y", "x2y"}},
		{" a , b ", []string{"a", "b"}},
	} {
		got, err := launch.ParseHostlist(c.in)
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("ParseHostlist(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
	for _, c := range []struct{ in, want string }{
		{"", "empty host name"},
		{"a,,b", "empty host name"},
		{"gpu[01-04", "'[' without ']'"},
		{"gpu01]", "']' without '['"},
		{"gpu[[1]]", "unbalanced brackets"},
		{"gpu[4-1]", `range "4-1" runs backwards`},
		{"gpu[a-b]", `"a-b" is not a number`},
		{"gpu[]", `"" is not a number`},
		{"gpu[0-99999999]", "more than 65536 hosts"},
		{"a[0-999]b[0-999]", "more than 65536 hosts"},
	} {
		if _, err := launch.ParseHostlist(c.in); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ParseHostlist(%q) error = %v, want it to say %q", c.in, err, c.want)
		}
	}
}

// TestParseHostlistRandom compresses random host sets the way SLURM does
// and checks that the expansion gives them back.
func TestParseHostlistRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		var want []string
		var exprs []string
		for range 1 + rng.IntN(4) {
			prefix := []string{"gpu", "node-", "r2n"}[rng.IntN(3)]
			width := 1 + rng.IntN(3)
			var ranges []string
			next := rng.IntN(5)
			for range 1 + rng.IntN(3) {
				lo := next
				hi := lo + rng.IntN(4)
				next = hi + 2 + rng.IntN(3)
				if lo == hi {
					ranges = append(ranges, fmt.Sprintf("%0*d", width, lo))
				} else {
					ranges = append(ranges, fmt.Sprintf("%0*d-%0*d", width, lo, width, hi))
				}
				for v := lo; v <= hi; v++ {
					want = append(want, fmt.Sprintf("%s%0*d", prefix, width, v))
				}
			}
			exprs = append(exprs, prefix+"["+strings.Join(ranges, ",")+"]")
		}
		in := strings.Join(exprs, ",")
		got, err := launch.ParseHostlist(in)
		if err != nil || !slices.Equal(got, want) {
			t.Fatalf("ParseHostlist(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
}

// The run's secret: from --secret-file, MKTRAIN_SECRET or
// MKTRAIN_SECRET_FILE; generated on node 0 when none is given (with a hint
// for the other nodes); required on the others; never echoed in errors.
func TestLaunchWithSecret(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "secret")
	if err := os.WriteFile(file, []byte("from-a-file-0123456789\nignored\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	short := filepath.Join(dir, "short")
	os.WriteFile(short, []byte("tiny\n"), 0o600)
	node := func(rank int) launch.Launch {
		return launch.Launch{NNodes: 2, NodeRank: rank, MasterAddr: "h", MasterPort: 1}
	}
	for _, c := range []struct {
		name     string
		rank     int
		env      func(string) string
		file     string
		secret   string // "" for a generated one
		from     string
		errorHas string
	}{
		{"the variable", 1, env("MKTRAIN_SECRET", " env-secret-0123456789 "), "", "env-secret-0123456789", "MKTRAIN_SECRET", ""},
		{"the flag wins", 1, env("MKTRAIN_SECRET", "env-secret-0123456789"), file, "from-a-file-0123456789", "--secret-file=" + file, ""},
		{"the file variable", 1, env("MKTRAIN_SECRET_FILE", file), "", "from-a-file-0123456789", "MKTRAIN_SECRET_FILE=" + file, ""},
		{"generated on node 0", 0, env(), "", "", launch.SecretGenerated, ""},
		{"none on node 1", 1, env(), "", "", "", "launch: node 1 has no secret for the run: give every node the same one with MKTRAIN_SECRET"},
		{"too short", 1, env("MKTRAIN_SECRET", "tinytiny"), "", "", "", "launch: MKTRAIN_SECRET holds a secret of 8 characters; use at least 16"},
		{"a short file", 0, env(), short, "", "", "launch: --secret-file=" + short + " holds a secret of 4 characters"},
		{"a missing file", 0, env("MKTRAIN_SECRET_FILE", filepath.Join(dir, "none")), "", "", "", "launch: MKTRAIN_SECRET_FILE=" + filepath.Join(dir, "none") + ": open "},
	} {
		t.Run(c.name, func(t *testing.T) {
			l, err := node(c.rank).WithSecret(c.env, c.file)
			if c.errorHas != "" {
				if err == nil || !strings.HasPrefix(err.Error(), c.errorHas) {
					t.Fatalf("error %v, want %q...", err, c.errorHas)
				}
				if strings.Contains(err.Error(), "tinytiny") || strings.Contains(err.Error(), "tiny\n") {
					t.Errorf("the error shows the secret: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if l.SecretFrom != c.from {
				t.Errorf("SecretFrom %q, want %q", l.SecretFrom, c.from)
			}
			if c.secret != "" {
				if string(l.Secret) != c.secret || l.SecretHint() != "" {
					t.Errorf("secret %q (hint %q), want %q", l.Secret, l.SecretHint(), c.secret)
				}
				return
			}
			again, _ := node(0).WithSecret(env(), "")
			if len(l.Secret) < 32 || string(again.Secret) == string(l.Secret) {
				t.Errorf("generated %q, then %q: want two fresh long ones", l.Secret, again.Secret)
			}
			if h := l.SecretHint(); !strings.Contains(h, "MKTRAIN_SECRET="+string(l.Secret)) {
				t.Errorf("hint %q does not say how to pass the secret", h)
			}
		})
	}
	if l, err := (launch.Launch{NNodes: 1}).WithSecret(env(), ""); err != nil || l.Secret != nil {
		t.Errorf("a single node: %q, %v; it needs no secret", l.Secret, err)
	}
}

// --bind defaults to the master address on node 0 only.
func TestLaunchBind(t *testing.T) {
	for _, c := range []struct {
		rank int
		bind string
		want string
	}{{0, "", "10.0.0.1"}, {1, "", ""}, {0, "0.0.0.0", "0.0.0.0"}, {1, "10.0.0.2", "10.0.0.2"}} {
		l, err := launch.FromEnv(env("NNODES", "2", "MASTER_ADDR", "10.0.0.1"), launch.Flags{NodeRank: c.rank, NodeRankSet: true, Bind: c.bind})
		if err != nil {
			t.Fatal(err)
		}
		if l.Bind != c.want {
			t.Errorf("node %d --bind=%q: Bind %q, want %q", c.rank, c.bind, l.Bind, c.want)
		}
	}
}
