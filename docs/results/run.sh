#!/usr/bin/env bash
# Reproduces every result of docs/results.md on the default model (SmolLM2-135M-Instruct, fp32,
# CPU). Each command writes its JSON (records, table rows, the exact arguments and commit) and
# its plot next to this script. docs/results.md gives each command's time on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")"
# Every seed method beside the baselines it claims to beat, with each library default.
PAPERS=full,streamingllm,h2o,tova,snapkv,pyramidkv,ada-snapkv,ada-pyramidkv,caote-h2o,caote-tova,caote-snapkv,ahakv,roco,scissorhands,kvec
# The pooling ablation: the pooling scorers without it, three others with max-pool kernel 7.
POOLING=snapkv-nopool,ahakv-nopool,kvec-nopool,h2o-pool,tova-pool,roco-pool
# CAOTE per query head (gqa="group_l2"), against the default on the base's own score; at
# 1K/2K passkey also TOVA per KV head (tova-head), the per-head reading of the base itself.
CAOTE_HEAD=caote-h2o-l2,caote-tova-l2,caote-snapkv-l2

# Passkey retrieval, query-aware and query-agnostic, one-shot compression of the prompt.
kvcache-ext eval --task passkey --policy "$PAPERS,$POOLING,$CAOTE_HEAD,tova-head" --budget 64,128,256,512 \
  --lengths 1024,2048 --depths 0.1,0.5,0.9 --mode aware,agnostic --json passkey.json --plot passkey.png --no-progress
kvcache-ext eval --task passkey --policy "$PAPERS" --budget 64,128,256,512 --lengths 4096 \
  --depths 0.1,0.5,0.9 --mode aware,agnostic --json passkey-4k.json --plot passkey-4k.png --no-progress

# Needle retrieval (a made-up fact in prose), both modes, one-shot.
kvcache-ext eval --task needle --policy "$PAPERS,$POOLING,$CAOTE_HEAD" --budget 64,128,256,512 --lengths 2048 \
  --depths 0.1,0.5,0.9 --mode aware,agnostic --json needle.json --plot needle.png --no-progress

# Fidelity: KL and top-1 agreement against the full cache over 64 teacher-forced tokens
# after a 2K-token prose context compressed one-shot; two texts.
kvcache-ext eval --task fidelity --policy "$PAPERS,$POOLING,$CAOTE_HEAD" --budget 64,128,256,512 --lengths 2048 \
  --seeds 2 --continuation 64 --json fidelity.json --plot fidelity.png --no-progress

# Perplexity under block-wise eviction (CAOTE's protocol: blocks of 128 over 2K tokens of prose).
# K-VEC is one-shot only; caote-h2o-eq7 is CAOTE's Eq. 7 read literally.
kvcache-ext eval --task ppl --prefill-block 128 \
  --policy full,streamingllm,h2o,tova,snapkv,caote-h2o,caote-tova,caote-snapkv,caote-h2o-eq7,ahakv,roco,scissorhands,snapkv-nopool,ahakv-nopool,h2o-pool,tova-pool,roco-pool,caote-h2o-l2,caote-tova-l2,caote-snapkv-l2 \
  --budget 64,128,256,512 --lengths 2048 --json ppl.json --plot ppl.png --no-progress

# Query-agnostic compression (issue 19): the context compressed before the question, at three
# fractions of each prompt kept; then the multi-question task (one compressed context, three
# questions as turns of one chat).
# KVzip and kvpress's KVzipPress side by side, with the
# prefill cost: bench/agnostic.py (see docs/results.md, "Compress once, ask later").
AGNOSTIC=full,streamingllm,h2o,tova,snapkv,pyramidkv,ada-snapkv,caote-h2o,ahakv,roco,kvec,expected-attention,ada-expected-attention,kvzip,ada-kvzip,kvzip-global
kvcache-ext eval --task passkey --policy "$AGNOSTIC" --keep 0.5,0.25,0.1 --lengths 1024,2048 --depths 0.1,0.5,0.9 \
  --mode agnostic --json agnostic-passkey.json --plot agnostic-passkey.png --no-progress
