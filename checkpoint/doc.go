// Package checkpoint writes, finds, checks and reads mktrain's training
// checkpoints: a run's model weights, optimizer moments and loop state, as
// a directory of safetensors files that any parallel layout can read back.
// It knows nothing of GPUs or of the engine; the engine hands it host-memory
// []float32 tensors and an opaque JSON state. `mktrain ckpt verify` and
// `mktrain ckpt inspect` are its command-line face.
//
// # Use
//
// Saving: BeginSave opens a temporary directory; every rank writes its own
// files with WriteTensors (ModelFile(rank), OptimFile(rank)), tensors named
// independently of the layout; WriteState stores the engine's state; Commit
// makes the checkpoint durable and visible at once, and a deferred Abort
// removes it if anything failed first:
//
//	s, err := checkpoint.BeginSave(root, step)
//	defer s.Abort()
//	err = s.WriteTensors(checkpoint.ModelFile(rank), tensors, checkpoint.TensorOptions{})
//	err = s.WriteState(payload)
//	err = s.Commit()
//
// Reading: FindResumable(root, warn) returns the newest checkpoint that
// verifies (List gives all complete ones, newest first; Latest follows the
// `latest` pointer without hashing). Open reads its manifest and headers;
// Checkpoint.Model and Checkpoint.Optim are TensorSets that find a tensor by
// name whatever file or files hold it (Tensor, ReadInto), and ReadState
// decodes the payload. Verify rehashes every file; Prune keeps the newest
// few. The package example runs a save and a read end to end.
//
// A Save's methods may be called from many goroutines at once and a Save
// may run in the background while training continues: it reads tensor data
// only inside WriteTensors, so the caller snapshots device tensors into host
// memory that stays untouched until WriteTensors returns.
//
// # On-disk format
//
// A run's checkpoints live under one root directory:
//
//	<root>/
//	  latest                      "step_00000200\n": the last committed save
//	  step_00000100/              one complete checkpoint per saved step
//	  step_00000200/
//	    MANIFEST.json             every other file, its size and SHA-256
//	    state.json                step, format version, the engine's state
//	    model-rank00000.safetensors
//	    model-rank00001.safetensors
//	    optim-rank00000.safetensors.zst
//	    optim-rank00001.safetensors.zst
//	    tokenizer.json            the run's tokenizer, when it has one
//	    tokenizer_config.json     (its special tokens, for Hugging Face)
//	  .tmp-step_00000300-1f2e…/   a save in progress (or abandoned by a crash)
//
// Directory names are "step_" and the step zero-padded to 8 digits
// (StepDirName). Anything starting with ".tmp-" is not a checkpoint; Prune
// deletes it.
//
// model-*.safetensors hold the fp32 master weights and optim-*.safetensors
// the optimizer moments, in the safetensors format (package
// checkpoint/safetensors): F32 or BF16 little-endian, row-major. Each rank
// writes only the tensors it owns, to files named after its rank, and
// tensor names do not depend on the layout: "layers.3.moe.experts.5.w1" is
// the same tensor whichever expert-parallel rank held it, so a checkpoint
// written with EP=4 loads with EP=2.
//
// A tensor split between ranks (a sharded optimizer, say) is written by
// each rank as a block of the same name, with an entry in its file's
// "__metadata__":
//
//	"mktrain.slice.layers.0.attn.wq": "{\"offset\":[0,32],\"global_shape\":[64,64]}"
//
// meaning: this file's tensor "layers.0.attn.wq" is the block at [0:64,
// 32:64] of a 64x64 tensor. The blocks of one name must tile its global
// shape exactly; Open checks that. A name without that entry is a whole
// tensor and must appear in only one file. Every file's metadata also holds
// "format": "pt" (which Hugging Face tools expect), "mktrain.format_version"
// and "mktrain.step". A file compressed with zstd (TensorOptions.Compress,
// usually for the moments) is the same safetensors file as one zstd frame,
// with ".zst" appended to its name.
//
// MANIFEST.json lists every file but itself, with the size and hash of the
// bytes on disk (compressed ones for .zst); state.json holds the engine's
// payload. Other *.json files may be added with Save.WriteJSON, and any
// other file byte for byte with Save.WriteFile (Checkpoint.ReadFile reads
// it): the engine stores the run's tokenizer.json and tokenizer_config.json
// so, hashed in the manifest like the rest.
//
//	{"format": "mktrain-checkpoint", "format_version": 1, "step": 200,
//	 "files": [{"name": "model-rank00000.safetensors", "size": 1234,
//	            "sha256": "9f86d0…"}, …]}
//
//	{"format": "mktrain-checkpoint", "format_version": 1, "step": 200,
//	 "payload": {…tokens seen, data cursor, RNG states, recipe and its hash…}}
//
// # Atomicity
//
// BeginSave creates <root>/.tmp-step_%08d-<random>; each file is fsynced as
// it is closed; Commit writes and fsyncs MANIFEST.json, fsyncs the
// directory, renames it to step_%08d, fsyncs the root, and last replaces
// `latest` through a temporary file, fsync and rename. A crash at any point
// leaves the previous checkpoints and pointer intact, plus at worst a .tmp-
// directory, so a step directory always holds a complete checkpoint, and
// MANIFEST.json is what marks it so. Saving a step again (a run resumed
// from an older checkpoint) replaces the old directory.
//
// # Reading a checkpoint from Python
//
// Plain files load with the safetensors package; .zst files need zstandard
// first; blocks written by several ranks are put back together from the
// slice metadata:
//
//	import glob, json
//	import zstandard                                    # only for .zst files
//	from safetensors.torch import load                  # or safetensors.numpy (no BF16)
//	import torch
//
//	ckpt = "runs/x/checkpoints/step_00000200"           # or: the name in its latest
//	state = json.load(open(f"{ckpt}/state.json"))["payload"]
//
//	def read(path):
//	    raw = open(path, "rb").read()
//	    if path.endswith(".zst"):
//	        raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
//	    n = int.from_bytes(raw[:8], "little")
//	    meta = json.loads(raw[8:8 + n]).get("__metadata__", {})
//	    return load(raw), meta
//
//	def tensors(prefix):                                # "model-" or "optim-"
//	    out = {}
//	    for path in sorted(glob.glob(f"{ckpt}/{prefix}*.safetensors*")):
//	        part, meta = read(path)
//	        for name, t in part.items():
//	            s = meta.get("mktrain.slice." + name)
//	            if s is None:
//	                out[name] = t
//	                continue
//	            s = json.loads(s)
//	            full = out.setdefault(name, torch.empty(s["global_shape"], dtype=t.dtype))
//	            full[tuple(slice(o, o + d) for o, d in zip(s["offset"], t.shape))] = t
//	    return out
//
//	model = tensors("model-")                           # {"layers.0.attn.wq": tensor, ...}
package checkpoint
