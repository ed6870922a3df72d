# `make run`: set up a virtualenv and run the tiny ScaleRL job end to end.
# `make test`: set up a virtualenv and run the default test suite.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
WORKDIR ?= runs/tiny

$(BIN)/.installed: requirements.txt requirements-jetstream.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -r requirements-jetstream.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

$(BIN)/.installed-test: $(BIN)/.installed requirements-test.txt
	$(BIN)/pip install -q -r requirements-test.txt
	touch $@

venv: $(BIN)/.installed

run: venv
	JAX_PLATFORMS=cpu $(BIN)/python launch/run.py --config=configs/tiny.py --workdir=$(WORKDIR)

lint: $(BIN)/.installed-test
	$(BIN)/ruff check .

test: lint
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n 2 -q tests

$(BIN)/.installed-tpu: $(BIN)/.installed-test requirements-tpu.txt
	$(BIN)/pip install -q -r requirements-tpu.txt
	touch $@

# Slow checks: two-process runs, the pipeline and server runs, the calibration study, the notebook.
test-slow: $(BIN)/.installed-test
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n 2 -q -m slow tests --ignore=tests/test_dry_run.py --ignore=tests/test_distributed.py

# Ahead-of-time TPU compiles of the full-size configs (libtpu, ~700 MB): every test of
# test_dry_run.py, fast ones included (they skip without libtpu in `make test`), and the
# two-process jax.distributed checks.
test-aot: $(BIN)/.installed-tpu
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n 2 -q -m "slow or not slow" tests/test_dry_run.py
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n 2 -q -m slow tests/test_distributed.py

# The shipped law result (notebooks/results): recipes x 3 seeds at a saturating 768k-sample budget,
# the leave-one-out table, the batch-size axis, the FP32-head pair (bfloat16 body) and a --prune
# sweep that stops a recipe the law rules out, two runs at a time on 2 cores. Every command skips
# finished (and pruned) runs and resumes interrupted ones; the eval noise is measured once from the
# first seed's last checkpoints. ~3.5 h on a quiet 2-core machine.
# A try of the whole pipeline (results, results-extension, results-sizes) at 1/60 of the budgets:
#   make results results-extension results-sizes RESULTS=/tmp/law LAW_SAMPLES=12800
# (50 ScaleRL steps a run, an eval every 3,200 samples; 30 min on 2 cores; the extension at 4x
# LAW_SAMPLES; the predictions are frozen into RESULTS/preregistered.json before the extension runs
# when none is there).
RESULTS ?= notebooks/results
LAW_SAMPLES ?= 768000
# Evals for a budget: one per 32k samples, one per 3.2k below 128k so a short try has points to fit.
EVALS = $$(( $(1) >= 128000 ? $(1) / 32000 : $(1) / 3200 ))
LAW = --config=configs/tiny.py:samples=$(LAW_SAMPLES),evals=$(call EVALS,$(LAW_SAMPLES)) --jobs=2 --workdir=$(RESULTS)
LOO = scalerl,scalerl+rl.loss=ppo_clip+rl.eps_low=0.2+rl.eps_high=0.26,scalerl+rl.aggregation=sample,scalerl+rl.adv_norm=group,scalerl+rl.zero_var_filter=False,scalerl+rl.no_positive_resampling=False,scalerl+rollout.length_control=none
results: venv
	JAX_PLATFORMS=cpu $(BIN)/python launch/sweep.py $(LAW) --recipes=scalerl,minimax,dapo,grpo,magistral --seeds=3
	test -f $(RESULTS)/noise.json || JAX_PLATFORMS=cpu $(BIN)/python launch/eval_noise.py --repeats=8 \
		--out=$(RESULTS)/noise.json $(foreach r,scalerl minimax dapo grpo magistral,$(RESULTS)/$(r)/seed0)
	JAX_PLATFORMS=cpu $(BIN)/python launch/sweep.py $(LAW) --recipes=scalerl,minimax,dapo,grpo,magistral --seeds=3
	JAX_PLATFORMS=cpu $(BIN)/python launch/sweep.py $(LAW) --name=loo --seeds=2 --recipes=$(LOO)
	JAX_PLATFORMS=cpu $(BIN)/python launch/sweep.py $(LAW) --name=batch --seeds=2 \
		--recipes=scalerl,scalerl+prompts=16,scalerl+prompts=64
	JAX_PLATFORMS=cpu $(BIN)/python launch/sweep.py $(LAW) --name=fp32 --seeds=2 \
		--recipes=scalerl+model.dtype=bfloat16,scalerl+model.dtype=bfloat16+rl.fp32_lm_head=False+rollout.fp32_lm_head=False
	JAX_PLATFORMS=cpu $(BIN)/python launch/sweep.py $(LAW) --name=prune --seeds=2 --prune \
		--recipes=scalerl,scalerl+rl.npr_threshold=0.25,scalerl+optim.weight_decay=1.0

