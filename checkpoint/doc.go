// Package checkpoint is mktrain's on-disk checkpoint format: how a training
// run's model, optimizer and loop state are written, found again, checked
// and read back, possibly by a different parallel layout. It knows nothing
// of GPUs or of the engine; the engine hands it host-memory []float32
// tensors and an opaque JSON state.
//
// # Layout
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
//	  .tmp-step_00000300-1f2e…/   a save in progress (or abandoned by a crash)
//
// Directory names are "step_" and the step zero-padded to 8 digits.
// Anything starting with ".tmp-" is not a checkpoint; Prune deletes it.
//
// # Tensor files
//
// model-*.safetensors hold the fp32 master weights and optim-*.safetensors
// the optimizer moments, in the safetensors format (see package
// checkpoint/safetensors for the byte layout): F32 or BF16 little-endian,
// row-major. Each rank writes only the tensors it owns, to files named
// after its rank (ModelFile, OptimFile), and tensor names do not depend on
// the layout: "layers.3.moe.experts.5.w1" is the same tensor whichever
// expert-parallel rank held it. A reader looks tensors up by name across
// all the files, so a checkpoint written with EP=4 loads with EP=2.
//
// A tensor split between ranks (tensor parallelism, a sharded optimizer)
// is written by each rank as a block of the same name, with a metadata
// entry in its file's "__metadata__":
//
//	"mktrain.slice.layers.0.attn.wq": "{\"offset\":[0,32],\"global_shape\":[64,64]}"
//
// meaning: this file's tensor "layers.0.attn.wq" is the block at [0:64,
// 32:64] of a 64x64 tensor. The blocks of one name must tile its global
// shape exactly; Open checks that. A name without that entry is a whole
// tensor and must appear in only one file.
//
// Every file's metadata also holds "format": "pt" (which Hugging Face tools
// expect), "mktrain.format_version" and "mktrain.step".
//
// A file compressed with zstd (optimizer moments, usually) is the same
// safetensors file as one zstd frame, with ".zst" appended to its name.
//
// # MANIFEST.json and state.json
//
//	{"format": "mktrain-checkpoint", "format_version": 1, "step": 200,
//	 "files": [{"name": "model-rank00000.safetensors", "size": 1234,
//	            "sha256": "9f86d0…"}, …]}
//
// Sizes and hashes are of the bytes on disk (compressed ones for .zst).
// The manifest lists every file but itself; Verify recomputes them.
//
//	{"format": "mktrain-checkpoint", "format_version": 1, "step": 200,
//	 "payload": {…the engine's state: tokens seen, data cursor, RNG states,
//	             schedule, recipe and its hash, mesh…}}
//
// Other *.json files may be added with Save.WriteJSON.
//
// # Atomicity
//
// BeginSave creates <root>/.tmp-step_%08d-<random>; the ranks write their
// files into it (each fsynced as it is closed); Commit writes and fsyncs
// MANIFEST.json, fsyncs the directory, renames it to step_%08d, fsyncs the
// root, and last replaces `latest` by writing a temporary file, fsyncing
// it and renaming it over the old one. A crash at any point leaves the
// previous checkpoints and pointer intact, plus at worst a .tmp- directory.
// A step directory therefore always holds a complete checkpoint, and
// MANIFEST.json is what marks it so.
//
// Saving the same step twice (a run resumed from an older checkpoint
// reaching a step it had saved before) replaces the old directory.
//
// # Finding and checking
//
// List gives the complete checkpoints, newest first. Latest follows the
// `latest` pointer, falling back to the newest directory. Verify rehashes
// every file and names each missing, truncated or corrupt one.
// FindResumable returns the newest checkpoint that verifies, warning about
// each newer one it skips. Prune keeps the newest few.
//
// # Asynchronous saves
//
// A Save may run in a background goroutine and its methods may be called
// from many goroutines at once. It reads tensor data only inside
// WriteTensors, so the caller must first snapshot device tensors into host
// memory that training will not overwrite until WriteTensors returns.
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
//	from safetensors import safe_open
//	import torch
//
//	ckpt = "runs/x/step_00000200"                       # or: the name in runs/x/latest
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
//
// For a file without .zst, safe_open(path, framework="pt") reads single
// tensors lazily.
package checkpoint
