package launch

// Launch configuration: how many nodes a run spans, which one this process
// is, and where node 0 waits for the others. mktrain runs one process per
// node that drives all of that node's GPUs, so a "node" here is also a
// process; the ranks it drives are its LocalRanks.
//
// The settings come from, in order of precedence (per field, the first
// place that sets it wins):
//
//	flags         --nnodes, --node-rank, --master-addr, --master-port
//	torchrun env  NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT; torchrun's own
//	              GROUP_WORLD_SIZE and GROUP_RANK; WORLD_SIZE and RANK only
//	              when LOCAL_WORLD_SIZE=1 (see below)
//	SLURM         SLURM_STEP_NUM_NODES or SLURM_NNODES, SLURM_NODEID or
//	              SLURM_PROCID, the first host of SLURM_STEP_NODELIST or
//	              SLURM_JOB_NODELIST
//	single node   one node, rank 0
//
// WORLD_SIZE and RANK count processes. With one process per node that is
// the node count and rank, but many launchers set WORLD_SIZE to the number
// of GPUs, so they are read only when LOCAL_WORLD_SIZE=1 says that each node
// runs one process (as torchrun --nproc-per-node=1 sets it). A WORLD_SIZE
// above 1 with no other node count is an error rather than a guess.

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"strconv"
	"strings"
)

// DefaultMasterPort is the rendezvous port when none is given (the same
// default as torchrun's).
const DefaultMasterPort = 29500

// Launch is this process's place in a multi-node run.
type Launch struct {
	NNodes     int    // nodes in the run, at least 1
	NodeRank   int    // this node, 0..NNodes-1; node 0 hosts the rendezvous
	MasterAddr string // node 0's host name or IP as the other nodes reach it; unused on a single node
	MasterPort int    // node 0's rendezvous port
	LocalRanks int    // ranks this process drives on its node (its GPUs); 0 until the caller decides
	Source     string // where the node count came from: "flags", "torchrun env", "SLURM" or "single node"
	// Bind is the address this node's ports listen on ("" is every
	// interface); FromEnv makes it the master address on node 0 when
	// --bind is not given.
	Bind string
	// Secret is the run's shared secret (WithSecret reads it): every
	// connection between the nodes proves it knows it before anything
	// else is read (trust.go).
	Secret []byte
	// SecretFrom names where Secret came from ("MKTRAIN_SECRET",
	// "--secret-file=PATH", ...); "generated" when node 0 made one up,
	// which the caller prints for the other nodes (SecretHint).
	SecretFrom string

	// from names the flag or variable behind each field, as NAME=VALUE,
	// so that errors point at what the user set; empty for a Launch built
	// in code.
	from launchOrigins
}

type launchOrigins struct {
	nnodes, nodeRank, masterAddr, masterPort string
}

// Launch sources, the values of Launch.Source.
const (
	SourceFlags      = "flags"
	SourceTorchrun   = "torchrun env"
	SourceSLURM      = "SLURM"
	SourceSingleNode = "single node"
)

// Flags are the launch settings given on the command line. A zero
// field was not given, except NodeRank, where 0 is a real rank:
// NodeRankSet says whether it was given.
type Flags struct {
	NNodes      int    // --nnodes
	NodeRank    int    // --node-rank
	NodeRankSet bool   // whether --node-rank was given
	MasterAddr  string // --master-addr
	MasterPort  int    // --master-port
	SecretFile  string // --secret-file
	Bind        string // --bind
	LocalRanks  int    // ranks this process drives (set by the caller, e.g. its GPU count); no flag
}

// Register adds --nnodes, --node-rank, --master-addr, --master-port,
// --secret-file and --bind to fs, storing into f.
func (f *Flags) Register(fs *flag.FlagSet) {
	fs.IntVar(&f.NNodes, "nnodes", 0, "nodes in a multi-node run (default: from NNODES, SLURM, or 1)")
	fs.Func("node-rank", "this node's rank, 0..nnodes-1 (default: from NODE_RANK, SLURM, or 0)", func(s string) error {
		v, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			return fmt.Errorf("%q is not a whole number", s)
		}
		f.NodeRank, f.NodeRankSet = v, true
		return nil
	})
	fs.StringVar(&f.MasterAddr, "master-addr", "", "node 0's host name or IP (default: from MASTER_ADDR or the first SLURM host)")
	fs.IntVar(&f.MasterPort, "master-port", 0, fmt.Sprintf("node 0's rendezvous port (default: from MASTER_PORT, or %d)", DefaultMasterPort))
	fs.StringVar(&f.SecretFile, "secret-file", "", "multi-node: file holding the run's shared secret (default: MKTRAIN_SECRET, MKTRAIN_SECRET_FILE, or one node 0 generates and prints)")
	fs.StringVar(&f.Bind, "bind", "", "multi-node: address this node's ports listen on (default: the master address on node 0, every interface on the others)")
}

