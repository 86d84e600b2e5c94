# Front door for fp4moe. `make demo` runs the main job, `make test` runs every test.
# Both install missing Debian packages first (scripts/deps.sh) and build into build/.
BUILD ?= build
JOBS  ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps build demo test lm-eval-check clean

all: build

deps:
	@scripts/deps.sh

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

# demo: the build's output goes to a log (shown only when the build fails); then the demo's own lines
demo: deps
	@mkdir -p $(BUILD)
	@echo "demo: building into $(BUILD) (a few minutes the first time; log: $(BUILD)/make-build.log)"
	@$(MAKE) --no-print-directory build > $(BUILD)/make-build.log 2>&1 || \
	  { tail -40 $(BUILD)/make-build.log; echo "demo: the build failed (log: $(BUILD)/make-build.log)"; exit 1; }
	@scripts/demo.sh $(BUILD)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	scripts/fault-check.sh
	scripts/sanitize-check.sh

# lm-evaluation-harness against fp4moe serve and mlx-lm on the same requests (downloads lm-eval; not in `make test`)
lm-eval-check: build
	bash scripts/pyenv.sh $(BUILD) > /dev/null
	$(BUILD)/mlx-venv/bin/python scripts/check_lm_eval.py $(BUILD)/fp4moe --venv $(BUILD)/lm-eval-venv

clean:
	rm -rf $(BUILD) build-fault-* build-asan build-asan.*.log
