# mktrain: build, test, bench. Go is the only requirement.
GO      ?= go
BIN     ?= bin/mktrain
FUZZTIME ?= 30s

.PHONY: all build test race vet lint fuzz bench gpu-test clean

all: build test

build:
	$(GO) build -buildvcs=true -o $(BIN) ./cmd/mktrain

test:
	$(GO) test ./...

# The whole suite under the race detector (a few minutes on 2 cores).
race:
	$(GO) test -race ./...

vet:
	$(GO) vet ./...

lint: vet
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt:"; echo "$$out"; exit 1; fi

# Short fuzzing sessions of the parsers that read user files.
fuzz:
	$(GO) test ./recipes -run '^$$' -fuzz FuzzParse -fuzztime $(FUZZTIME)
	$(GO) test ./data -run '^$$' -fuzz FuzzShardHeader -fuzztime $(FUZZTIME)
	$(GO) test ./checkpoint -run '^$$' -fuzz FuzzSafetensorsHeader -fuzztime $(FUZZTIME)

# CPU training throughput of the tiny recipe; writes
# bench/results/cpu/train-tiny.json (docs/performance.md).
bench: build
	$(BIN) bench train tiny --steps 20

# Builds the GPU test binaries, mktrain and the PyTorch peers (scripts/peer)
# into .gpu/bundle.tgz on any machine (no CUDA needed); on the GPU machine
# `bash scripts/gpu-test.sh` runs the tests, the benchmarks beside their
# PyTorch peers and the Hugging Face check, writes their JSON under $OUT
# (else .gpu/out) and prints a table (docs/performance.md).
gpu-test:
	bash scripts/gpu-test.sh build

clean:
	rm -rf bin