# The law out of sample (notebooks/results/extension.md): ScaleRL, DAPO and MiniMax x 3 seeds rerun
# from the shipped warm start to 4x the shipped budget (3,072,000 samples), scored against
# preregistered.json, which was frozen (launch/preregister.py freeze) and committed before these runs
# started. ~50 min per seed of the three recipes at --jobs=2 (ScaleRL 13 min, DAPO and MiniMax ~19 min
# each, two at a time): ~1 h 40 min on a quiet 2-core machine; resumable like every sweep.
EXT_SAMPLES ?= $(shell echo $$(( 4 * $(LAW_SAMPLES) )))
EXT = --config=configs/tiny.py:samples=$(EXT_SAMPLES),evals=$(call EVALS,$(EXT_SAMPLES)) --jobs=2 \
	--workdir=$(RESULTS)/extension --init_checkpoint=$(RESULTS)/warmstart/warmstart/params
results-extension: venv
	test -f $(RESULTS)/preregistered.json || $(BIN)/python launch/preregister.py freeze --runs=$(RESULTS) \
		--recipes=scalerl,dapo,minimax --multiples=2,3,4 --out=$(RESULTS)/preregistered.json
	JAX_PLATFORMS=cpu $(BIN)/python launch/sweep.py $(EXT) --recipes=scalerl,dapo,minimax --seeds=3
	$(BIN)/python launch/preregister.py score --prereg=$(RESULTS)/preregistered.json \
		--runs=$(RESULTS)/extension --out=$(RESULTS)/extension.md

# The model-size axis: ScaleRL at 0.44M (size=m) and 1.5M (size=l) parameters, 2 seeds each at
# SIZE_SAMPLES (1,536,000: 2x the recipe sweep's budget, evals every 32k samples as there), each size
# with its own warm start (sizes/<size>/warmstart); size s is the recipe sweep's ScaleRL seeds 0 and 1
# at 768k. Then two fits of the three sizes: fit_sizes/ with each window from 1.5/16 of its own compute
# (the default), fit_sizes_start/ with every window from the same START_SAMPLES (s's default start,
# 72k). Measured per run: m 39 min, l 113 min (one core each, two at a time): ~2 h 30 min on a quiet
# 2-core machine; resumable like every sweep. Shipped: m and l at 1,536,000.
SIZE_SAMPLES ?= $(shell echo $$(( 2 * $(LAW_SAMPLES) )))
START_SAMPLES ?= $(shell echo $$(( 3 * $(LAW_SAMPLES) / 32 )))
# Size l's two seeds from its warm start: $(call L_SWEEP,SAMPLES) --workdir=DIR --recipes=RECIPE
L_SWEEP = JAX_PLATFORMS=cpu $(BIN)/python launch/sweep.py --jobs=2 --seeds=2 \
	--config=configs/tiny.py:samples=$(1),evals=$(call EVALS,$(1)),size=l \
	--init_checkpoint=$(RESULTS)/sizes/l/warmstart/warmstart/params
# The size table: s (the recipe sweep's ScaleRL seeds 0 and 1), m and the l runs in $(1)
SIZE_FIT = $(BIN)/python launch/fit.py $(RESULTS)/scalerl/seed0 $(RESULTS)/scalerl/seed1 $(RESULTS)/sizes/m \
	$(1) --noise=$(RESULTS)/noise.json
results-sizes: venv
	for size in l m; do JAX_PLATFORMS=cpu $(BIN)/python launch/sweep.py \
		--config=configs/tiny.py:samples=$(SIZE_SAMPLES),evals=$(call EVALS,$(SIZE_SAMPLES)),size=$$size \
		--jobs=2 --workdir=$(RESULTS)/sizes/$$size --recipes=scalerl+size=$$size --seeds=2 || exit 1; done
	$(call SIZE_FIT,$(RESULTS)/sizes/l) --out=$(RESULTS)/fit_sizes
	$(call SIZE_FIT,$(RESULTS)/sizes/l) --start-samples=$(START_SAMPLES) --out=$(RESULTS)/fit_sizes_start