kvcache-ext eval --task needle --policy "$AGNOSTIC" --keep 0.5,0.25,0.1 --lengths 1024,2048 --depths 0.1,0.5,0.9 \
  --mode agnostic --json agnostic-needle.json --plot agnostic-needle.png --no-progress
kvcache-ext eval --task multi --policy full,kvzip-global,snapkv,expected-attention --keep 0.25,0.1 \
  --lengths 1024,2048 --json multi.json --plot multi.png --no-progress

# RULER-style tasks at 4K tokens (issue 45; docs/results.md "RULER-style tasks at 4K tokens"), in
# the venv with kvpress 0.5.5 (transformers 5.2): every scorer family at three fractions kept,
# kvpress's presses beside them, and KVzip against kvpress's KVzip with the question after.
RULER="--task ruler --lengths 4096 --seeds 1 --max-new-tokens 48 --no-progress"
kvcache-ext eval $RULER --mode aware,agnostic --keep 0.25 --json ruler-4k-keep25.json \
  --policy full,streamingllm,snapkv,snapkv-spans,ada-snapkv,expected-attention,kvpress-snapkv,kvpress-ada-snapkv,kvpress-expected-attention
kvcache-ext eval $RULER --mode aware --keep 0.5,0.25,0.1 --json ruler-4k-aware.json \
  --policy streamingllm,h2o,tova,snapkv,snapkv-spans,ada-snapkv,ahakv,kvec,expected-attention
kvcache-ext eval $RULER --mode aware --keep 0.5,0.25,0.1 --policy caote-tova,roco --json ruler-4k-aware-caote-roco.json
kvcache-ext eval $RULER --mode aware --keep 0.5 --json ruler-4k-aware-kvpress-50.json \
  --policy kvpress-snapkv,kvpress-ada-snapkv,kvpress-expected-attention
kvcache-ext eval $RULER --mode aware --keep 0.1 --json ruler-4k-aware-kvpress-10.json \
  --policy kvpress-snapkv,kvpress-ada-snapkv,kvpress-expected-attention
kvcache-ext eval $RULER --mode agnostic --keep 0.25 --policy full,kvzip-global,kvpress-kvzip \
  --ruler-tasks niah_single_2,niah_multikey_1,niah_multivalue --json ruler-4k-kvzip-agnostic.json
kvcache-ext eval $RULER --mode agnostic --keep 0.5,0.1 --policy kvzip-global,kvpress-kvzip \
  --ruler-tasks niah_single_2,niah_multikey_1,niah_multivalue --json ruler-4k-agnostic-kvzip-3.json
kvcache-ext eval $RULER --mode agnostic --keep 0.5,0.25,0.1 --policy kvzip-global,kvpress-kvzip \
  --ruler-tasks niah_single_1,niah_single_3,niah_multikey_2,niah_multikey_3,niah_multiquery,vt,cwe,fwe \
  --json ruler-4k-agnostic-kvzip-8.json
# Our SnapKV with kvpress's SnapKVPress settings (a window of 64 queries, average pooling over 5):
python - <<'PY'
from kvcache_ext import cli
from kvcache_ext.evaluation.named_policies import register_policy
from kvcache_ext.policies import SnapKV
register_policy("snapkv-w64-avg5", lambda budget: SnapKV(window=64, kernel=5, pooling="avg"))
cli.main(["eval", "--task", "ruler", "--lengths", "4096", "--seeds", "1", "--max-new-tokens", "48", "--no-progress",
          "--mode", "aware", "--keep", "0.5,0.25,0.1", "--policy", "snapkv-w64-avg5",
          "--json", "ruler-4k-aware-snapkv-w64-avg5.json"])
PY
# One table of them all:
kvcache-ext eval --report ruler-4k-keep25.json ruler-4k-kvzip-agnostic.json ruler-4k-aware.json \
  ruler-4k-aware-caote-roco.json ruler-4k-aware-snapkv-w64-avg5.json ruler-4k-aware-kvpress-50.json \
  ruler-4k-aware-kvpress-10.json ruler-4k-agnostic-kvzip-3.json ruler-4k-agnostic-kvzip-8.json

