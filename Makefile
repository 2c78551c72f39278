# The two commands of the README: `make run` (the demo) and `make test` (the checks CI runs).
# Both create .venv and install with constraints.txt, which pins torch 2.13.0: on Linux x86_64
# PyPI serves its CUDA build (4.4 GiB of the venv with its nvidia-* libraries and triton).
# TORCH_INDEX=<index URL> installs torch from another index first, e.g. PyTorch's CPU builds:
#   make run TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
TORCH_INDEX ?=
PKGS := storage tasks flows
ARGS ?=
# pytest-xdist workers: most tests wait on servers and child processes, so 3 keep 2 cores busy.
WORKERS ?= 3

.PHONY: run test test-core test-prefect-oldest lint typecheck pytest install clean

# .venv with the checkout installed (editable) with the extras $(1), torch from TORCH_INDEX if set.
define install_venv
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH_INDEX),$(BIN)/pip install -q --index-url $(TORCH_INDEX) "$$(grep -E '^torch==' constraints.txt)")
	$(BIN)/pip install -q -c constraints.txt -e ".[$(1)]"
endef
TEST_EXTRAS := dev,demo# everything the tests use (Lightning, transformers, SeaweedFS, ...)
RUN_EXTRAS := prefect,s3,demo# the pipeline, S3 and the demo's scikit-learn; none of the test stack

$(STAMP): pyproject.toml constraints.txt
	$(call install_venv,$(TEST_EXTRAS))
	touch $(STAMP)

$(RUN_STAMP): pyproject.toml constraints.txt
	$(call install_venv,$(RUN_EXTRAS))
	touch $(RUN_STAMP)

install: $(STAMP)

run: $(RUN_STAMP)
	$(BIN)/ckptflow run $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check $(PKGS) tests bench deployments
	$(BIN)/ruff format --check $(PKGS) tests bench deployments

# mypy does not follow setuptools' editable import hook, so it checks the packages
# through a tree of links that spells their installed names (ckptflow.storage, ...); it checks
# them against the standard library of every Python that pyproject.toml declares.
PYTHON_VERSIONS := 3.10 3.11 3.12
typecheck: $(STAMP)
	@mkdir -p build/typecheck/ckptflow
	@for p in $(PKGS); do ln -sfn ../../../$$p build/typecheck/ckptflow/$$p; done
	cd build/typecheck && for v in $(PYTHON_VERSIONS); do \
		echo "mypy, Python $$v:"; ../../$(BIN)/mypy --config-file ../../pyproject.toml --python-version $$v -p ckptflow || exit 1; done

pytest: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider -n $(WORKERS) --dist loadgroup $(ARGS)

test: lint typecheck pytest

# The storage library alone: a wheel of this checkout in a fresh virtualenv with the core
# dependencies only (no Prefect, s3fs or boto3); tests/core_only.py checks it there. Then the
# light [cli] extra in the same virtualenv: tests/cli_only.py checks the store commands.
CORE := build/core-venv
test-core: $(STAMP)
	rm -rf $(CORE) build/wheel
	$(BIN)/pip wheel -q --no-deps -w build/wheel .
	$(PYTHON) -m venv $(CORE)
	$(CORE)/bin/pip install -q --upgrade pip
	$(CORE)/bin/pip install -q -c constraints.txt build/wheel/ckptflow-*.whl
	cd build && ../$(CORE)/bin/python ../tests/core_only.py
	$(CORE)/bin/pip install -q -c constraints.txt "$$(ls build/wheel/ckptflow-*.whl)[cli]"
	cd build && ../$(CORE)/bin/python ../tests/cli_only.py

# The oldest Prefect that pyproject.toml admits (constraints.txt pins the newest for `make test`):
# a virtualenv of .venv's Python that sees .venv's packages (a .pth file) and holds its own
# prefect, and what that Prefect needs other versions of (prefect-aws, ...), installed by .venv's
# pip, which `pip check` then asks for conflicts. It runs the tests that use Prefect: the
# pipeline, the deployments (workers, the UI in Chromium), the CLI's and AWS credential blocks.
PREFECT_TESTS := tests/pipeline tests/deploy tests/test_cli.py tests/test_cli_errors.py \
	tests/test_cli_steps.py tests/storage/test_s3_roles.py
PREFECT_OLDEST = $(shell sed -n 's/.*"prefect>=\([0-9.]*\),.*/\1/p' pyproject.toml)
OLDEST := build/prefect-oldest
OLDEST_PIP = $(BIN)/pip --python $(OLDEST)/bin/python
test-prefect-oldest: $(STAMP)
	rm -rf $(OLDEST)
	$(BIN)/python -m venv --without-pip $(OLDEST)
	$(OLDEST)/bin/python -c 'import pathlib, sys, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "ckptflow-venv.pth").write_text(f"import site; site.addsitedir({sys.argv[1]!r})\n")' \
		"$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	$(OLDEST_PIP) install -q "prefect==$(PREFECT_OLDEST)" prefect-aws "fastapi<0.151" "sqlalchemy<2.1"
	$(OLDEST_PIP) install -q --no-deps -e .
	$(OLDEST_PIP) check
	$(OLDEST)/bin/python -c 'import prefect, sys; assert prefect.__version__ == sys.argv[1], prefect.__version__' "$(PREFECT_OLDEST)"
	PATH="$(abspath $(OLDEST))/bin:$(abspath $(BIN)):$$PATH" $(OLDEST)/bin/python -m pytest -q -p no:cacheprovider -n $(WORKERS) $(or $(ARGS),$(PREFECT_TESTS))

clean:
	rm -rf $(VENV) build .mypy_cache .ruff_cache .pytest_cache