# The pre-registered check of fit_sizes_start/: preregistered_sizes.json (launch/preregister.py
# freeze-ceiling, committed before these runs) says what fresh seeds 2 and 3 of size l show under the
# same window; they run from l's warm start to SIZE_SAMPLES (~113 min per run, two at a time) and are
# scored into sizes_confirmation.md.
results-sizes-confirm: venv
	test -f $(RESULTS)/preregistered_sizes.json || $(BIN)/python launch/preregister.py freeze-ceiling \
		--fit=$(RESULTS)/fit_sizes_start/fit.json --recipe=scalerl+size=l --reference=scalerl \
		--out=$(RESULTS)/preregistered_sizes.json
	$(call L_SWEEP,$(SIZE_SAMPLES)) --workdir=$(RESULTS)/sizes/l_confirm \
		--recipes=scalerl+size=l --first_seed=2
	$(BIN)/python launch/preregister.py score-ceiling --prereg=$(RESULTS)/preregistered_sizes.json \
		--runs=$(RESULTS)/sizes/l_confirm --noise=$(RESULTS)/noise.json --out=$(RESULTS)/sizes_confirmation.md

# Size l out of sample: seeds 2 and 3 of results-sizes-confirm continued from their 1,536,000-sample
# checkpoints to 2x that (one curve each, constant LR after warm-up), copied into sizes/l_long so the
# confirmation above keeps its data. preregistered_l_long.json (launch/preregister.py freeze, committed
# before the continuation's first metrics line) holds both shapes' predictions at 1.5x and 2x from the
# first half; extension_l.md scores them; fit_sizes_long/ is the size table again with l's seeds 2 and 3
# at 3,072,000, every window the default (launch/report.py puts both in the README).
# Needs l_confirm's checkpoints (kept where results-sizes-confirm ran, not shipped); ~110 min two at a time.
LONG_SAMPLES ?= $(shell echo $$(( 2 * $(SIZE_SAMPLES) )))
results-sizes-long: venv
	test -f $(RESULTS)/preregistered_l_long.json || $(BIN)/python launch/preregister.py freeze \
		--runs=$(RESULTS)/sizes/l_confirm --recipes=scalerl+size=l --multiples=1.5,2 \
		--out=$(RESULTS)/preregistered_l_long.json
	test -d $(RESULTS)/sizes/l_long || (mkdir -p $(RESULTS)/sizes/l_long && \
		cp -a "$(RESULTS)/sizes/l_confirm/scalerl+size=l" $(RESULTS)/sizes/l_long/)
	$(call L_SWEEP,$(LONG_SAMPLES)) --workdir=$(RESULTS)/sizes/l_long \
		--recipes=scalerl+size=l --first_seed=2
	$(BIN)/python launch/preregister.py score --prereg=$(RESULTS)/preregistered_l_long.json \
		--runs=$(RESULTS)/sizes/l_long --out=$(RESULTS)/extension_l.md
	$(call SIZE_FIT,$(RESULTS)/sizes/l_long) --out=$(RESULTS)/fit_sizes_long

# Size l at a smaller RL step: l's plateau wanders (second-half checkpoint-to-checkpoint spread
# 0.022-0.028 vs 0.007 at s) with every size at lr 3e-4. preregistered_l_lr.json (launch/preregister.py
# freeze-stability, committed before the runs' first metrics line) says what lr 1e-4 will do; the same
# seeds 0 and 1 run from l's warm start to SIZE_SAMPLES (~113 min two at a time), sizes_lr.md scores the
# claims and fit_sizes_lr/ is the size table with l at lr 1e-4 (s and m as shipped, lr 3e-4).
L_LR ?= 0.0001
results-sizes-lr: venv
	test -f $(RESULTS)/preregistered_l_lr.json || $(BIN)/python launch/preregister.py freeze-stability \
		--baseline="$(RESULTS)/sizes/l/scalerl+size=l" --recipe=scalerl+size=l+optim.lr=$(L_LR) \
		--reference-fit=$(RESULTS)/fit_sizes/fit.json --spread-below=0.015 --out=$(RESULTS)/preregistered_l_lr.json
	$(call L_SWEEP,$(SIZE_SAMPLES)) --workdir=$(RESULTS)/sizes/l_lr \
		--recipes=scalerl+size=l+optim.lr=$(L_LR)
	$(BIN)/python launch/preregister.py score-stability --prereg=$(RESULTS)/preregistered_l_lr.json \
		--runs=$(RESULTS)/sizes/l_lr --noise=$(RESULTS)/noise.json --out=$(RESULTS)/sizes_lr.md
	$(call SIZE_FIT,$(RESULTS)/sizes/l_lr) --out=$(RESULTS)/fit_sizes_lr