# The second real model, Gemma 3 270M (pip install --no-build-isolation ".[gemma3]"): passkey at 1K
# and 3K tokens, past its 512-token sliding window.
kvcache-ext eval --task passkey --model gemma3-270m --policy full,snapkv,ada-snapkv,streamingllm --budget 256 \
  --lengths 1024,3072 --depths 0.1,0.5,0.9 --mode aware --json passkey-gemma3-270m.json --no-progress

# int8 pages against the model's dtype, RULER-style at 2K tokens (docs/results.md "int8 pages").
RULER2K="--task ruler --lengths 2048 --seeds 1 --max-new-tokens 48 --no-progress"
kvcache-ext eval $RULER2K --mode aware --policy full,ada-snapkv --keep 1,0.5,0.25,0.125 --json ruler-2k-int8-none.json
kvcache-ext eval $RULER2K --mode aware --policy full,ada-snapkv --keep 1,0.5,0.25,0.125 --kv-dtype int8 \
  --json ruler-2k-int8-int8.json

# Keep .25, one prompt per task: Lookahead and sentence spans (aware), the oracle (both modes),
# KVzip's spans and allocation (agnostic); docs/results.md's sections of the same names.
K25="--task ruler --seeds 1 --max-new-tokens 48 --keep 0.25 --no-progress"
kvcache-ext eval $K25 --lengths 2048 --mode aware --json ruler-2k-aware-lookahead.json \
  --policy full,ada-snapkv-lookahead,ada-snapkv-spans-lookahead,snapkv-lookahead
kvcache-ext eval $K25 --lengths 2048 --mode aware --json ruler-2k-aware-lookahead-ablation.json \
  --policy full,ada-snapkv-deferred,ada-snapkv-lookahead4,ada-snapkv-lookahead16,ada-snapkv-spans
kvcache-ext eval $K25 --lengths 2048 --mode aware --json ruler-2k-aware-lookahead-sentences.json \
  --policy full,ada-snapkv-sentences,ada-snapkv-sentences-lookahead
kvcache-ext eval $K25 --lengths 4096 --mode aware --json ruler-4k-aware-lookahead.json \
  --policy full,ada-snapkv-sentences,ada-snapkv-sentences-lookahead,ada-snapkv-lookahead
kvcache-ext eval $K25 --lengths 2048 --mode aware --model gemma3-270m --json ruler-2k-aware-lookahead-gemma3.json \
  --policy full,ada-snapkv,ada-snapkv-lookahead,ada-snapkv-sentences-lookahead
kvcache-ext eval $K25 --lengths 2048 --mode aware --policy full,oracle,ada-snapkv --json ruler-2k-oracle-aware.json
kvcache-ext eval $K25 --lengths 2048 --mode agnostic --policy full,oracle,ada-snapkv --json ruler-2k-oracle-agnostic.json
kvcache-ext eval $K25 --lengths 2048 --mode agnostic --json ruler-2k-agnostic-kvzip-spans.json \
  --policy full,kvzip-global,kvzip-global-spans,kvzip-global-numbers,kvzip-global-sentences,kvzip-global-floor,kvzip-global-gqa-mean
kvcache-ext eval $K25 --lengths 4096 --mode agnostic --json ruler-4k-agnostic-kvzip-spans.json \
  --policy full,kvzip-global,kvzip-global-spans,kvzip-global-numbers,kvzip-global-sentences
kvcache-ext eval $K25 --lengths 4096 --mode agnostic --ruler-tasks niah_single_3,niah_multikey_1 \
  --policy kvzip-global-sentences-mean,kvzip-layers-sentences,kvzip-global-context-sentences,kvzip-global-context \
  --json ruler-4k-agnostic-kvzip-sentences-2.json
kvcache-ext eval $K25 --lengths 2048,4096 --mode agnostic --policy kvzip-global-context-sentences,kvzip-global-context \
  --json ruler-agnostic-kvzip-context-sentences.json

