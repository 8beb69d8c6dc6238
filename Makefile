# megasuite: `make install`, then `make test`.  `make help` lists the targets.

PYTHON ?= python3
VENV ?= .venv
# The CPU build on CPU machines.  A torch already importable that satisfies
# megacore's range (a CUDA build, say) is kept; see scripts/install.py.
TORCH_SPEC ?= torch==2.13.0
# An index for the torch step only, e.g. PyTorch's CPU wheel index on a CPU-only machine
# whose default index would serve the CUDA build.
TORCH_INDEX ?=
# How the packages go in: auto (uv where it is on PATH or pip can install it, else pip) or pip.
INSTALLER ?= auto

PACKAGE_FILES := pyproject.toml $(wildcard packages/*/pyproject.toml) scripts/install.py
STAMP := $(VENV)/.installed
BIN := $(VENV)/bin

.PHONY: help install demo test lint format bench bench-gpu fig7 data finetune-data finetune-demo clean

RECIPE ?= default
WORKERS ?= 2

help:
	@echo "make demo      the whole job on bundled data: corpus -> GPT at tp=2 dp=2 -> evaluations"
	@echo "make install   create $(VENV) with torch and the five packages (editable, test extras)"
	@echo "make test      install if needed, then ruff and pytest over every package and tests/"
	@echo "make lint      ruff check and format check only"
	@echo "make format    let ruff fix imports and formatting"
	@echo "make bench     run benchmarks/, writing JSON under bench-results/"
	@echo "make bench-gpu GPT-2 1.2B on one GPU, megatrain vs HF, megatron-core, torchtitan (bench-results/gpu.json; BENCH_GPU_ARGS=--small on a CPU)"
	@echo "make finetune-data  real rows of MNLI, QQP, SQuAD 1.1/2.0, RACE from the package index (data/finetune)"
	@echo "make finetune-demo  a tiny BERT pretrained on bundled data, fine-tuned on those rows, with a summary"
	@echo "make fig7      the paper's Figure 7 small: BERT post_ln vs pre_ln at 4 and 24 layers (bench-results/fig7)"
	@echo "make data      build the corpus of pipelines/corpus/\$$(RECIPE).toml (default: bundled sample text)"
	@echo "make clean     remove $(VENV) and caches"
	@echo "variables: PYTHON=$(PYTHON) VENV=$(VENV) TORCH_SPEC=$(TORCH_SPEC) TORCH_INDEX=$(TORCH_INDEX) INSTALLER=$(INSTALLER)"

install: $(STAMP)

# The stamp makes a second `make install` a no-op until a pyproject changes.
# The version check is shell, not Python, so an old interpreter cannot fail on syntax first.
$(STAMP): $(PACKAGE_FILES)
	@command -v $(PYTHON) >/dev/null 2>&1 || { \
	  echo "make install: no Python interpreter '$(PYTHON)' found; install Python >= 3.10 or run: make install PYTHON=/path/to/python3" >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || { \
	  echo "make install: megasuite needs Python >= 3.10, but $(PYTHON) is $$($(PYTHON) -V 2>&1); run: make install PYTHON=/path/to/python3.10-or-newer" >&2; exit 1; }
	@$(PYTHON) scripts/install.py --venv $(VENV) --torch "$(TORCH_SPEC)" --torch-index "$(TORCH_INDEX)" \
	  --installer $(INSTALLER)
	@touch $@

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The fine-tuning tests also read real task rows (make finetune-data), and megadata's Llama 3
# tests Meta's tokenizer.model; without a package index they are skipped, each with its reason
# in pytest's summary.
test: lint
	@$(BIN)/python scripts/fetch_finetune_data.py --out data/finetune --cache data/downloads || \
	  echo "make test: no real fine-tuning rows (see above); the tests that read them will be skipped"
	@$(BIN)/python scripts/fetch_llama3_tokenizer.py --out data/raw/llama3 --cache data/downloads || \
	  echo "make test: no Llama 3 tokenizer (see above); the tests that read it will be skipped"
	$(BIN)/pytest

# Speed is measured here, never by timed tests.
bench: install
	$(BIN)/python benchmarks/bench_tensor_parallel.py --out bench-results/tensor_parallel.json
	$(BIN)/python benchmarks/bench_pipeline_bubble.py --out bench-results/pipeline_bubble.json
	$(BIN)/python benchmarks/bench_gpt_train.py --out bench-results/gpt_train.json
	$(BIN)/python benchmarks/bench_gpt_train.py --model llama --out bench-results/llama_train.json
	$(BIN)/python benchmarks/bench_gpt_train.py --model mixtral --out bench-results/mixtral_train.json
	$(BIN)/python benchmarks/bench_gpt_train.py --model gpt-oss --out bench-results/gpt_oss_train.json
	$(BIN)/python benchmarks/bench_gpt_train.py --model deepseek --out bench-results/deepseek_train.json
	$(BIN)/python benchmarks/bench_windowed_attention.py --out bench-results/windowed_attention.json
	$(BIN)/python scripts/fetch_sample_data.py --out data/raw
	$(BIN)/python benchmarks/bench_megadata.py --out bench-results/megadata.json
	$(BIN)/python benchmarks/bench_megadata.py --dedup-scaling --sizes 2000 20000 --out bench-results/megadata_dedup_scaling.json
	$(BIN)/python benchmarks/bench_plan.py --out bench-results/plan.json
	$(BIN)/python benchmarks/bench_plan_search.py --out bench-results/plan_search.json
	$(BIN)/python benchmarks/bench_context_parallel.py --out bench-results/context_parallel.json
	$(BIN)/python benchmarks/bench_fsdp.py --out bench-results/fsdp.json
	$(BIN)/python benchmarks/bench_async_checkpoint.py --out bench-results/async_checkpoint.json
	$(BIN)/python benchmarks/bench_hf_convert.py --out bench-results/hf_convert.json
	$(BIN)/python benchmarks/bench_moe_dispatch.py --seeds 1 --out bench-results/moe_dispatch.json

# One GPU, the paper's 1.2B in bf16; not part of `bench`, which runs on any CPU.
BENCH_GPU_ARGS ?=
bench-gpu: install
	$(BIN)/python benchmarks/bench_gpu.py --out bench-results/gpu.json $(BENCH_GPU_ARGS)

# The default recipe's inputs come from the package index (scripts/fetch_sample_data.py).
# default-news takes default-wiki's tokenizer (the blend example): that corpus is built first.
data: install
	@case "$(RECIPE)" in llama3) $(BIN)/python scripts/fetch_sample_data.py --out data/raw && \
	  $(BIN)/python scripts/fetch_llama3_tokenizer.py --out data/raw/llama3 --cache data/downloads;; esac
	@case "$(RECIPE)" in default|default-bert|default-wiki|default-news) $(BIN)/python scripts/fetch_sample_data.py --out data/raw;; esac
	@case "$(RECIPE)" in default-news) $(MAKE) --no-print-directory data RECIPE=default-wiki;; esac
	$(BIN)/megadata run --recipe pipelines/corpus/$(RECIPE).toml --workers $(WORKERS) $(if $(SCHEDULER),--scheduler $(SCHEDULER))

# The main job, end to end on the default recipe's bundled text: build the corpus (which
# holds some documents out and writes WikiText- and LAMBADA-style files from them), train a
# tiny GPT at tp=2 x dp=2 on CPU processes, evaluate it on the held-out files, show a sample.
# Rerunning resumes: finished steps are not redone.
DEMO ?= runs/demo
CORPUS := data/corpus/default
demo: data
	$(BIN)/megatrain run --config pipelines/models/gpt2-tiny.toml \
	  parallel.tensor_model_parallel_size=2 parallel.data_parallel_size=2 \
	  'training.output_dir="$(DEMO)/run"' 'data.corpus="$(CORPUS)"' --save $(DEMO)/ckpt --load $(DEMO)/ckpt
	$(BIN)/megaeval wikitext103 --ckpt $(DEMO)/ckpt --data $(CORPUS)/eval/wiki.test.tokens \
	  --seq-len 256 --stride 32 --tp 2 --json $(DEMO)/wikitext103.json
	$(BIN)/megaeval lambada --ckpt $(DEMO)/ckpt --data $(CORPUS)/eval/lambada.jsonl --json $(DEMO)/lambada.json
	$(BIN)/megaeval lambada --ckpt $(DEMO)/ckpt --data $(CORPUS)/eval/lambada.jsonl --no-strict \
	  --json $(DEMO)/lambada-nonstrict.json
	@if [ -s $(DEMO)/sample.txt ] && [ $(DEMO)/sample.txt -nt $(DEMO)/ckpt/latest ]; then \
	  echo "demo: reused $(DEMO)/sample.txt (the checkpoint has not changed since it was written)"; \
	  cat $(DEMO)/sample.txt; \
	else \
	  $(BIN)/megatrain generate --ckpt $(DEMO)/ckpt --prompt "The" --top-k 40 --top-p 0.9 \
	    --max-new-tokens 40 > $(DEMO)/sample.tmp && mv $(DEMO)/sample.tmp $(DEMO)/sample.txt && \
	  cat $(DEMO)/sample.txt; \
	fi
	$(BIN)/python scripts/demo_summary.py --dir $(DEMO)

# Real rows of every fine-tuning task in its official format, from the datasets library's source
# archive on the package index (cached in data/downloads; where each came from and its licence:
# data/finetune/SOURCES.json).
finetune-data: install
	$(BIN)/python scripts/fetch_finetune_data.py --out data/finetune --cache data/downloads

# Pretrain (or reuse) the tiny BERT on the bundled BERT corpus, fine-tune it on SQuAD 1.1's rows
# (scored before and after), then MNLI, QQP, SQuAD 2.0 and RACE; a summary table at the end.
# Rerunning reuses what is done.
FINETUNE_DEMO ?= runs/finetune-demo
finetune-demo: finetune-data
	$(MAKE) data RECIPE=default-bert
	$(BIN)/python scripts/finetune_demo.py --dir $(FINETUNE_DEMO) --data data/finetune \
	  --corpus data/corpus/default-bert

# The paper's Figure 7, small: BERT's block orders (a) post_ln and (b) pre_ln, shallow and deep.
fig7: install
	$(MAKE) data RECIPE=default-bert
	$(BIN)/python benchmarks/bench_fig7.py --corpus data/corpus/default-bert --out bench-results/fig7

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache bench-results
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