// MultiNode reports whether the run spans more than one node (and so needs
// a rendezvous).
func (l Launch) MultiNode() bool { return l.NNodes > 1 }

// Addr is node 0's rendezvous address, host:port.
func (l Launch) Addr() string {
	return net.JoinHostPort(l.MasterAddr, strconv.Itoa(l.MasterPort))
}

// String describes the launch for a log line, e.g. "node 1 of 4, master
// gpu01:29500 (SLURM), 8 ranks here" or "single node".
func (l Launch) String() string {
	s := "single node"
	if l.MultiNode() {
		s = fmt.Sprintf("node %d of %d, master %s (%s)", l.NodeRank, l.NNodes, l.Addr(), l.Source)
	}
	if l.LocalRanks > 0 {
		s += fmt.Sprintf(", %s here", plural(l.LocalRanks, "rank"))
	}
	return s
}

// Validate checks a Launch, naming the flag or variable behind a bad field
// when the Launch came from FromEnv.
func (l Launch) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf("launch: "+format, args...)) }
	nnodes := origin(l.from.nnodes, "node count", l.NNodes)
	rank := origin(l.from.nodeRank, "node rank", l.NodeRank)
	switch {
	case l.NNodes < 1:
		bad("%s: a run needs at least 1 node", nnodes)
	case l.NodeRank < 0:
		bad("%s: the node rank counts from 0", rank)
	case l.NodeRank >= l.NNodes:
		bad("%s but %s: the node rank must be below the node count", rank, nnodes)
	}
	if l.MultiNode() {
		if l.MasterAddr == "" {
			bad("%s but no master address: set MASTER_ADDR or --master-addr to node 0's host name or IP", nnodes)
		} else if _, _, err := net.SplitHostPort(l.MasterAddr); err == nil {
			bad("%s holds a port; give the host alone and the port in MASTER_PORT or --master-port",
				origin(l.from.masterAddr, "master address", l.MasterAddr))
		}
		if l.MasterPort < 1 || l.MasterPort > 65535 {
			bad("%s is not a port (1-65535)", origin(l.from.masterPort, "master port", l.MasterPort))
		}
	}
	if l.LocalRanks < 0 {
		bad("local ranks is %d; it must be 0 (not decided) or more", l.LocalRanks)
	}
	return errors.Join(errs...)
}

// origin is "NAME=VALUE" when the setting came from a flag or variable,
// otherwise "what VALUE".
func origin(from, what string, v any) string {
	if from != "" {
		return from
	}
	return fmt.Sprintf("%s %v", what, v)
}