# Size l at lr 1e-4 out of sample, as results-sizes-long for lr 3e-4: both shapes' predictions at 1.5x and 2x
# frozen from the 1,536,000-sample runs (preregistered_l_lr_long.json, committed before the continuation),
# the runs copied with their checkpoints into sizes/l_lr_long and continued to LONG_SAMPLES (~140 min two at
# a time), scored into extension_l_lr.md, and the size table again in fit_sizes_lr_long/.
results-sizes-lr-long: venv
	test -f $(RESULTS)/preregistered_l_lr_long.json || $(BIN)/python launch/preregister.py freeze \
		--runs=$(RESULTS)/sizes/l_lr --recipes=scalerl+size=l+optim.lr=$(L_LR) --multiples=1.5,2 \
		--out=$(RESULTS)/preregistered_l_lr_long.json
	test -d $(RESULTS)/sizes/l_lr_long || (mkdir -p $(RESULTS)/sizes/l_lr_long && \
		cp -a "$(RESULTS)/sizes/l_lr/scalerl+size=l+optim.lr=$(L_LR)" $(RESULTS)/sizes/l_lr_long/)
	$(call L_SWEEP,$(LONG_SAMPLES)) --workdir=$(RESULTS)/sizes/l_lr_long \
		--recipes=scalerl+size=l+optim.lr=$(L_LR)
	$(BIN)/python launch/preregister.py score --prereg=$(RESULTS)/preregistered_l_lr_long.json \
		--runs=$(RESULTS)/sizes/l_lr_long --out=$(RESULTS)/extension_l_lr.md
	$(call SIZE_FIT,$(RESULTS)/sizes/l_lr_long) --out=$(RESULTS)/fit_sizes_lr_long

# Fresh seeds of size l at lr 1e-4 under one window start: fit_sizes_lr_long_start/ fits the runs above
# from START_SAMPLES (s's default start; a rule chosen after seeing them, so a sensitivity check), and
# preregistered_l_lr_fresh.json (launch/preregister.py freeze-ceiling, committed before the new runs' first
# metrics line) freezes what seeds 2 and 3, from l's warm start to LONG_SAMPLES, will show under that rule.
# ~260 min two at a time: stop at any point, rerun to resume; then scored into sizes_lr_confirmation.md.
results-sizes-lr-confirm: venv
	test -f $(RESULTS)/fit_sizes_lr_long_start/fit.json || $(call SIZE_FIT,$(RESULTS)/sizes/l_lr_long) \
		--start-samples=$(START_SAMPLES) --out=$(RESULTS)/fit_sizes_lr_long_start
	test -f $(RESULTS)/preregistered_l_lr_fresh.json || $(BIN)/python launch/preregister.py freeze-ceiling \
		--fit=$(RESULTS)/fit_sizes_lr_long_start/fit.json --recipe=scalerl+size=l+optim.lr=$(L_LR) \
		--reference=scalerl --out=$(RESULTS)/preregistered_l_lr_fresh.json
	$(call L_SWEEP,$(LONG_SAMPLES)) --workdir=$(RESULTS)/sizes/l_lr_confirm \
		--recipes=scalerl+size=l+optim.lr=$(L_LR) --first_seed=2
	$(BIN)/python launch/preregister.py score-ceiling --prereg=$(RESULTS)/preregistered_l_lr_fresh.json \
		--runs=$(RESULTS)/sizes/l_lr_confirm --noise=$(RESULTS)/noise.json --out=$(RESULTS)/sizes_lr_confirmation.md

