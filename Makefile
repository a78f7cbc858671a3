# The two set-up commands of the README: `make demo` (the main job) and `make test` (the suite).
# Both create .venv on first use and install the project into it; later runs reuse it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch: the release, and the index its build comes from. PyTorch's CPU-only index by default, so a
# machine without a GPU gets the CPU build (about 190 MB) instead of PyPI's CUDA build (several GB);
# for a GPU build: TORCH_INDEX=https://download.pytorch.org/whl/cu130, or TORCH_INDEX= for PyPI's.
# It is an extra index: a wheel that pip's own configuration supplies (a local wheel folder or
# index) is still found, and an index that cannot be reached is skipped after one try.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_TORCH = --retries 0 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"

# The run pinned to a transformers release whose MLA attention caches expanded K/V (<= 5.14):
# the rewritten model must cache latents there too.
LEGACY_VENV := .venv-legacy
TRANSFORMERS_LEGACY ?= transformers==5.14.1
LEGACY_TESTS := tests/fx_passes tests/mla_ops/test_paged_cache.py tests/mla_ops/test_paged_ops.py \
	tests/mla_ops/test_hf_cache.py tests/mla_ops/test_hf_cache_kwargs.py
# The same tests pinned to the last release of the mixed forms (5.15-5.17): the MLA families
# cache latents, the DeepSeek Sparse Attention ones still expanded K/V (MLACache refuses those).
MIXED_VENV := .venv-mixed
TRANSFORMERS_MIXED ?= transformers==5.17.0
# There, the families' tests run for four families whose attention or cache differs (dense with
# complex RoPE, three heads, a hybrid, a sparse one still caching expanded K/V there): the newest
# release runs them all.
MIXED_FAMILIES ?= deepseek_v2,minicpm3,kimi_linear,deepseek_v32

# Test workers (pytest-xdist): one per CPU the system reports, at most 8 (each holds torch and
# transformers, ~1 GB); an idle worker takes queued tests from a busy one (worksteal).
# `make test TEST_WORKERS=0` runs the suite in one process.
TEST_WORKERS ?= auto
XDIST := -n $(TEST_WORKERS) --maxprocesses=8 --dist worksteal
# One intra-op thread per test process: the workers, and the processes the distributed tests
# spawn (2-4 each), share the machine's cores; more threads each oversubscribe them (on a 2-core
# machine the tensor-parallel tests took 119 s with one thread against 144 s with two).
TEST_THREADS ?= 1

.PHONY: demo test test-legacy test-mixed lint format install clean

# One venv, two sentinels: the demo needs transformers; the suite also Triton (its interpreter runs
# the kernels on CPU), ONNX and the test tools.
$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	touch $@

$(VENV)/.installed-demo: pyproject.toml Makefile $(VENV)/.created
	$(PY) -m pip install --quiet $(PIP_TORCH)
	$(PY) -m pip install --quiet -e ".[hf,bench]"
	touch $@

$(VENV)/.installed: pyproject.toml Makefile $(VENV)/.created
	$(PY) -m pip install --quiet $(PIP_TORCH)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $@

# A venv pinned to one transformers release: $(1) its folder, $(2) the requirement. It reuses the
# suite's venv for everything else (a .pth line adds that venv's site-packages after its own, the
# project's editable install included), so it costs only the pinned release and the few
# dependencies that release pins differently; its own site-packages comes first on sys.path.
PURELIB = -c "import sysconfig; print(sysconfig.get_path('purelib'))"
define pinned_venv
$(1)/.installed: pyproject.toml Makefile $(VENV)/.installed
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
	$(PY) -c "import sysconfig; print('import site; site.addsitedir(%r)' % sysconfig.get_path('purelib'))" \
		> "$$$$($(1)/bin/python $(PURELIB))/suite_venv.pth"
	$(1)/bin/python -m pip install --quiet "$(2)"
	touch $$@
endef
$(eval $(call pinned_venv,$(LEGACY_VENV),$(TRANSFORMERS_LEGACY)))
$(eval $(call pinned_venv,$(MIXED_VENV),$(TRANSFORMERS_MIXED)))

install: $(VENV)/.installed

demo: $(VENV)/.installed-demo
	$(PY) examples/generate.py $(DEMO_ARGS)

test: install
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-legacy: $(LEGACY_VENV)/.installed
	OMP_NUM_THREADS=$(TEST_THREADS) $(LEGACY_VENV)/bin/python -m pytest -q $(XDIST) \
		$(LEGACY_TESTS) $(PYTEST_ARGS)

test-mixed: $(MIXED_VENV)/.installed
	OMP_NUM_THREADS=$(TEST_THREADS) MLA_TEST_FAMILIES=$(MIXED_FAMILIES) \
		$(MIXED_VENV)/bin/python -m pytest -q $(XDIST) $(LEGACY_TESTS) $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(LEGACY_VENV) $(MIXED_VENV) build *.egg-info .pytest_cache
