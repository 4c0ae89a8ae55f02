// Command mktrain trains Mixtral-style mixture-of-experts transformers from
// a recipe, on the CPU or on NVIDIA GPUs, on one node or several, and
// prepares data for them, evaluates, samples, exports and checks their
// checkpoints, and measures their speed.
//
//	mktrain run RECIPE [--set key.path=value]... [--run-dir DIR] [--metrics-addr HOST:PORT]
//	            [--nnodes N --node-rank K --master-addr HOST [--master-port P]] [--rendezvous-timeout D] [--secret-file F] [--bind ADDR]
//	mktrain data prepare [--out DIR] [--val-fraction F] [--shard-tokens N] [--tokenizer FILE [--text-key K] [--eos TOKEN] [--seed S]] FILE|GLOB...
//	mktrain data verify [--vocab N | --recipe RECIPE] [GLOB...]
//	mktrain eval --checkpoint DIR [--data GLOB | --text FILE] [--batches N] [--json]
//	mktrain sample --checkpoint DIR --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]
//	mktrain tokenize --tokenizer FILE [--json] [--decode] [--special] [TEXT]
//	mktrain export [--format hf] [--dtype bf16|fp32] CKPT OUT
//	mktrain plan RECIPE [--set key.path=value]... [--device NAME] [--memory SIZE] [--gpus N] [--json]
//	mktrain ckpt verify DIR
//	mktrain ckpt inspect DIR
//	mktrain report RUN_DIR [--out FILE.html] [--bench FILE]
//	mktrain bench train [RECIPE] [--steps N] [--warmup N] [--profile=false] [--trace FILE.json] [--set k=v]... [--out DIR]
//	mktrain bench checkpoint [RECIPE] [--set k=v]... [--dir DIR] [--out DIR]
//	mktrain bench moe [--shape moe-small,fine] [--world 1,2,4,8] [--steps N] [--warmup N] [--backend B] [--out DIR]
//	mktrain bench kernels [--shape moe-small,fine] [--world 1,2,4,8] [--iters N] [--backend B] [--gpus] [--out DIR]
//	mktrain bench attention [--shapes moe-small,s8k,s32k] [--ring-world 2,4,8] [--ring-seq 4096,8192] [--iters N] [--backend B] [--peer PYTHON] [--peer-script FILE] [--out DIR]
//	mktrain bench tp [--shapes moe-small,llama70b] [--tp 2,4,8] [--iters N] [--backend B] [--out DIR]
//	mktrain bench prepare --tokenizer FILE [--text-key K] [--cores N] [--repeat R] [--peer-json FILE] [--out DIR] FILE|GLOB...
//	mktrain version
//	mktrain help [COMMAND [SUBCOMMAND]]
//
// A recipe is a YAML file or a shipped name (tiny, moe-small, moe-fine, moe-large, long-context); its fields
// are documented in docs/recipes.md. Every command and subcommand takes
// --help (or -h), and `mktrain help COMMAND [SUBCOMMAND]` prints the same:
// its usage and every flag, on stdout. Exit
// status: 0 on success; 2 on bad input, found before anything runs (a
// usage error, a recipe, a missing file, bad data, a memory plan that does
// not fit: the message names the file or field); 1 when a run fails after
// it started (a step's error, a NaN loss, a device, a lost peer: the
// message names the rank or step; exit.go); 130 after Ctrl-C (SIGINT) and
// 143 after SIGTERM in every command and phase: the first signal stops
// cleanly (a run saves after its current step, partial output is removed),
// a second exits at once (signals.go). README.md's Commands section
// describes each command.
//
// Each command is one file here, which parses its flags and calls the
// packages that do the work: run.go (recipes, launch, engine), data.go
// (data.Prepare, data.Verify), eval.go, sample.go and export.go (infer),
// tokenize.go (tokenizer), ckpt.go
// (checkpoint), plan.go (plan, through engine), report.go (observe/report), bench.go (bench train, through engine and backend/profile),
// bench_checkpoint.go, bench_moe.go, bench_kernels.go, bench_attention.go, bench_tp.go, bench_prepare.go, and version.go;
// main.go dispatches them (runCommand) and answers help. The
// programs pick their backends from backend/all.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
)