# Policy size at one learning rate: s and m at L_LR as l ran in results-sizes-lr-long, 2 seeds each from
# their own warm starts to LONG_SAMPLES. preregistered_sizes_lr.json (launch/preregister.py freeze-plateau,
# committed before these runs) holds l's plateaus at L_LR and the t-test that decides, per pair of sizes,
# whether the larger policy's plateau is above; scored into sizes_one_lr.md. fit_sizes_one_lr/ fits the
# three sizes from START_SAMPLES (descriptive, not a frozen claim). Estimated per run, two at a time on a
# quiet machine: s ~18 min, m ~80 min (~100 min in all); resumable like every sweep.
ONE_LR = --jobs=2 --seeds=2 --workdir=$(RESULTS)/sizes/sm_lr
results-sizes-one-lr: venv
	test -f $(RESULTS)/preregistered_sizes_lr.json || $(BIN)/python launch/preregister.py freeze-plateau \
		--reference-runs=$(RESULTS)/sizes/l_lr_long --sizes=s:scalerl+optim.lr=$(L_LR),m:scalerl+size=m+optim.lr=$(L_LR) \
		--samples=$(LONG_SAMPLES) --out=$(RESULTS)/preregistered_sizes_lr.json
	JAX_PLATFORMS=cpu $(BIN)/python launch/sweep.py $(ONE_LR) --name=s --recipes=scalerl+optim.lr=$(L_LR) \
		--config=configs/tiny.py:samples=$(LONG_SAMPLES),evals=$(call EVALS,$(LONG_SAMPLES)) \
		--init_checkpoint=$(RESULTS)/warmstart/warmstart/params
	JAX_PLATFORMS=cpu $(BIN)/python launch/sweep.py $(ONE_LR) --name=m --recipes=scalerl+size=m+optim.lr=$(L_LR) \
		--config=configs/tiny.py:samples=$(LONG_SAMPLES),evals=$(call EVALS,$(LONG_SAMPLES)),size=m \
		--init_checkpoint=$(RESULTS)/sizes/m/warmstart/warmstart/params
	$(BIN)/python launch/preregister.py score-plateau --prereg=$(RESULTS)/preregistered_sizes_lr.json \
		--runs=$(RESULTS)/sizes/sm_lr --out=$(RESULTS)/sizes_one_lr.md
	$(BIN)/python launch/fit.py $(RESULTS)/sizes/sm_lr $(RESULTS)/sizes/l_lr_long --noise=$(RESULTS)/noise.json \
		--start-samples=$(START_SAMPLES) --out=$(RESULTS)/fit_sizes_one_lr

# l against s at L_LR on fresh s seeds: the size test above pooled m's seeds, 0.10 apart, into every pair's
# sd. This one asks one question, suggested by s's seeds 0, 1 and l's seeds 0-3 at L_LR, and answers it with
# seeds of s that have not run: preregistered_s_lr_fresh.json (committed before them) holds l's four plateaus
# and the t-test (sd pooled over l's 4 and the fresh s's 2 seeds); scored into sizes_s_fresh.md.
# Estimated ~30 min, two at a time on a quiet machine; resumable.
results-sizes-s-fresh: venv
	test -f $(RESULTS)/preregistered_s_lr_fresh.json || $(BIN)/python launch/preregister.py freeze-plateau \
		--reference-runs=$(RESULTS)/sizes/l_lr_long,$(RESULTS)/sizes/l_lr_confirm --sizes=s:scalerl+optim.lr=$(L_LR) \
		--samples=$(LONG_SAMPLES) --out=$(RESULTS)/preregistered_s_lr_fresh.json
	JAX_PLATFORMS=cpu $(BIN)/python launch/sweep.py --jobs=2 --seeds=2 --first_seed=2 --recipes=scalerl+optim.lr=$(L_LR) \
		--config=configs/tiny.py:samples=$(LONG_SAMPLES),evals=$(call EVALS,$(LONG_SAMPLES)) \
		--init_checkpoint=$(RESULTS)/warmstart/warmstart/params --workdir=$(RESULTS)/sizes/s_lr_fresh
	$(BIN)/python launch/preregister.py score-plateau --prereg=$(RESULTS)/preregistered_s_lr_fresh.json \
		--runs=$(RESULTS)/sizes/s_lr_fresh --out=$(RESULTS)/sizes_s_fresh.md

# README's "The law on the tiny task" numbers, regenerated from the shipped results (no refit).
report: venv
	$(BIN)/python launch/report.py --write-readme

bench: $(BIN)/.installed-test
	JAX_PLATFORMS=cpu $(BIN)/python launch/bench.py

# Side by side with google-tunix (../shared/peers builds its venv): alternating processes,
# medians and per-pair ratios (~20 min on a quiet 2-core machine).
bench-peers: $(BIN)/.installed-test
	bash ../shared/peers/setup.sh
	JAX_PLATFORMS=cpu $(BIN)/python launch/bench_tunix.py --rounds=5

.PHONY: venv lint run test test-slow test-aot results results-extension results-sizes results-sizes-confirm results-sizes-long results-sizes-lr results-sizes-lr-long results-sizes-lr-confirm results-sizes-one-lr results-sizes-s-fresh report bench bench-peers
