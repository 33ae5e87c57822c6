# xmark-gateway developer entry points. Every target does its own set-up and is idempotent.

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export XMARK_TEST_DATABASE_URL ?= postgresql+asyncpg://root@127.0.0.1:5432/test

.PHONY: run test bench-service venv model migrate check-postgres clean

# Virtualenv with the project (editable) and its test extra; reinstalled when pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

# Build the model checkpoint under var/models unless it is already there and verified.
model: venv
	$(BIN)/xmark fetch-model

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

test: venv model check-postgres
	$(BIN)/pytest tests

bench-service: venv model
	$(BIN)/python -m benchmarks.service_bench --json

clean:
	rm -rf $(VENV) .pytest_cache
