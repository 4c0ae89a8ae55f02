// Package launch starts a multi-node run: it works out which node this
// process is (Launch, from flags, torchrun's or SLURM's environment) and
// meets the other nodes at node 0 (Join), which checks that every node runs
// the same recipe and mktrain version and hands every node the same blob
// (the run id and, on CUDA, NCCL's unique id) and the node table (every
// node's address and data port). After that the rendezvous watches the
// nodes: a node that dies or goes silent fails the run on every node alike.
//
// Use:
//
//	var flags launch.Flags
//	flags.Register(fs) // --nnodes, --node-rank, --master-addr, --master-port, --secret-file, --bind
//	...
//	l, err := launch.FromEnv(os.Getenv, flags)
//	l, err = l.WithSecret(os.Getenv, flags.SecretFile) // print l.SecretHint() if not ""
//	l.LocalRanks = ranksHere
//	rdv, err := launch.Join(ctx, launch.RendezvousConfig{
//		Launch: l, RecipeHash: hash, Version: version,
//		Blob: comm.NewRunBlob(), DataPort: port,
//	})
//	defer rdv.Close()
//	addrs, err := launch.DataAddrs(rdv.Nodes()) // for comm.TCPConfig.Addrs
//	failures := rdv.Watch(ctx)                  // the run's failure, the same on every node
//	err = rdv.AllReduceFloat64(votes)           // the nodes' sum, on the host
//
// A rank that fails calls rdv.Abort(err) so that every node stops with its
// reason. AllReduceFloat64 sums a few float64s over the nodes through node
// 0 (the engine's stop vote each step, which over NCCL would wait for the
// device's queue). On a single node Join returns at once and nothing
// listens.
//
// # Design
//
// launch.go reads the settings, in order of precedence per field: flags,
// torchrun's variables, SLURM's, then a single node; every problem is
// reported at once naming the flag or variable. mktrain runs one process
// per node, which drives all the node's GPUs, so launchers that start a
// process per GPU are refused.
//
// trust.go is the run's shared secret: every connection between the nodes
// (here and in comm's TCP transport) opens with a mutual HMAC
// challenge-response over it (internal/peernet.Authenticate) before
// anything else is read; docs/launch.md gives the trust model.
//
// rendezvous.go is the meeting: node 0 listens on the master port (at
// Launch.Bind), the others dial it with backoff, prove they know the
// secret, say hello (NodeInfo) and wait for a welcome
// or a refusal that every node returns alike. The connections stay open as
// a star around node 0, with heartbeats both ways, so that a lost node
// (closed connection, or silence past HeartbeatTimeout) ends the run on
// every node with an error naming it; they also carry the nodes' sums
// (AllReduceFloat64), which node 0 adds in node order. Its wire format (length-prefixed
// JSON) is its own, apart from comm's TCP transport, which carries the
// collectives' data between the nodes once they have met. Package launch
// imports comm (for the blob's layout: comm.BlobSize, comm.RunIDFromBlob),
// never the reverse.
package launch
