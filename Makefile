# clash-ppo: two commands from a fresh clone.
#   make test    create .venv (first use), install, lint (ruff), run the fast and the slow tests
#   make train   create .venv (first use), install, train with the profile that fits this machine
#   make .venv   build the environment alone
#
# royalegym needs Python >= 3.12; the machine default may be older. We look for one in
# this order: $(PYTHON) if given, python3.12 / python3.13 on PATH, then pyenv's installs.

VENV := .venv
VPY  := $(VENV)/bin/python

find_python = $(firstword $(PYTHON) \
	$(foreach v,3.12 3.13,$(shell command -v python$(v) 2>/dev/null)) \
	$(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python $(HOME)/.pyenv/versions/3.13*/bin/python \
	           $(PYENV_ROOT)/versions/3.12*/bin/python /root/.pyenv/versions/3.12*/bin/python))

.PHONY: test lint test-fast test-slow fast-then-slow-rest slow-learner slow-rest train clean $(VENV)

$(VENV)/.installed: pyproject.toml
	@py="$(strip $(find_python))"; \
	if [ -z "$$py" ]; then \
	  echo "error: no Python >= 3.12 found (royalegym needs it)." >&2; \
	  echo "  install one, e.g. 'pyenv install 3.12' or your OS package python3.12," >&2; \
	  echo "  or point at it: make test PYTHON=/path/to/python3.12" >&2; \
	  exit 2; \
	fi; \
	if ! "$$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then \
	  echo "error: $$py is $$("$$py" -V 2>&1); royalegym needs Python >= 3.12 (make ... PYTHON=...)" >&2; exit 2; \
	fi; \
	echo "creating $(VENV) with $$py ($$("$$py" -V 2>&1))"; \
	"$$py" -m venv $(VENV) && \
	$(VPY) -m pip install -q --upgrade pip && \
	$(VPY) -m pip install -q -e '.[dev,plot,tb]' && \
	touch $@

$(VENV): $(VENV)/.installed

# Two pytest processes side by side (make -j2): tests/test_ppo_clash.py's slow tests in one, the
# fast tests and then the other files' slow tests in the other, with the learner's tests marked
# other_half, to bring the halves' lengths close (tests/conftest.py). A test trains on one torch thread
# (the smoke profile's), so one after the other, one core of a 2-core machine sat idle (the README
# has the times). Each recipe line's output prints whole when it ends, the fast tests' first;
# either half failing fails the target; Ctrl-C stops both. The learner's half keeps its own pytest
# cache, so neither overwrites the other's last failures. pytest exits 5 when a marker selects no
# test; a half may legitimately be empty.
PYTEST_FAST         = $(VPY) -m pytest -q
PYTEST_SLOW_LEARNER = $(VPY) -m pytest -q --durations=12 -m learner_half -o cache_dir=.pytest_cache/slow-learner tests/test_ppo_clash.py || [ $$? -eq 5 ]
PYTEST_SLOW_REST    = $(VPY) -m pytest -q --durations=12 -m "slow and not learner_half" || [ $$? -eq 5 ]

# The linter first: a second, and a lint error fails before ten minutes of tests
# (pyproject.toml's [tool.ruff] says which rules and why).
test: lint
	@$(MAKE) --no-print-directory -j2 --output-sync=target slow-learner fast-then-slow-rest

lint: $(VENV)/.installed
	$(VPY) -m ruff check .

test-fast: $(VENV)/.installed
	$(PYTEST_FAST)

test-slow: $(VENV)/.installed
	@$(MAKE) --no-print-directory -j2 --output-sync=target slow-learner slow-rest

fast-then-slow-rest: $(VENV)/.installed
	$(PYTEST_FAST)
	$(PYTEST_SLOW_REST)

slow-learner: $(VENV)/.installed
	$(PYTEST_SLOW_LEARNER)

slow-rest: $(VENV)/.installed
	$(PYTEST_SLOW_REST)

# laptop where CUDA is present, the cpu profile otherwise.
train: $(VENV)/.installed
	@if [ ! -f ppo_clash.py ]; then echo "training is not built yet (ppo_clash.py lands with issue 4)"; exit 1; fi
	@profile=$$($(VPY) -c 'import torch; print("laptop" if torch.cuda.is_available() else "cpu")'); \
	echo "python ppo_clash.py --profile $$profile $(ARGS)"; \
	$(VPY) ppo_clash.py --profile $$profile $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
