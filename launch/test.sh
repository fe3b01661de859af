#!/usr/bin/env bash
# The test suite: installs jaxmoe with its test oracles into .venv, lints, runs pytest.
JAXMOE_EXTRAS=test source "$(dirname "$0")/env.sh"
ruff check jaxmoe tests configs benchmarks launch
ruff format --check jaxmoe tests configs benchmarks launch
# Two workers (the CI machine's two cores), each taking whole test files: a file's module- and
# session-scoped fixtures (the tiny training run, the live server) are built once per worker.
exec pytest -n "${JAXMOE_TEST_WORKERS:-2}" --dist loadfile "$@"
