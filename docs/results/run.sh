#!/usr/bin/env bash
# Reproduces every result of docs/results.md on the default model (SmolLM2-135M-Instruct, fp32,
# CPU). Each command writes its JSON (records, table rows, the exact arguments and commit) and
# its plot next to this script. About 110 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")"
PAPERS=full,streamingllm,h2o,tova,snapkv,pyramidkv,ada-snapkv,ada-pyramidkv,caote-h2o,caote-tova,caote-snapkv,ahakv,roco,kvec
# At 4K the first sweep leaves out h2o, caote-h2o, ahakv and roco, whose one-shot scoring was
# slow there (about 45 s per run on 2 cores); the last command runs them at 4K, query-aware only.
CHEAP=full,streamingllm,tova,snapkv,pyramidkv,ada-snapkv,ada-pyramidkv,caote-tova,caote-snapkv,kvec

# Passkey retrieval, query-aware and query-agnostic, one-shot compression of the prompt.
kvcache-ext eval --task passkey --policy "$PAPERS" --budget 64,128,256,512 --lengths 1024,2048 \
  --depths 0.1,0.5,0.9 --mode aware,agnostic --json passkey.json --plot passkey.png --no-progress
kvcache-ext eval --task passkey --policy "$CHEAP" --budget 64,128,256,512 --lengths 4096 \
  --depths 0.1,0.5,0.9 --mode aware,agnostic --json passkey-4k.json --plot passkey-4k.png --no-progress

# Perplexity under block-wise eviction (CAOTE's protocol: blocks of 128 over 2K tokens of prose).
kvcache-ext eval --task ppl --prefill-block 128 \
  --policy full,streamingllm,h2o,tova,snapkv,caote-h2o,caote-tova,caote-snapkv,caote-h2o-eq7,ahakv,roco,scissorhands \
  --budget 64,128,256,512 --lengths 2048 --json ppl.json --plot ppl.png --no-progress

# Fidelity: KL and top-1 agreement against the full cache over 64 teacher-forced tokens
# after a 2K-token prose context compressed one-shot; two texts.
kvcache-ext eval --task fidelity --policy "$PAPERS" --budget 64,128,256,512 --lengths 2048 --seeds 2 \
  --continuation 64 --json fidelity.json --plot fidelity.png --no-progress

# Needle retrieval (a made-up fact in prose), both modes, one-shot.
kvcache-ext eval --task needle --policy "$PAPERS" --budget 64,128,256,512 --lengths 2048 \
  --depths 0.1,0.5,0.9 --mode aware,agnostic --json needle.json --plot needle.png --no-progress

# TOVA's two readings (layer-averaged, per KV head) with and without CAOTE: what CAOTE(TOVA)'s
# passkey misses come from.
kvcache-ext eval --task passkey --policy full,tova,tova-head,caote-tova,caote-tova-shared \
  --budget 64,128,256,512 --lengths 1024,2048 --depths 0.1,0.5,0.9 --mode aware \
  --json passkey-tova.json --plot passkey-tova.png --no-progress

# The four methods left out of the 4K sweep above, query-aware only (2942 s, with other jobs).
kvcache-ext eval --task passkey --policy full,h2o,caote-h2o,ahakv,roco --budget 64,128,256,512 \
  --lengths 4096 --depths 0.1,0.5,0.9 --mode aware --json passkey-4k-dense.json --plot passkey-4k-dense.png --no-progress