// Exit statuses (exit.go says which failure is which).
const (
	exitOK          = 0
	exitRunFailed   = 1   // a run that failed after it started
	exitFailure     = 2   // bad input
	exitInterrupted = 130 // SIGINT (Ctrl-C): 128 + 2
	exitTerminated  = 143 // SIGTERM: 128 + 15
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// usageError marks an error caused by how the command was called; its
// subcommand's usage is printed with it.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

const topUsage = `mktrain trains mixture-of-experts transformers.

Usage:
  mktrain run RECIPE [--set key.path=value]... [--run-dir DIR] [--metrics-addr HOST:PORT]
              [--nnodes N --node-rank K --master-addr HOST [--master-port P]] [--rendezvous-timeout D] [--secret-file F] [--bind ADDR]
                         train from a recipe (a file, or a shipped name: tiny, moe-small, moe-fine, moe-large, long-context)
  mktrain data prepare [--out DIR] [--val-fraction F] [--shard-tokens N] [--tokenizer FILE [--text-key K] [--eos TOKEN] [--seed S]] FILE|GLOB...
                         turn text, JSON Lines or Parquet into token shards (byte-level without --tokenizer)
  mktrain data verify [--vocab N | --recipe RECIPE] [GLOB...]
                         check token shards' headers, sizes and ids (< N, or the recipe's model.vocab)
  mktrain eval --checkpoint DIR [--data GLOB | --text FILE] [--batches N] [--json]
                         a checkpoint's validation loss and perplexity (on shards, or on a text)
  mktrain sample --checkpoint DIR --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]
                         continue a text with a checkpoint's model and tokenizer (byte-level without one)
  mktrain tokenize --tokenizer FILE [--json] [--decode] [--special] [TEXT]
                         print the token ids of TEXT (or stdin); --decode: the text of ids
  mktrain export [--format hf] [--dtype bf16|fp32] CKPT OUT
                         write a checkpoint as a Hugging Face Mixtral directory
  mktrain plan RECIPE [--set key.path=value]... [--device NAME] [--memory SIZE] [--gpus N] [--json]
                         the memory and FLOPs a recipe needs per rank, against the device's memory
  mktrain ckpt verify DIR
                         check the checksums of a checkpoint, or of all under a run
  mktrain ckpt inspect DIR
                         show a checkpoint's state, tensors and recipe
  mktrain report RUN_DIR [--out FILE.html] [--bench FILE]
                         one HTML file of a run's curves and expert-load heat maps
  mktrain bench train [RECIPE] [--steps N] [--warmup N] [--profile=false] [--trace FILE.json] [--set k=v]... [--out DIR]
                         measure training tokens/s and where a step's time goes
  mktrain bench checkpoint [RECIPE] [--set k=v]... [--dir DIR] [--out DIR]
                         measure saving and loading a model's training state
  mktrain bench moe [--shape moe-small,fine] [--world 1,2,4,8] [--steps N] [--warmup N] [--backend B] [--out DIR]
                         time one MoE layer and each phase of its dispatch
  mktrain bench kernels [--shape moe-small,fine] [--world 1,2,4,8] [--iters N] [--backend B] [--gpus] [--out DIR]
                         time the fused and unfused dispatchers; store the faster for model.moe.dispatcher: auto
  mktrain bench attention [--shapes moe-small,s8k,s32k] [--ring-world 2,4,8] [--ring-seq 4096,8192] [--iters N] [--backend B] [--peer PYTHON] [--peer-script FILE] [--out DIR]
                         time the attention core against PyTorch SDPA and context-parallel attention on virtual ranks
  mktrain bench tp [--shapes moe-small,llama70b] [--tp 2,4,8] [--iters N] [--backend B] [--out DIR]
                         time tensor parallelism's three patterns, unfused and fused, on virtual ranks of one device
  mktrain bench prepare --tokenizer FILE [--text-key K] [--cores N] [--repeat R] [--peer-json FILE] [--out DIR] FILE|GLOB...
                         measure data prepare's MB of text per second per core (beside the Rust tokenizers peer)
  mktrain version        print the version
  mktrain help [COMMAND [SUBCOMMAND]]
                         a command's usage and flags (as mktrain COMMAND [SUBCOMMAND] --help)

The bench commands write their results into bench/results/<machine>/.
Run 'mktrain help COMMAND' or 'mktrain COMMAND --help' for a command's flags.
`

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, topUsage)
		return exitFailure
	}
	ctx, stop := notifySignals(stderr, os.Exit)
	defer stop()
	return exitStatus(ctx, runCommand(ctx, args, stdout, stderr), stdout, stderr)
}

