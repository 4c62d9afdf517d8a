# The two set-up commands (see README.md):
#   make run    install missing packages, build, train the embedded default on the CPU
#   make test   the same set-up, then the whole test suite; ends with "N passed, N failed"
# Options: SANITIZE=1 (ASan+UBSan build in build-asan, unit tests only), JOBS=n.
JOBS ?= $(shell nproc)
ifeq ($(SANITIZE),1)
BUILD ?= build-asan
CMAKE_FLAGS += -DMOE_SANITIZE=ON
TEST_LABEL ?= unit
else
BUILD ?= build
TEST_LABEL ?=
endif

.PHONY: run test test-gpu deps test-deps build clean

deps:
	@bash scripts/deps.sh

test-deps:
	@bash scripts/deps.sh --test

build:
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

run: deps build
	./$(BUILD)/moe-dist train configs/tiny.ini

test: test-deps build
	@bash scripts/run-tests.sh $(BUILD) "$(TEST_LABEL)"

# On a GPU host: build with CUDA for T4 and the local GPU, run the GPU tests (labels gpu
# and mgpu: the two-GPU ones skip with fewer GPUs).
test-gpu: test-deps
	@cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOE_CUDA=ON \
	  -DCMAKE_CUDA_ARCHITECTURES="75;$$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)" >/dev/null
	@cmake --build build-gpu -j $(JOBS)
	@bash scripts/run-tests.sh build-gpu gpu

clean:
	rm -rf build build-asan