# kvpress's protocol, five prompts per task: both modes at its four ratios, kvpress's KVzip
# beside ours (docs/results.md, "RULER at 4K tokens, five prompts per task"); the agnostic JSON
# was made of four runs of these two commands split by --ruler-tasks, merged by --report.
kvcache-ext eval --protocol kvpress --max-new-tokens 48 --no-progress --mode aware \
  --policy full,snapkv,ada-snapkv,snapkv-spans,ada-snapkv-sentences --json ruler-4k-aware-5prompts.json
kvcache-ext eval --protocol kvpress --max-new-tokens 48 --no-progress --mode aware \
  --policy kvpress-snapkv,kvpress-ada-snapkv --json ruler-4k-aware-5prompts-kvpress.json   # kvpress's venv
A="--protocol kvpress --max-new-tokens 48 --no-progress --mode agnostic"
kvcache-ext eval $A --policy full,expected-attention,kvzip-global,kvzip-global-context-sentences \
  --json ruler-4k-agnostic-5prompts-ours.json
kvcache-ext eval $A --policy kvpress-kvzip --json ruler-4k-agnostic-5prompts-kvpress.json   # kvpress's venv
kvcache-ext eval --report ruler-4k-agnostic-5prompts-ours.json ruler-4k-agnostic-5prompts-kvpress.json \
  --json ruler-4k-agnostic-5prompts.json
P="--protocol kvpress --keep 0.25 --max-new-tokens 48 --no-progress"
kvcache-ext eval $P --mode agnostic --policy full,kvzip,kvzip-global,kvzip-global-context-sentences \
  --json ruler-4k-agnostic-keep25-5prompts.json
kvcache-ext eval $P --mode agnostic --policy full,kvzip-global-context-sentences-rebuild \
  --json ruler-4k-agnostic-keep25-rebuild-5prompts.json
kvcache-ext eval $A --policy full,oracle --json ruler-4k-agnostic-oracle-5prompts.json
kvcache-ext eval $A --policy kvpress-expected-attention --json kvpress-ea.json   # kvpress's venv
kvcache-ext eval $A --policy kvpress-tova --json kvpress-tova.json               # kvpress's venv
kvcache-ext eval --report kvpress-ea.json kvpress-tova.json --json ruler-4k-agnostic-5prompts-kvpress-scorers.json
kvcache-ext eval --report ruler-4k-aware-5prompts.json ruler-4k-aware-5prompts-kvpress.json \
  ruler-4k-agnostic-keep25-5prompts.json ruler-4k-agnostic-keep25-rebuild-5prompts.json ruler-4k-agnostic-5prompts.json \
  ruler-4k-agnostic-oracle-5prompts.json ruler-4k-agnostic-5prompts-kvpress-scorers.json --frontier ruler-4k-5prompts.png
# Held out (seeds 5-9): the keep-0.25 selections on every task (three runs, the last split forward and
# backward over the tasks to use both cores, merged by --report),
# and the token-budget variants at 0.125 on the three tasks sentences lose there.
kvcache-ext eval $P --mode agnostic --first-seed 5 --ruler-tasks niah_multiquery,niah_multivalue \
  --policy full,kvzip-global-context-sentences,kvzip-global-context-sentences-rebuild --json heldout-a.json
kvcache-ext eval $P --mode agnostic --first-seed 5 \
  --ruler-tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,vt,cwe,fwe \
  --policy full,kvzip-global-context-sentences,kvzip-global-context-sentences-rebuild --json heldout-b.json
kvcache-ext eval $P --mode agnostic --first-seed 5 --policy full,kvzip-global --json heldout-c.json
kvcache-ext eval --report heldout-a.json heldout-b.json heldout-c.json --json ruler-4k-agnostic-keep25-heldout.json
kvcache-ext eval $A --keep 0.125 --first-seed 5 --policy full,kvzip-global,kvzip-global-spans,kvzip-global-numbers \
  --json heldout125-ours.json
