#!/usr/bin/env bash
# The test suite: installs jaxmoe with its test oracles into .venv, lints, runs pytest.
JAXMOE_EXTRAS=test source "$(dirname "$0")/env.sh"
ruff check jaxmoe tests configs benchmarks launch
ruff format --check jaxmoe tests configs benchmarks launch
exec pytest "$@"
