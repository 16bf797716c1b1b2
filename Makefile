# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# CPU wheel available locally; an unpinned torch would pull gigabytes of CUDA packages.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.stamp-install

.PHONY: demo test lint typecheck dashboards bench system-deps clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[all,dev]" "$(TORCH)"
	touch $@

demo: $(STAMP)
	$(BIN)/otel-train demo $(ARGS)

# Real Prometheus / Alertmanager / promtool / amtool for the integration tests (Debian packages).
system-deps:
	@if command -v promtool >/dev/null && command -v amtool >/dev/null \
	    && command -v prometheus >/dev/null && command -v prometheus-alertmanager >/dev/null; then \
	  echo "prometheus and alertmanager: present"; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus prometheus-alertmanager >/dev/null; \
	  for svc in prometheus prometheus-alertmanager prometheus-node-exporter; do \
	    (service $$svc stop || true) >/dev/null 2>&1; done; \
	else \
	  echo "WARNING: install Debian packages prometheus and prometheus-alertmanager (needs root);"; \
	  echo "         without them the integration tests are skipped locally and FAIL under CI."; \
	fi

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q -p no:cacheprovider $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check otel_train tests bench dashboards
	$(BIN)/ruff format --check otel_train tests bench dashboards

typecheck: $(STAMP)
	$(BIN)/mypy otel_train

dashboards: $(STAMP)
	$(BIN)/python -m dashboards.build

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) runs build *.egg-info