kvcache-ext eval $A --keep 0.125 --first-seed 5 --policy kvpress-kvzip --json heldout125-kvpress.json   # kvpress's venv
kvcache-ext eval --report heldout125-ours.json heldout125-kvpress.json --json ruler-4k-agnostic-keep125-heldout.json
kvcache-ext eval --protocol kvpress --keep 0.25 --seeds 10 --mode agnostic --max-new-tokens 48 --no-progress --policy \
  full,kvzip-global-context-sentences-share25,kvzip-global-context-sentences-share50,kvzip-global-context-sentences-share75 \
  --json ruler-4k-agnostic-keep25-share-10prompts.json
kvcache-ext eval --protocol kvpress --keep 0.125 --mode agnostic --max-new-tokens 48 --no-progress \
  --ruler-tasks niah_single_2,niah_multiquery,niah_multivalue --policy full,kvzip-global-context-sentences-share50 \
  --json ruler-4k-agnostic-keep125-share50-3tasks.json
kvcache-ext eval --protocol kvpress --keep 0.125 --mode agnostic --first-seed 5 --max-new-tokens 48 --no-progress \
  --ruler-tasks niah_single_2,niah_multiquery,niah_multivalue --policy full,kvzip-global,kvzip-global-sentences,\
kvzip-global-context-sentences,kvzip-global-sentences-token-budgets,kvzip-global-context-sentences-token-budgets \
  --json ruler-4k-agnostic-keep125-heldout-3tasks.json
(cd ../.. && PYTHONPATH=$PWD python bench/kept_by_layer.py --task niah_single_2 --keep 0.125 \
  --policies kvzip-global,kvzip-global-context,kvzip-global-sentences,kvzip-global-context-sentences \
  --out bench/results/kept-by-layer-niah_single_2-keep125-cpu-2026-11-30.json)
kvcache-ext eval --task ruler --ruler-tasks niah_single_2 --lengths 4096 --seeds 1 --keep 0.125 --mode agnostic \
  --max-new-tokens 48 --no-progress --policy kvzip-global-sentences,kvzip-global-context \
  --json ruler-4k-agnostic-keep125-ablation-1prompt.json
# Gemma 3 270M, both modes (each JSON a --report merge of runs split over --ruler-tasks).
G="--protocol kvpress --model gemma3-270m --max-new-tokens 48 --no-progress"
kvcache-ext eval $G --mode aware --policy full,snapkv,ada-snapkv,ada-snapkv-sentences --json ruler-4k-aware-5prompts-gemma3.json
kvcache-ext eval $G --mode aware --policy kvpress-snapkv,kvpress-ada-snapkv \
  --json ruler-4k-aware-5prompts-gemma3-kvpress.json                                              # kvpress's venv
kvcache-ext eval $G --mode agnostic \
  --policy full,kvzip-global,kvzip-global-context-sentences,kvzip-global-context-sentences-share50 \
  --json ruler-4k-agnostic-5prompts-gemma3.json
kvcache-ext eval $G --mode agnostic --policy kvpress-snapkv --json ruler-4k-agnostic-5prompts-gemma3-kvpress.json   # kvpress's venv
kvcache-ext eval --report ruler-4k-aware-5prompts-gemma3.json ruler-4k-aware-5prompts-gemma3-kvpress.json \
  ruler-4k-agnostic-5prompts-gemma3.json ruler-4k-agnostic-5prompts-gemma3-kvpress.json --frontier ruler-4k-5prompts-gemma3.png

# The harness's runs of a prompt decoded together and alone (docs/evaluation.md, "Options").
D="--task ruler --ruler-tasks niah_single_1,niah_multikey_1 --lengths 2048 --seeds 1 --max-new-tokens 48 \
  --keep 0.5,0.25 --mode aware,agnostic --policy full,snapkv,ada-snapkv,tova,ada-snapkv-sentences,kvzip-global --no-progress"
kvcache-ext eval $D --json decode-together-ruler-2k.json
kvcache-ext eval $D --decode-alone --json decode-alone-ruler-2k.json