// FromEnv works out the launch from the command-line flags and the
// environment (getenv is os.Getenv outside tests), in the precedence order
// described at the top of this file. Every problem found is returned at once,
// each naming the flag or variable.
func FromEnv(getenv func(string) string, flags Flags) (Launch, error) {
	e := envReader{getenv: getenv}
	l := Launch{MasterPort: DefaultMasterPort, LocalRanks: flags.LocalRanks}

	// One process per node: refuse launches that start several.
	if lws, ok := e.int("LOCAL_WORLD_SIZE"); ok && lws != 1 {
		e.errorf("LOCAL_WORLD_SIZE=%d: mktrain runs one process per node, which drives all the node's GPUs; start one process per node (torchrun --nproc-per-node=1)", lws)
	}
	if tasks, ok := e.int("SLURM_STEP_NUM_TASKS"); ok {
		if nodes, ok := e.int("SLURM_STEP_NUM_NODES"); ok && tasks != nodes {
			e.errorf("SLURM_STEP_NUM_TASKS=%d on SLURM_STEP_NUM_NODES=%d: mktrain runs one process per node, which drives all the node's GPUs; use srun --ntasks-per-node=1", tasks, nodes)
		}
	}
	oneProcPerNode := strings.TrimSpace(getenv("LOCAL_WORLD_SIZE")) == "1"

	// The node count.
	nnodesSet := true
	switch {
	case flags.NNodes != 0:
		l.NNodes, l.from.nnodes, l.Source = flags.NNodes, fmt.Sprintf("--nnodes=%d", flags.NNodes), SourceFlags
	case e.agreeing(&l.NNodes, &l.from.nnodes, "NNODES", "GROUP_WORLD_SIZE", onlyIf(oneProcPerNode, "WORLD_SIZE")):
		l.Source = SourceTorchrun
	case e.first(&l.NNodes, &l.from.nnodes, "SLURM_STEP_NUM_NODES", "SLURM_NNODES"):
		l.Source = SourceSLURM
	default:
		l.NNodes, l.Source, nnodesSet = 1, SourceSingleNode, false
		if ws, ok := e.int("WORLD_SIZE"); ok && ws > 1 && !oneProcPerNode {
			e.errorf("WORLD_SIZE=%d but no node count: WORLD_SIZE counts processes and often GPUs, so mktrain reads it as the node count only with LOCAL_WORLD_SIZE=1; set NNODES or --nnodes", ws)
		}
	}

	// This node's rank.
	rankSet := true
	switch {
	case flags.NodeRankSet:
		l.NodeRank, l.from.nodeRank = flags.NodeRank, fmt.Sprintf("--node-rank=%d", flags.NodeRank)
	case e.agreeing(&l.NodeRank, &l.from.nodeRank, "NODE_RANK", "GROUP_RANK", onlyIf(oneProcPerNode, "RANK")):
	case e.first(&l.NodeRank, &l.from.nodeRank, "SLURM_NODEID", "SLURM_PROCID"):
	default:
		rankSet = false
	}
	if l.NNodes > 1 && !rankSet {
		e.errorf("%s but no node rank: set NODE_RANK or --node-rank on each node", l.from.nnodes)
	}
	if rankSet && !nnodesSet && l.NodeRank != 0 {
		e.errorf("%s but no node count: set NNODES or --nnodes", l.from.nodeRank)
		l.NodeRank = 0 // reported; keep Validate from saying it again
	}

	// Node 0's address and port.
	switch {
	case flags.MasterAddr != "":
		l.MasterAddr, l.from.masterAddr = flags.MasterAddr, "--master-addr="+flags.MasterAddr
	case e.str(&l.MasterAddr, &l.from.masterAddr, "MASTER_ADDR"):
	case l.NNodes > 1: // a single node needs no address, so a bad list cannot stop it
		for _, name := range []string{"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"} {
			list := strings.TrimSpace(getenv(name))
			if list == "" {
				continue
			}
			hosts, err := ParseHostlist(list)
			if err != nil {
				e.errorf("%s=%s: %v", name, list, err)
			} else {
				l.MasterAddr, l.from.masterAddr = hosts[0], fmt.Sprintf("first host of %s=%s", name, list)
			}
			break
		}
	}
	switch {
	case flags.MasterPort != 0:
		l.MasterPort, l.from.masterPort = flags.MasterPort, fmt.Sprintf("--master-port=%d", flags.MasterPort)
	case strings.TrimSpace(getenv("MASTER_PORT")) != "":
		v := strings.TrimSpace(getenv("MASTER_PORT"))
		l.from.masterPort = "MASTER_PORT=" + v
		p, err := strconv.Atoi(v)
		if err != nil {
			e.errorf("MASTER_PORT=%s is not a port (1-65535)", v)
			p = DefaultMasterPort // reported; keep Validate from saying it again
		}
		l.MasterPort = p
	}

	l.Bind = flags.Bind
	if l.Bind == "" && l.NNodes > 1 && l.NodeRank == 0 {
		l.Bind = l.MasterAddr
	}

	if err := l.Validate(); err != nil {
		e.errs = append(e.errs, err)
	}
	if err := errors.Join(e.errs...); err != nil {
		return Launch{}, err
	}
	return l, nil
}

// onlyIf is name when cond holds, otherwise "" (a variable not consulted).
func onlyIf(cond bool, name string) string {
	if cond {
		return name
	}
	return ""
}

// envReader reads integer and string settings from the environment,
// collecting errors that name the variable.
type envReader struct {
	getenv func(string) string
	errs   []error
}

func (e *envReader) errorf(format string, args ...any) {
	e.errs = append(e.errs, fmt.Errorf("launch: "+format, args...))
}

// int reads a whole number; a blank or unset variable is not set, and a
// malformed one is reported and counts as not set.
func (e *envReader) int(name string) (int, bool) {
	if name == "" {
		return 0, false
	}
	s := strings.TrimSpace(e.getenv(name))
	if s == "" {
		return 0, false
	}
	v, err := strconv.Atoi(s)
	if err != nil {
		e.errorf("%s=%s is not a whole number", name, s)
		return 0, false
	}
	return v, true
}

// first stores the first set variable of names into *v and its origin into
// *from.
func (e *envReader) first(v *int, from *string, names ...string) bool {
	for _, name := range names {
		if x, ok := e.int(name); ok {
			*v, *from = x, fmt.Sprintf("%s=%d", name, x)
			return true
		}
	}
	return false
}