// runCommand runs the command args[0] names with the rest of args. Every
// command is a case here and a line of topUsage (help_test.go checks
// that they agree).
func runCommand(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var err error
	switch args[0] {
	case "run":
		err = cmdRun(ctx, args[1:], stdout, stderr)
	case "data":
		err = cmdData(ctx, args[1:], stdout, stderr)
	case "bench":
		err = cmdBench(ctx, args[1:], stdout, stderr)
	case "eval":
		err = cmdEval(ctx, args[1:], stdout, stderr)
	case "sample":
		err = cmdSample(ctx, args[1:], stdout, stderr)
	case "export":
		err = cmdExport(ctx, args[1:], stdout, stderr)
	case "tokenize":
		err = cmdTokenize(ctx, args[1:], os.Stdin, stdout, stderr)
	case "ckpt":
		err = cmdCkpt(ctx, args[1:], stdout, stderr)
	case "plan":
		err = cmdPlan(ctx, args[1:], stdout, stderr)
	case "report":
		err = cmdReport(ctx, args[1:], stdout, stderr)
	case "version", "--version":
		err = cmdVersion(args[1:], stdout)
	case "help", "-h", "-help", "--help":
		err = cmdHelp(ctx, args[1:], stdout, stderr)
	default:
		fmt.Fprint(stderr, topUsage)
		err = usageError{fmt.Sprintf("unknown command %q", args[0])}
	}
	return err
}

// cmdHelp is `mktrain help [COMMAND [SUBCOMMAND]]`: the list of commands,
// or what `mktrain COMMAND [SUBCOMMAND] --help` prints.
func cmdHelp(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	switch {
	case len(args) == 0 || isHelpFlag(args[0]) || args[0] == "help":
		fmt.Fprint(stdout, topUsage)
		return errHelp
	case len(args) > 2:
		fmt.Fprint(stderr, topUsage)
		return usageError{fmt.Sprintf("help takes a command and at most a subcommand, got %q", strings.Join(args, " "))}
	}
	return runCommand(ctx, append(slices.Clone(args), "--help"), stdout, stderr)
}

// groupUsage lists a group's subcommands (bench train, bench moe, ...) as
// topUsage gives them, for `mktrain GROUP --help`.
func groupUsage(group string) string {
	var b strings.Builder
	b.WriteString("Usage:\n")
	for _, line := range strings.Split(topUsage, "\n") {
		if strings.HasPrefix(line, "  mktrain "+group+" ") {
			b.WriteString(line + "\n")
		}
	}
	fmt.Fprintf(&b, "Run 'mktrain help %s SUBCOMMAND' for a subcommand's flags.\n", group)
	return b.String()
}

// isHelpFlag says whether arg asks for help as package flag takes it.
func isHelpFlag(arg string) bool {
	switch arg {
	case "-h", "--h", "-help", "--help":
		return true
	}
	return false
}

const versionUsage = `Usage: mktrain version

Prints the release, the source revision it was built from (when known) and
the Go version.
`

// cmdVersion is `mktrain version`.
func cmdVersion(args []string, stdout io.Writer) error {
	switch {
	case len(args) == 0:
		fmt.Fprintln(stdout, versionString())
		return nil
	case isHelpFlag(args[0]):
		fmt.Fprint(stdout, versionUsage)
		return errHelp
	}
	return usageError{fmt.Sprintf("version takes no arguments, got %q", strings.Join(args, " "))}
}

// exitStatus reports err on stderr and returns the command's exit status:
// after a signal, 128 + its number whatever the error (a command that
// finished its work before it noticed the signal exits 0). A help request
// (-h, --help) prints the command's usage on stdout and exits 0.
func exitStatus(ctx context.Context, err error, stdout, stderr io.Writer) int {
	if cause, ok := interruption(ctx); ok && err != nil && !errors.Is(err, errHelp) {
		if errors.Is(err, cause) {
			fmt.Fprintln(stderr, "mktrain:", err)
		} else {
			fmt.Fprintf(stderr, "mktrain: %s: %v\n", cause, err)
		}
		return cause.exitCode()
	}
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, errHelp):
		if help := (*helpRequest)(nil); errors.As(err, &help) {
			help.print(stdout)
		}
		return exitOK
	case errors.Is(err, errInterrupted):
		fmt.Fprintln(stderr, "mktrain:", err)
		return exitInterrupted
	case isRunFailure(err):
		fmt.Fprintln(stderr, "mktrain:", err)
		return exitRunFailed
	default:
		fmt.Fprintln(stderr, "mktrain:", err)
		return exitFailure
	}
}