// agreeing is first, but every set variable of names must hold the same
// value (they are synonyms).
func (e *envReader) agreeing(v *int, from *string, names ...string) bool {
	found := false
	for _, name := range names {
		x, ok := e.int(name)
		switch {
		case !ok:
		case !found:
			*v, *from, found = x, fmt.Sprintf("%s=%d", name, x), true
		case x != *v:
			e.errorf("%s but %s=%d: they must agree", *from, name, x)
		}
	}
	return found
}

func (e *envReader) str(v, from *string, name string) bool {
	s := strings.TrimSpace(e.getenv(name))
	if s == "" {
		return false
	}
	*v, *from = s, name+"="+s
	return true
}

// maxHostlist bounds the expansion of a host list, so that a malformed
// range cannot exhaust memory.
const maxHostlist = 1 << 16

// ParseHostlist expands SLURM's compressed host list syntax: a comma
// separated list of host names, each of which may hold bracketed ranges,
// e.g. "gpu[01-04,07],login1" is gpu01, gpu02, gpu03, gpu04, gpu07, login1.
// A range keeps the zero padding of its first number ("[08-10]" is 08, 09,
// 10); several brackets in one name expand to every combination, in order.
func ParseHostlist(s string) ([]string, error) {
	var hosts []string
	for _, expr := range splitTopLevel(s) {
		if expr == "" {
			return nil, fmt.Errorf("empty host name in host list %q", s)
		}
		expanded, err := expandHost(expr)
		if err != nil {
			return nil, err
		}
		hosts = append(hosts, expanded...)
		if len(hosts) > maxHostlist {
			return nil, fmt.Errorf("host list expands to more than %d hosts", maxHostlist)
		}
	}
	if len(hosts) == 0 {
		return nil, errors.New("empty host list")
	}
	return hosts, nil
}

// splitTopLevel splits s at the commas outside brackets.
func splitTopLevel(s string) []string {
	var parts []string
	depth, start := 0, 0
	for i, c := range s {
		switch c {
		case '[':
			depth++
		case ']':
			depth--
		case ',':
			if depth == 0 {
				parts = append(parts, strings.TrimSpace(s[start:i]))
				start = i + 1
			}
		}
	}
	return append(parts, strings.TrimSpace(s[start:]))
}

// expandHost expands one host expression such as "rack[1-2]-gpu[01-03,07]".
func expandHost(expr string) ([]string, error) {
	open := strings.IndexByte(expr, '[')
	if open < 0 {
		if strings.ContainsRune(expr, ']') {
			return nil, fmt.Errorf("host %q has ']' without '['", expr)
		}
		return []string{expr}, nil
	}
	end := strings.IndexByte(expr[open:], ']')
	if end < 0 {
		return nil, fmt.Errorf("host %q has '[' without ']'", expr)
	}
	end += open
	prefix, body := expr[:open], expr[open+1:end]
	if strings.ContainsAny(prefix, "]") || strings.ContainsRune(body, '[') {
		return nil, fmt.Errorf("host %q has unbalanced brackets", expr)
	}
	items, err := expandRanges(expr, body)
	if err != nil {
		return nil, err
	}
	rest, err := expandHost(expr[end+1:])
	if err != nil {
		return nil, err
	}
	if len(items)*len(rest) > maxHostlist {
		return nil, fmt.Errorf("host list expands to more than %d hosts", maxHostlist)
	}
	var out []string
	for _, it := range items {
		for _, r := range rest {
			out = append(out, prefix+it+r)
		}
	}
	return out, nil
}

// expandRanges expands the inside of one bracket, e.g. "01-04,07".
func expandRanges(expr, body string) ([]string, error) {
	var out []string
	for _, part := range strings.Split(body, ",") {
		part = strings.TrimSpace(part)
		lo, hi, isRange := strings.Cut(part, "-")
		if !isRange {
			hi = lo
		}
		a, errA := strconv.ParseUint(lo, 10, 32)
		b, errB := strconv.ParseUint(hi, 10, 32)
		if errA != nil || errB != nil {
			return nil, fmt.Errorf("host %q: %q is not a number or a range of numbers", expr, part)
		}
		if a > b {
			return nil, fmt.Errorf("host %q: range %q runs backwards", expr, part)
		}
		if b-a >= maxHostlist {
			return nil, fmt.Errorf("host %q: range %q expands to more than %d hosts", expr, part, maxHostlist)
		}
		for v := a; v <= b; v++ {
			out = append(out, fmt.Sprintf("%0*d", len(lo), v))
		}
	}
	return out, nil
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}
